"""Bad runs of `grt train` (issue 27, docs/reliability.md "Bad runs"): a run directory in use
by another run, a file system without locks, a resume over interrupted checkpoints only, a
newest checkpoint that cannot be loaded (cut-off model state or config.json, on one rank of
two), none that can, and a validation split smaller than a micro-batch.

Every case is a real `grt train` process (micro-grt, 64-token samples, a few steps, ZeRO-3 on
CPU). Each refused command must exit 2 with one line on stderr and leave the run directory
byte-identical (every file hashed before and after). Multi-process tests are marked slow.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from commands import error_lines as command_lines
from train_jobs import REPO, Job, cli, losses, run_job, train_args, wait_for

STEPS = 6
SAVE = ("train.save_every=2", "train.keep_checkpoints=3")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_name, None)


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under `root`: relative path -> sha256 of its bytes ('dir' for a folder)."""
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def train(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli(*args), cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def error_lines(stderr: str) -> list[str]:
    """The command's lines, also without torch's and DeepSpeed's import-time warnings (and their
    indented continuation lines)."""
    return [line for line in command_lines(stderr, "[WARNING]", "Warning") if not line.startswith("  ")]


def assert_refused(res: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, exactly one error line holding every word, no traceback; returns the line."""
    lines = error_lines(res.stderr)
    assert res.returncode == 2, f"exit {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("grt train: error: "), lines
    assert "Traceback" not in res.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def refused_unchanged(run: Path, args: list[str], *words: str, env: dict | None = None) -> str:
    """Run a command that must be refused; the run directory must not change by a byte."""
    before = tree(run)
    line = assert_refused(train(*args, env=env), *words)
    assert tree(run) == before, "the refused command changed the run directory"
    return line


@pytest.fixture(scope="module")
def base_run(shards, tmp_path_factory) -> Path:
    """A finished one-process run of STEPS steps with checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("bad_runs") / "run"
    res = train(*train_args(shards, out, STEPS, *SAVE))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == [f"step{s:08d}" for s in (2, 4, 6)]
    return out


def copy_run(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def cut(path: Path, keep: float = 0.5) -> None:
    """Truncate a file to a fraction of its size, as a full disk or a killed copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


MODEL_STATE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


# --------------------------------------------------------------------------- one run per directory


@pytest.mark.slow
def test_a_second_train_on_a_run_directory_in_use_is_refused_naming_the_holder(shards, base_run, tmp_path):
    """A live `grt train` holds its --out: a second one on the same --out (a resume, or a
    fresh start after the first's checkpoints) exits 2 naming the holder's host and pid and
    changes nothing; once the holder is killed, the kernel has released the lock."""
    run = copy_run(base_run, tmp_path)
    holder = Job(
        train_args(shards, run, 100_000, "train.save_every=0", "train.save_final=false", resume=True),
        tmp_path / "logs",
        world=1,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    with holder:
        wait_for(lambda: len(losses(run)) > STEPS, 180, holder, "the holder's first step")
        os.kill(holder.pids[0], signal.SIGSTOP)  # keep the directory still while the second run tries
        try:
            line = refused_unchanged(
                run, train_args(shards, run, STEPS + 2, resume=True), "is in use by another grt train"
            )
            assert f"pid {holder.pids[0]}" in line and "host " in line and "train.lock" in line, line
            fresh = train_args(shards, run, STEPS)  # without --resume: the same refusal, before the checkpoint one
            refused_unchanged(run, fresh, f"pid {holder.pids[0]}")
        finally:
            os.kill(holder.pids[0], signal.SIGCONT)
        holder.kill()
    from pretrain.training.start.run_lock import refuse_if_in_use

    refuse_if_in_use(run)  # a killed holder leaves no lock behind


def test_a_run_lock_refused_leaves_the_lock_file_as_it_was(tmp_path, monkeypatch):
    """In-process: a second holder is refused naming the first; a holder that never commits
    restores the lock file (or removes the one, and the --out, it created)."""
    from grt_common.errors import ConfigError
    from pretrain.training.fault_injection import Faults
    from pretrain.training.start.run_lock import RunDirInUse, RunLock, lock_path, refuse_if_in_use

    out = tmp_path / "new"
    first = RunLock.acquire(out)
    holder = json.loads(lock_path(out).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()}"):
        refuse_if_in_use(out)
    other = subprocess.run(  # another process: flock is per open file, so a second process is the real test
        [sys.executable, "-c", f"from pretrain.training.start.run_lock import RunLock; RunLock.acquire({str(out)!r})"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.returncode != 0 and "is in use by another grt train" in other.stderr, other.stderr
    first.release()
    assert not out.exists()  # created by a holder that did not commit: removed with its lock file
    out.mkdir()
    lock_path(out).write_text("previous holder\n")
    second = RunLock.acquire(out)
    assert "previous holder" not in lock_path(out).read_text()
    second.release()
    assert lock_path(out).read_text() == "previous holder\n"
    third = RunLock.acquire(out)
    third.commit()
    third.release()
    assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    Faults.from_environment({"GRT_INJECT_LOCK_FAULT": "enolck"}).install_at_start(monkeypatch.setattr)
    with pytest.raises(ConfigError, match="refuses file locks"):
        refuse_if_in_use(out)


def test_a_file_system_without_locks_is_refused_unless_allowed(shards, base_run, tmp_path):
    """flock failing with ENOLCK (injected, as on an NFS mount without a lock manager): a
    resume of an existing run and a fresh start are refused in one line (the fresh --out is
    not even created); GRT_ALLOW_UNLOCKED_OUT=1 trains anyway, with a warning."""
    fault = {"GRT_INJECT_LOCK_FAULT": "enolck"}
    run = copy_run(base_run, tmp_path)
    refused_unchanged(
        run,
        train_args(shards, run, STEPS + 2, resume=True),
        "refuses file locks",
        "GRT_ALLOW_UNLOCKED_OUT=1",
        env=fault,
    )
    fresh = tmp_path / "fresh"
    refused_unchanged(fresh, train_args(shards, fresh, 2), "refuses file locks", env=fault)
    assert not fresh.exists()
    res = train(*train_args(shards, fresh, 2), env={**fault, "GRT_ALLOW_UNLOCKED_OUT": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "training without the run-directory lock" in res.stderr
    assert (fresh / "summary.json").is_file() and not (fresh / "train.lock").exists()


# --------------------------------------------------------------------------- resume over interrupted checkpoints


def test_resume_over_only_incomplete_checkpoints_is_refused(shards, base_run, tmp_path):
    """Every checkpoint interrupted (no COMPLETE): --resume (and a start without it) exits 2
    naming them, instead of training from step 0 over them; a run directory without any
    checkpoint resumes as a fresh start."""
    run = copy_run(base_run, tmp_path)
    for marker in (run / "checkpoints").glob("step*/COMPLETE"):
        marker.unlink()
    (run / "checkpoints" / "latest").unlink()
    tags = "step00000002, step00000004, step00000006"
    refused_unchanged(run, train_args(shards, run, STEPS + 2, resume=True), "no complete checkpoint", tags)
    refused_unchanged(run, train_args(shards, run, STEPS + 2), "3 interrupted saves", tags)
    shutil.rmtree(run / "checkpoints")
    res = train(*train_args(shards, run, 2, resume=True))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" not in res.stdout and json.loads((run / "summary.json").read_text())["steps"] == 2


# --------------------------------------------------------------------------- resume falls back


@pytest.mark.parametrize("damage", ["model_state", "config_json"])
def test_resume_falls_back_to_the_previous_complete_checkpoint(shards, base_run, tmp_path, damage):
    """The newest complete checkpoint (step 6) cannot be loaded: its model state cut in half,
    or its config.json cut off mid-JSON. The resume says so in one line, loads step 4 and
    reproduces steps 5 and 6 of the uninterrupted run exactly (fp32, one process)."""
    run = copy_run(base_run, tmp_path)
    step6 = run / "checkpoints" / "step00000006"
    cut(step6 / (MODEL_STATE if damage == "model_state" else "config.json"))
    before = tree(run)
    dry = train(*train_args(shards, run, STEPS + 1, *SAVE, resume=True), "--dry-run")
    assert dry.returncode == 0 and "resuming step00000004" in dry.stderr, dry.stdout + dry.stderr[-2000:]
    assert tree(run) == before
    res = train(*train_args(shards, run, STEPS + 1, *SAVE, resume=True))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    said = [line for line in error_lines(res.stderr) if "step00000006 cannot be" in line]
    what = MODEL_STATE if damage == "model_state" else "config.json is cut off or corrupt"
    assert (
        len(said) == 1 and what in said[0] and "resuming from the older complete checkpoint step00000004" in said[0]
    ), said
    assert f"resumed from {run / 'checkpoints' / 'step00000004'} at step 4" in res.stdout
    want = losses(base_run)
    got = losses(run)
    assert (got[5], got[6]) == (want[5], want[6]), (got, want)
    assert 7 in got
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == STEPS + 1


@pytest.mark.parametrize("damage", ["model_state", "config_json"])
def test_resume_refused_when_no_checkpoint_loads_changes_nothing(shards, base_run, tmp_path, damage):
    """No complete checkpoint can be loaded (each one's model state, or each config.json,
    cut off): the resume exits 2 naming each, and nothing in the run directory changed: not
    its config.json (a resume with another step count rewrote it before the load), not its
    log, not the lock file."""
    run = copy_run(base_run, tmp_path)
    for step in (2, 4, 6):
        cut(run / "checkpoints" / f"step{step:08d}" / (MODEL_STATE if damage == "model_state" else "config.json"))
    verb = "loaded" if damage == "model_state" else "read"
    line = refused_unchanged(
        run, train_args(shards, run, STEPS + 4, resume=True), f"no complete checkpoint in {run / 'checkpoints'}"
    )
    assert f"can be {verb}" in line and all(f"step{s:08d}" in line for s in (2, 4, 6)), line


def test_the_launchers_resume_check_passes_over_a_cut_off_config_json(base_run, tmp_path, capsys):
    """`grt launch` checks a resume with the start's plan (plan_start, in-process here): a cut-off
    config.json of the newest checkpoint is passed over in one line, as the resume does;
    all cut off: one line (ConfigError)."""
    from grt_common.errors import ConfigError
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.start.plan import plan_start

    run = copy_run(base_run, tmp_path)
    root = run / "checkpoints"
    cfg = RunConfig.load(run / "config.json")
    cfg.out, cfg.train.steps = str(run), STEPS + 2
    cut(root / "step00000006" / "config.json")
    plan = plan_start(cfg, resume=True, world=1)
    assert plan.resume is not None and plan.resume.tag == "step00000004"
    assert plan.cfg.train.schedule_steps == STEPS
    said = plan.resume_lines(plan.resume.tag, [], plan.resume.notes)  # what grt launch says
    assert len(said) == 2 and "step00000006 cannot be read" in said[0] and "step00000004" in said[0], said
    for tag in ("step00000004", "step00000002"):
        cut(root / tag / "config.json")
    capsys.readouterr()
    with pytest.raises(ConfigError, match="no complete checkpoint in .* can be read"):
        plan_start(cfg, resume=True, world=1)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_two_ranks_agree_to_fall_back_when_one_rank_cannot_load(shards, tmp_path):
    """2 ranks: the newest checkpoint's ZeRO partition of rank 1 is cut off (read by rank 1
    only). Both ranks pass over it together, load step 2, and train on to the end."""
    out = tmp_path / "run"
    rcs, job = run_job(train_args(shards, out, 4, *SAVE), tmp_path / "logs")
    assert rcs == [0, 0], job.output()
    before = losses(out)
    cut(out / "checkpoints" / "step00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    rcs, job = run_job(train_args(shards, out, 5, *SAVE, resume=True), tmp_path / "logs")
    assert rcs == [0, 0], job.output()
    log = job.output(0, tail=20000)
    assert "checkpoint step00000004 cannot be loaded (rank 1: zero_pp_rank_1_mp_rank_00_optim_states.pt" in log, log
    assert "resumed from" in log and "step00000002 at step 2" in log, log
    after = losses(out)
    assert [after[3], after[4]] == [before[3], before[4]]  # rank 0 loaded step 2 too: the same losses


# --------------------------------------------------------------------------- validation split


def test_a_validation_split_smaller_than_a_micro_batch_is_refused(shards, tmp_path):
    """A val split of 97 sequences and micro-batches of 128: every rank would get no batch and
    summary.json would report a validation loss of 0.0. Refused at the start instead, in one
    line naming both numbers, before anything is written."""
    raw = json.loads(shards.read_text())
    base = shards.parent
    for entries in raw["splits"].values():
        for e in entries:
            e["name"] = str(base / e["name"])
    raw["splits"]["val"] = raw["splits"]["val"][:1]
    raw["tokenizer"]["path"] = str(base / raw["tokenizer"]["path"])
    raw["totals"] = {}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(raw))
    have = raw["splits"]["val"][0]["sequences"]
    out = tmp_path / "run"
    args = train_args(manifest, out, 2, "train.eval_every=1", "train.eval_batches=2", micro_batch_size=128)
    refused_unchanged(out, args, f"has {have} sequences", "train.micro_batch_size 128", "train.eval_every=0")
    assert not out.exists()


# --------------------------------------------------------------------------- readers of a cut-off config.json


def test_export_of_a_checkpoint_with_a_cut_off_config_json_is_one_line(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    cut(run / "checkpoints" / "step00000006" / "config.json")
    res = subprocess.run(
        cli(
            "export", "--checkpoint", str(run / "checkpoints" / "step00000006"), "--out", str(tmp_path / "x"), "--no-hf"
        ),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(error_lines(res.stderr)) == 1, res.stderr


@pytest.mark.parametrize("ds_config", ["ds_configs/zero2.json", "ds_configs/zero1.json"])
def test_resume_under_another_zero_checkpoint_layout_is_refused_before_start(shards, base_run, tmp_path, ds_config):
    """The base run's checkpoints are ZeRO-3's: a resume under ZeRO-1/2 (another file layout)
    is one line naming both stages before any process group, not DeepSpeed's traceback after."""
    run = copy_run(base_run, tmp_path)
    args = train_args(shards, run, STEPS + 2, *SAVE, resume=True, ds_config=ds_config)
    refused_unchanged(run, [*args, "--dry-run"], "written under ZeRO stage 3", "ZeRO-1/2")
