"""A run directory is enough (issue 41): `grt train --out R --resume` continues from R's saved
config.json, on 1 rank or 2; --print-config prints the config.json the run writes; a run without
--out gets its own named directory; an explicit `--set model.vocab_size` the data contradicts is
refused; a resume with nothing to train says so and changes no file (issue 40)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from commands import resume_command, train_command
from multiproc import grt
from train_jobs import run_job, train_args

from pretrain import train as train_cli

REPO = Path(__file__).resolve().parents[2]
STEPS = 3  # a resume trains it to 4
QUICK = ("train.warmup_steps=0", "train.eval_every=0")  # a one-step run that is not refused
NAMED = r"runs/micro-grt-\d{8}-\d{6}"


@pytest.fixture(scope="module")
def finished(shards, tmp_path_factory) -> Path:
    """micro-grt trained 3 steps on 1 rank (warmup 2, not the preset's), its checkpoint at step 3; a
    global batch of 8 (micro-batch 4 x grad_accum 2), which 2 ranks split too."""
    out = tmp_path_factory.mktemp("finished") / "run"
    rcs, job = run_job(train_args(shards, out, STEPS, "train.grad_accum=2"), out.parent / "logs", world=1, timeout=300)
    assert rcs == [0], job.output()
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """`grt train <argv>` in this process: (exit code, stdout, stderr)."""
    rc = train_cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def resumed(out: Path, world: int, *extra: str) -> str:
    rcs, job = run_job(resume_command(out, *extra), out.parent / "logs", world=world, timeout=300)
    assert rcs == [0] * world, job.output()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    return job.output(0)


def test_resume_from_the_run_directory_alone_on_one_rank(finished, shards, tmp_path, capsys, monkeypatch):
    """--out R --resume takes R's config.json as the base (no --data, no preset defaults such as
    warmup 2000 coming back); what --print-config prints is byte for byte the config.json written."""
    monkeypatch.chdir(REPO)  # as the ranks run
    out = copy_of(finished, tmp_path)
    # the same files named another way (the run saved an absolute --data, a relative --ds-config) change nothing
    same = ("--data", os.path.relpath(shards, REPO), "--ds-config", str(REPO / "ds_configs" / "zero3.json"))
    rc, printed, err = run_main(capsys, *resume_command(out, "--steps", "4", *same, "--print-config")[1:])
    assert rc == 0, err
    log = resumed(out, 1, "--steps", "4", *same)
    written = (out / "config.json").read_text()
    assert printed == written
    assert json.loads(written)["train"]["warmup_steps"] == 2
    changes = next(line for line in log.splitlines() if "with changes" in line)
    assert f"train.steps {STEPS} -> 4" in changes and "ds_config" not in changes and "data" not in changes, changes


def test_resume_from_the_run_directory_alone_on_two_ranks(finished, tmp_path):
    """The same on 2 ranks (the global batch kept), and through grt launch's resolution: the ranks'
    config is the saved one with the command line's changes."""
    from launcher.cli import resolve_train_config

    out = copy_of(finished, tmp_path)
    config, resume, _ = resolve_train_config(resume_command(out, "--steps", "4")[1:], 2)
    assert resume and config["train"]["warmup_steps"] == 2 and config["train"]["steps"] == 4
    assert config["data"] == json.loads((finished / "config.json").read_text())["data"]
    log = resumed(out, 2, "--steps", "4")
    assert "on 2 rank(s) instead of 1" in log, log


def file_states(root: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_nothing_to_do_is_said_and_changes_no_file(finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    before = file_states(out)
    r = grt(*resume_command(out))
    assert r.returncode == 0, r.stderr
    assert f"grt train: nothing to do: {out} is at step {STEPS} of {STEPS}" in r.stderr, r.stderr
    assert not r.stdout.strip(), r.stdout
    rc, printed, err = run_main(capsys, *resume_command(out, "--steps", "1")[1:])
    assert rc == 0 and f"is at step {STEPS} of 1 (train.steps=1 is below the checkpoint's step)" in err, err
    # grt launch plans the start on its host: no rank is started, no launch file written
    from launcher.cli import main as launch

    assert launch(["--cpu", "--procs-per-node", "2", "--", *resume_command(out)[1:]]) == 0
    assert f"grt launch: nothing to do: {out} is at step {STEPS} of {STEPS}" in capsys.readouterr().err
    assert file_states(out) == before


def test_a_run_without_out_gets_its_own_named_directory(shards, tmp_path, monkeypatch, capsys):
    from launcher.cli import resolve_train_config

    monkeypatch.chdir(tmp_path)
    args = train_command("micro-grt", shards, None, 1, 4, "ds_configs/zero3.json", QUICK)
    rc, printed, err = run_main(capsys, *args[1:], "--dry-run")
    assert rc == 0, err
    said = re.search(rf"grt train: start: run directory {re.escape(str(tmp_path))}/({NAMED}): a fresh start", err)
    assert said is not None, err
    assert "dry run: would train" in err and f"into {said[1]}" in err, err
    assert json.loads(printed)["out"] == said[1], printed  # the config.json the run would write
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
    config, _, _ = resolve_train_config(args[1:], 1)  # once, on the launching host: every rank's
    assert re.fullmatch(rf"{re.escape(str(tmp_path))}/{NAMED}", config["out"]), config["out"]


def test_the_vocabulary_is_the_datas_said_and_an_explicit_one_refused(shards, tmp_path, capsys):
    args = train_command("micro-grt", shards, tmp_path / "run", 1, 4, "ds_configs/zero3.json", QUICK)[1:]
    rc, printed, err = run_main(capsys, *args, "--set", "model.vocab_size=100", "--print-config")
    assert rc == 2 and printed == "", (printed, err)
    assert len(err.strip().splitlines()) == 1 and "model.vocab_size=100" in err and "512" in err, err
    tiny = train_command("tiny-grt", shards, tmp_path / "run", 1, 4, "ds_configs/zero3.json", QUICK)[1:]
    rc, printed, err = run_main(capsys, *tiny, "--print-config")
    assert rc == 0, err
    assert json.loads(printed)["model"]["vocab_size"] == 512
    assert "model.vocab_size 4096 -> 512" in err, err


def test_a_mixture_given_in_another_order_is_refused_naming_both_orders(shards, tmp_path):
    """Swapping the order of --data mixture flags is not "the shard list changed": the line says
    what was compared and what differed (a mixture draws its sources in the order given)."""
    import torch

    from grt_common.errors import ConfigError
    from pretrain.runs.data_spec import load_manifest
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.start.plan import check_data_order

    saved, now = f"a=0.5:{shards},b=0.5:{shards}", f"b=0.5:{shards},a=0.5:{shards}"
    tag = tmp_path / "checkpoints" / "step00000001"
    tag.mkdir(parents=True)
    (tag / "config.json").write_text(json.dumps({"data": saved}))
    torch.save({"loader": {"fingerprint": load_manifest(saved).fingerprint("train")}}, tag / "rank0_state.pt")
    check_data_order(RunConfig(data=saved), load_manifest(saved), tag.parent, tag.name)  # the same order: goes on
    with pytest.raises(ConfigError, match=r"another order than at checkpoint step00000001 \(a, b -> b, a;"):
        check_data_order(RunConfig(data=now), load_manifest(now), tag.parent, tag.name)


def test_a_resume_keeps_the_saved_settings_but_not_an_earlier_consent(tmp_path):
    """The saved config is the base; a consent an earlier start gave (train.allow_data_change) is
    not carried over, and --steps replaces a saved budget in tokens."""
    from pretrain.runs.run_config import RunConfig

    saved = RunConfig(data="m.json", out=str(tmp_path))
    saved.train.tokens, saved.train.warmup_steps, saved.train.allow_data_change = 1e6, 7, True
    saved.save(tmp_path / "config.json")
    cfg = train_cli.config_from_args(train_cli.build_parser().parse_args(resume_command(tmp_path, "--steps", "9")[1:]))
    t = cfg.train
    assert (t.steps, t.tokens, t.warmup_steps, t.allow_data_change, cfg.data) == (9, 0.0, 7, False, "m.json")
