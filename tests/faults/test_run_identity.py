"""A resume names a run, and one setting has one value (issue 49, docs/reliability.md "Nothing
clobbered").

- `--out` at or inside a run's `checkpoints/` folder (with or without --resume) is refused before
  anything is written: the whole run directory hashed before and after;
- a --resume whose run directory lacks its config.json (missing or cut off) says so, not
  "data required";
- a saved relative `out` is resolved where it was saved (the run directory that holds the
  config.json), not against the working directory of the resume;
- a shipped DeepSpeed config named in a saved config is the shipped file, whatever files the
  working directory of the resume holds;
- the first line a start says names the run directory it writes;
- a flag and a `--set` of the same setting that disagree are refused (--out, --data, --steps,
  micro-batch, grad-accum, --ds-config), before anything is written.

Every refusal is exit 2, one line, no traceback. Real `grt train` processes where today's code
would train; in-process where nothing can start (--print-config, --dry-run).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from commands import error_lines
from train_jobs import REPO, cli, train_args

from pretrain import train as train_cli

STEPS = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_name, None)
NOISE = ("[WARNING]", "Warning", "warn(")  # torch's and DeepSpeed's import-time warnings


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (and `root` itself): path -> sha256 ('dir' for a folder)."""
    if not root.exists():
        return {}
    out = {".": "dir"}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def grt_train(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def lines(stderr: str) -> list[str]:
    return [line for line in error_lines(stderr, *NOISE) if not line.startswith("  ")]


def refused(rc: int, stderr: str, *words: str) -> str:
    said = lines(stderr)
    assert rc == 2, f"exit {rc}:\n{stderr[-3000:]}"
    assert len(said) == 1 and said[0].startswith("grt train: error: "), said
    assert "Traceback" not in stderr
    for word in words:
        assert word in said[0], (word, said[0])
    return said[0]


@pytest.fixture(scope="module")
def base_run(shards, tmp_path_factory) -> Path:
    """A finished one-process run of STEPS steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("identity") / "run"
    res = grt_train(*train_args(shards, out, STEPS, "train.save_every=2"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return out


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = train_cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# --------------------------------------------------------------------------- a resume names a run


@pytest.mark.parametrize(
    "where, resume",
    [
        ("checkpoints/step00000004", True),
        ("checkpoints", True),
        ("checkpoints/step00000004", False),
        ("checkpoints/step00000004/new", False),
        ("checkpoints/new", False),
    ],
)
def test_out_at_or_inside_a_checkpoint_folder_is_refused_changing_nothing(shards, run, where, resume):
    """Before: `--out R/checkpoints/step4 --resume` took the tag's config.json as the base and
    trained a fresh run from step 0 inside the checkpoint, rewriting its config.json."""
    out = run / where
    args = ["train", "--out", str(out), "--resume"] if resume else train_args(shards, out, 2)
    before = tree(run)
    res = grt_train(*args)
    line = refused(res.returncode, res.stderr, "--out", "checkpoint")
    assert str(run) in line, line
    assert tree(run) == before, "the refused command changed the run directory"


@pytest.mark.parametrize("damage", ["missing", "cut off"])
def test_a_resume_of_a_run_without_its_config_json_names_the_file(run, damage):
    """Before: a run directory whose config.json was missing resumed from the defaults and was
    refused with "data required", which named nothing the user had done."""
    config = run / "config.json"
    if damage == "missing":
        config.unlink()
    else:
        config.write_text(config.read_text()[:100])
    before = tree(run)
    res = grt_train("train", "--out", str(run), "--resume")
    line = refused(res.returncode, res.stderr, "config.json", damage)
    assert "data" not in line.split("config.json", 1)[0], line
    assert tree(run) == before


@pytest.mark.parametrize("saved", ["config.json", "checkpoints/step00000004/config.json"])
def test_a_saved_relative_out_is_resolved_where_it_was_saved(run, tmp_path, capsys, monkeypatch, saved):
    """A run started as `--out run` from its parent saves out "run"; `--config-json run/config.json
    --resume` from another directory resumes that run (before: a fresh run in ./run there)."""
    for path in (run / "config.json", run / "checkpoints" / "step00000004" / "config.json"):
        config = json.loads(path.read_text())
        config["out"] = "run"  # as `grt train --out run` from tmp_path writes it
        path.write_text(json.dumps(config, indent=2) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, printed, err = run_main(capsys, "--config-json", str(run / saved), "--resume", "--steps", "6", "--dry-run")
    assert rc == 0, err
    assert "resuming step00000004" in err and f"into {run}" in err, err
    assert json.loads(printed)["out"] == str(run)
    assert not list(elsewhere.iterdir())


def test_a_shipped_ds_config_is_the_shipped_file_from_any_directory(run, tmp_path, capsys, monkeypatch):
    """The run saved ds_config "ds_configs/zero3.json" (the shipped file, by its shipped name). A
    resume from a directory holding a ds_configs/zero3.json of its own (ZeRO-1 inside) keeps ZeRO-3
    (before: it took that file by name and changed the stage without a word)."""
    assert json.loads((run / "config.json").read_text())["ds_config"] == "ds_configs/zero3.json"
    other = tmp_path / "other"
    (other / "ds_configs").mkdir(parents=True)
    shutil.copy(REPO / "ds_configs" / "zero1.json", other / "ds_configs" / "zero3.json")
    monkeypatch.chdir(other)
    rc, printed, err = run_main(capsys, "--out", str(run), "--resume", "--steps", "6", "--print-ds-config")
    assert rc == 0, err
    assert json.loads(printed)["zero_optimization"]["stage"] == 3


def first_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("grt train: "))


def test_the_first_line_names_the_run_directory_it_writes(shards, run, tmp_path, capsys):
    """Said before anything else (a progress line: the start's, before its checks are done)."""
    rc, _, err = run_main(capsys, "--out", str(run), "--resume", "--steps", "6", "--dry-run")
    assert rc == 0, err
    assert first_line(err) == f"grt train: start: run directory {run}: resuming step00000004", err
    fresh = tmp_path / "fresh"
    rc, _, err = run_main(capsys, *train_args(shards, fresh, 2)[1:], "--dry-run")
    assert rc == 0, err
    assert first_line(err) == f"grt train: start: run directory {fresh}: a fresh start", err


# --------------------------------------------------------------------------- one setting, one value


@pytest.mark.parametrize(
    "flag, key, value",
    [
        ("--out", "out", "{tmp}/other"),
        ("--data", "data", "{tmp}/other/manifest.json"),
        ("--steps", "train.steps", "3"),
        ("--micro-batch-size", "train.micro_batch_size", "2"),
        ("--grad-accum", "train.grad_accum", "2"),
        ("--ds-config", "ds_config", "ds_configs/zero2.json"),
    ],
)
def test_a_flag_and_a_set_of_the_same_setting_that_disagree_are_refused(
    shards, run, tmp_path, capsys, flag, key, value
):
    """Before: the --set won without a word (`--set out=...` trained fresh elsewhere). A fresh start
    and, for --out, a resume from the run directory alone; nothing written anywhere."""
    value = value.format(tmp=tmp_path)
    before = tree(run)
    fresh = tmp_path / "fresh"
    given = train_args(shards, fresh, STEPS)[1:] + (["--grad-accum", "1"] if flag == "--grad-accum" else [])
    forms = [given] + ([["--out", str(run), "--resume"]] if flag == "--out" else [])
    for args in forms:
        rc, _, err = run_main(capsys, *args, "--set", f"{key}={value}", "--print-config")
        line = refused(rc, err, flag, key, value)
        assert "disagree" in line, line
    assert tree(run) == before
    assert not fresh.exists() and not (tmp_path / "other").exists()


def test_a_flag_and_a_set_that_agree_are_one_value(shards, run, capsys):
    args = train_args(shards, run, STEPS + 2, resume=True)[1:]
    same = ["--set", f"out={run}/", "--set", f"train.steps={STEPS + 2}", "--set", f"data={shards}"]
    rc, printed, err = run_main(capsys, *args, *same, "--print-config")
    assert rc == 0, err
    assert json.loads(printed)["out"] == str(run) and json.loads(printed)["train"]["steps"] == STEPS + 2


def test_a_seed_changed_on_resume_is_refused(run, capsys):
    """Before: applied in part (the depths followed the new seed, the restored streams the old)."""
    before = tree(run)
    rc, _, err = run_main(capsys, "--out", str(run), "--resume", "--steps", "6", "--set", "train.seed=7", "--dry-run")
    refused(rc, err, "train.seed", "-> 7", "only in part")
    assert tree(run) == before


@pytest.mark.parametrize(
    "given",
    [
        ["--seeds", "0,1", "--set", "train.seed=5"],  # three copies of one seed, their spread reported
        ["--lr", "1e-3", "--set", "train.lr=3e-4"],
        ["--micro-batch-size", "4", "--set", "train.micro_batch_size=2"],
        ["--data", "@other", "--set", "data=@data"],
        ["--set", "out=@other"],  # every run into one folder
    ],
)
def test_a_compare_flag_and_a_set_that_disagree_are_refused(shards, tmp_path, capsys, given):
    """`grt compare` by `grt train`'s rule: before, its --set won over the flag without a word.
    One line, exit 2, nothing written."""
    from pretrain.tools.compare import cli as compare

    out = tmp_path / "cmp"
    base = ["--data", str(shards), "--out", str(out), "--configs", "micro-dense", "--tokens", "5000", "--dry-run"]
    given = [a.replace("@data", str(shards)).replace("@other", str(tmp_path / "other")) for a in given]
    rc = compare.main([*base, *given])
    lines = error_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("grt compare: error: "), lines
    assert ("disagree: one setting has one value" in lines[0]) == ("out=" not in given[-1]), lines
    assert not out.exists() and not (tmp_path / "other").exists()


def test_a_compare_set_of_a_flag_left_at_its_default_is_its_value(shards, tmp_path):
    """...and one that agrees with the flag given is one value (lr 3e-4 with its minimum 3e-5:
    before, the default --lr's minimum 3e-4 above it refused the run)."""
    from pretrain.tools.compare import cli as compare

    base = ["--data", str(shards), "--out", str(tmp_path / "cmp"), "--configs", "micro-dense", "--tokens", "5000"]
    for agreeing in (["--set", "train.lr=3e-4"], ["--lr", "3e-4", "--set", "train.lr=0.0003"]):
        args = compare.parse_args([*base, *agreeing])
        compare.check_flags_and_sets(args)
        [run] = compare.build_runs(args, 5000)
        assert (run["cfg"].train.lr, run["cfg"].train.min_lr) == (3e-4, pytest.approx(3e-5))
