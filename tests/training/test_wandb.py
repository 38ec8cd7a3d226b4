"""Weights & Biases logging (train.wandb=true): the MetricsWriter sink, the run id a checkpoint
saves and a resume continues, the one-line refusal without the package, and `grt train` end to
end in W&B's offline mode (nothing is sent anywhere: WANDB_MODE=offline in every process that
imports wandb; the offline files are read back with `wandb_history` below)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from train_jobs import train_args
from trained_models import manifest  # noqa: F401 (fixture)
from wandb_files import REPO, offline_env, wandb_history

from grt_common.errors import ConfigError
from pretrain.runs.run_config import RunConfig
from pretrain.training.report.metrics import MetricsWriter
from pretrain.training.report.wandb_sink import WANDB_FILE, WandbRun, check_available, saved_id


# -- units: no trainer -----------------------------------------------------------------------
def test_the_sink_gets_every_step_scalar_on_rank_0_only(tmp_path):
    got = []
    writer = MetricsWriter(tmp_path / "r0", 0)
    writer.add_sink(lambda step, values: got.append((step, dict(values))))
    writer.scalars(2, {"train/loss": 5.0, "perf/mfu": 0.1})
    writer.scalars_by_tokens(256, {"train/loss": 5.0})  # a second x-axis: TensorBoard only
    writer.scalars(4, {"val/loss": 4.5})
    writer.close()
    assert got == [(2, {"train/loss": 5.0, "perf/mfu": 0.1}), (4, {"val/loss": 4.5})]
    assert list((tmp_path / "r0" / "tb").glob("events.out.tfevents.*"))  # TensorBoard as before
    other = []
    writer = MetricsWriter(tmp_path / "r1", 1)
    writer.add_sink(lambda step, values: other.append((step, dict(values))))
    writer.scalars(2, {"train/loss": 5.0})
    writer.close()
    assert other == []


class FakeWandb(types.ModuleType):
    """A `wandb` module that records wandb.init's arguments."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.refuse = ""  # a rewind fails with this message
        self.logged_to = 0  # the run's next step on the server: what a resumed run's `step` says

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        if self.refuse and "resume_from" in kwargs:
            raise RuntimeError(self.refuse)
        run_id = kwargs.get("id") or kwargs["resume_from"].split("?")[0]
        step = self.logged_to if kwargs.get("resume") else 0  # the next step W&B expects, after a resume
        return types.SimpleNamespace(id=run_id, step=step, log=lambda values, step: None, finish=lambda: None)


def wandb_cfg(**train: Any) -> RunConfig:
    cfg = RunConfig()
    cfg.train.wandb = True
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_open_starts_a_new_run_or_continues_the_checkpoints(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "my-run"
    out.mkdir()
    cfg = wandb_cfg(wandb_project="proj")
    first = WandbRun.open(out, cfg, None)
    assert first is not None
    init = fake.inits[-1]
    assert init == {
        "project": "proj",
        "entity": None,  # "": W&B's default entity
        "dir": str(out),
        "id": first.id,
        "resume": "allow",
        "config": cfg.to_dict(),
        "name": "my-run",
    }
    assert len(first.id) == 8 and first.id.isalnum() and first.id == first.id.lower()
    # a checkpoint holds the id; a resume from it continues that run
    tag = out / "checkpoints" / "step00000010"
    tag.mkdir(parents=True)
    for name, text in first.files().items():
        (tag / name).write_text(text)
    assert json.loads((tag / WANDB_FILE).read_text()) == {"id": first.id, "project": "proj", "entity": ""}
    assert saved_id(tag) == first.id
    again = WandbRun.open(out, wandb_cfg(wandb_entity="team"), tag)
    assert again is not None and again.id == first.id and fake.inits[-1]["entity"] == "team"
    # a checkpoint of a run without W&B: a new run
    plain = out / "checkpoints" / "step00000020"
    plain.mkdir()
    fresh = WandbRun.open(out, cfg, plain)
    assert fresh is not None and fresh.id != first.id
    # off: nothing opened
    assert WandbRun.open(out, RunConfig(), tag) is None and len(fake.inits) == 3


def test_a_rollback_rewinds_the_run_or_resumes_it_with_one_warning(tmp_path, monkeypatch, caplog):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = WandbRun.open(tmp_path, wandb_cfg(), None)
    assert run is not None
    writer = MetricsWriter(tmp_path, 0)
    writer.add_sink(run.log, run.rewind)
    writer.rewind(20)  # a rollback to the checkpoint of step 20
    rewound = {k: v for k, v in fake.inits[0].items() if k not in ("id", "resume")}
    assert fake.inits[-1] == {**rewound, "resume_from": f"{run.id}?_step=20"} and run.id == fake.inits[0]["id"]
    fake.refuse = "rewind is not enabled for this entity"
    with caplog.at_level(logging.WARNING, logger="grt.train"):
        writer.rewind(20)
    writer.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "could not rewind run" in warning and "rewind is not enabled" in warning and "\n" not in warning
    assert fake.inits[-1] == {**rewound, "id": run.id, "resume": "allow"} and not run.failed


def test_a_resume_behind_what_w_and_b_logged_rewinds_the_run(tmp_path, monkeypatch):
    """Killed after W&B logged step 25 (its next step 26), resumed from checkpoint step 20: the run is
    rewound to step 20, so steps 21-25 trained again are kept; resumed at its last step: no rewind."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tag = tmp_path / "checkpoints" / "step00000020"
    tag.mkdir(parents=True)
    (tag / WANDB_FILE).write_text(json.dumps({"id": "abc123", "project": "grt", "entity": ""}))
    fake.logged_to = 26
    run = WandbRun.open(tmp_path, wandb_cfg(), tag)
    assert run is not None and [i.get("resume_from") for i in fake.inits] == [None, "abc123?_step=20"]
    fake.inits.clear()
    fake.logged_to = 21
    WandbRun.open(tmp_path, wandb_cfg(), tag)
    assert [i.get("resume") for i in fake.inits] == ["allow"]


def test_a_cut_off_id_file_starts_a_new_run_with_a_warning(tmp_path, caplog):
    (tmp_path / WANDB_FILE).write_text('{"id": "abc')
    with caplog.at_level(logging.WARNING, logger="grt.train"):
        assert saved_id(tmp_path) is None
    assert "cannot be read" in caplog.text and "new run" in caplog.text


def test_without_the_package_train_wandb_is_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as err:
        WandbRun.open(tmp_path, wandb_cfg(), None)
    assert "\n" not in str(err.value)
    assert "train.wandb=true needs the wandb package" in str(err.value) and "grt-pretrain[wandb]" in str(err.value)
    with pytest.raises(ConfigError):
        check_available(wandb_cfg())
    check_available(RunConfig())  # off: wandb is never imported
    assert WandbRun.open(tmp_path, RunConfig(), None) is None


def test_a_failing_log_is_one_warning_and_training_goes_on(caplog):
    calls = []

    def log(values, step):
        calls.append(step)
        raise BrokenPipeError("the W&B service is gone")

    def finish():
        raise RuntimeError("cannot finish")

    run = WandbRun(types.SimpleNamespace(id="abcd1234", log=log, finish=finish), "grt", "")
    with caplog.at_level(logging.WARNING, logger="grt.train"):
        run.log(2, {"train/loss": 1.0})
        run.log(4, {"train/loss": 0.9})
        run.finish()
    assert calls == [2]  # off after the first failure
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "step 2" in warnings[0] and "BrokenPipeError" in warnings[0]


OFFLINE_SCRIPT = """
import json, sys
from pathlib import Path
from pretrain.runs.run_config import RunConfig
from pretrain.training.report.wandb_sink import WandbRun
out, tag, first = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
cfg = RunConfig()
cfg.train.wandb = True
run = WandbRun.open(out, cfg, Path(tag) if tag else None)
for step in (first, first + 2):
    run.log(step, {"train/loss": 10.0 - step, "perf/mfu": 0.25})
print(json.dumps(run.files()))
run.finish()
"""


def test_real_wandb_offline_logs_steps_and_a_resume_continues_the_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()

    def segment(tag: str, first: int) -> dict[str, str]:
        proc = subprocess.run(
            [sys.executable, "-c", OFFLINE_SCRIPT, str(out), tag, str(first)],
            env=offline_env(tmp_path),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    files = segment("", 2)
    tag = tmp_path / "step00000004"
    tag.mkdir()
    (tag / WANDB_FILE).write_text(files[WANDB_FILE])
    assert segment(str(tag), 6) == files  # the same run id, project and entity
    run_id = json.loads(files[WANDB_FILE])["id"]
    history = wandb_history(out, run_id)
    assert history == {s: {"train/loss": 10.0 - s, "perf/mfu": 0.25} for s in (2, 4, 6, 8)}


# -- end to end: `grt train` with train.wandb=true, then --resume -----------------------------
def grt_train(out: Path, steps: int, data: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = ("train.wandb=true", "train.log_every=2", "train.save_every=4")
    args = train_args(data, out, steps, *sets, ds_config="ds_configs/zero1.json", micro_batch_size=2)
    return subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args, *extra],
        cwd=REPO,
        env=offline_env(tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )


def saved_run(out: Path, tag: str) -> dict[str, str]:
    return json.loads((out / "checkpoints" / tag / WANDB_FILE).read_text())


@pytest.mark.slow
def test_grt_train_logs_to_wandb_and_a_resume_continues_the_same_run(manifest, tmp_path):
    out = tmp_path / "run"
    first = grt_train(out, 4, manifest, tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    saved = saved_run(out, "step00000004")
    assert saved["project"] == "grt" and saved["entity"] == "" and saved["id"]
    resumed = grt_train(out, 8, manifest, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert saved_run(out, "step00000008") == saved  # the resume continued the run, it did not start one
    history = wandb_history(out, saved["id"])
    assert {2, 4, 6, 8} <= set(history), sorted(history)  # both segments' logging steps, in one run
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step in (2, 4, 6, 8):
        assert history[step]["train/loss"] == pytest.approx(records[step]["loss"], rel=1e-5), step
        assert {"train/lr", "perf/tokens_per_s"} <= set(history[step]), sorted(history[step])
    assert len(list((out / "wandb").glob(f"offline-run-*-{saved['id']}"))) == 2  # one per segment


def test_dry_run_refuses_train_wandb_without_the_package(manifest, tmp_path):
    """Before any process group or engine: one line naming the extra to install."""
    blocker = tmp_path / "no-wandb" / "wandb"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no wandb here')\n")
    env = {**offline_env(tmp_path), "PYTHONPATH": f"{blocker.parent}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", "train", "--preset", "micro-grt", "--data", str(manifest)]
        + ["--out", str(tmp_path / "run"), "--dry-run", "--set", "train.wandb=true"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "wandb" in line]
    assert len(lines) == 1 and "grt-pretrain[wandb]" in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
