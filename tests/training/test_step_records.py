"""One record per logged step for every sink (issue 41): a short `grt train` run (micro-grt,
ZeRO-1, one rank, W&B offline) whose loss spike at step 24 rolls back to the checkpoint of step
20 after step 22 was logged. Its metrics.jsonl, TensorBoard and W&B then hold the same values
of every logged step, the re-trained ones included; every curve is also against tokens; no
zero3/* series under ZeRO-1; the start's phases are in the log, in order."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_jobs import train_args
from trained_models import manifest  # noqa: F401 (fixture)
from wandb_files import REPO, offline_env, wandb_history

from pretrain.training.report.metrics import BY_TOKENS

STEPS, LOGGED = 26, list(range(2, 27, 2))
FIELDS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/depth",
    "train/tokens_seen",
    "perf/tokens_per_s",
    "perf/mfu",
    "memory/peak_bytes",
    *(f"time/{part}_s" for part in ("data", "forward", "backward", "optimizer", "waiting", "other", "step")),
    "ranks/own_time_max_s",
}
PHASES = ["checks", "process group", "model", "engine", "data", r"logs \(TensorBoard, W&B\)"]


def tensorboard(tb: Path) -> dict[str, dict[int, float]]:
    """{tag: {x: value}} of every scalar series (x: the step, or tokens for by_tokens/)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    series = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        assert len({p.step for p in points}) == len(points), (tag, [p.step for p in points])  # each x once
        series[tag] = {p.step: p.value for p in points}
    return series


@pytest.mark.slow
def test_every_sink_has_the_same_record_of_each_logged_step_after_a_rollback(manifest, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    sets = ("train.wandb=true", "train.log_every=2", "train.save_every=20", "train.loss_spike_action=rollback")
    args = train_args(manifest, out, STEPS, *sets, ds_config="ds_configs/zero1.json", micro_batch_size=2)
    env = {**offline_env(tmp_path), "GRT_INJECT_NAN_STEPS": "24", "GRT_INJECT_LOSS_FACTOR": "20"}
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the phases before the log is set up are on stderr: one stream, in order
        text=True,
        timeout=300,
    )
    log = proc.stdout
    assert proc.returncode == 0, log[-4000:]
    assert "loss spike at step 24: rolled back to checkpoint step00000020 (step 20)" in log, log[-4000:]
    # the start's phases, in order: each said as it begins (the checks only when done: a refusal in
    # them is one line), then with its duration
    said = [m.group(0) for m in re.finditer(r"start: .*", log)]
    want = [rf"start: run directory {re.escape(str(out))}: a fresh start"] + [
        line
        for name in PHASES
        for line in ([] if name == "checks" else [rf"start: {name} \.\.\."]) + [rf"start: {name} done in \d+\.\d\d s"]
    ]
    assert len(said) == len(want) and all(re.fullmatch(w, s) for w, s in zip(want, said)), said
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == list(range(1, STEPS + 1))
    tb = tensorboard(out / "tb")
    run_id = json.loads((out / "checkpoints" / "step00000020" / "wandb.json").read_text())["id"]
    history = wandb_history(out, run_id)
    step_tags = {tag for tag in tb if not tag.startswith(BY_TOKENS)}
    assert sorted(history) == LOGGED and {s for tag in step_tags for s in tb[tag]} == set(LOGGED)
    for step in LOGGED:
        record = records[step]
        assert FIELDS <= set(record), FIELDS - set(record)
        assert not [k for k in record if k.startswith("zero3/")]  # ZeRO-1: no series of ZeRO-3's
        assert record["train/loss"] == record["loss"]
        scalars = {k: v for k, v in record.items() if "/" in k}
        assert {tag for tag in step_tags if step in tb[tag]} == set(scalars) == set(history[step]), step
        tokens = record["train/tokens_seen"]
        for tag, value in scalars.items():
            assert tb[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (step, tag)  # TensorBoard: float32
            assert tb[f"{BY_TOKENS}{tag}"][tokens] == tb[tag][step], (step, tag)  # every curve against tokens
            assert history[step][tag] == pytest.approx(value, rel=1e-12), (step, tag)  # W&B: the re-trained step's
    assert len(list((out / "wandb").glob(f"offline-run-*-{run_id}*"))) == 2  # the start, the rewind
