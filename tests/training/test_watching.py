"""Watching a run (issue 30; docs/training.md, "Watching a run"): the profiler window of a real
`grt train` on two ranks and its labelled ranges, the logged steps' time breakdown, a slow rank
named (an injected delay on one of two ranks), a data-starved rank said in one line."""

import glob
import json
import os
import socket
from pathlib import Path

import pytest
from commands import train_command
from multiproc import REPO, run_ranks
from trained_models import manifest  # noqa: F401 (fixture)

from pretrain.runs.train_checks import train_checks
from pretrain.runs.train_config import TrainConfig

LABELS = {
    "data",
    "forward",
    "backward",
    "optimizer_step",
    "prelude",
    "loop_step_1",
    "coda",
    "head_and_loss",
}


def _train(out, data, *settings, env=None, world=2, steps=6, extra=()):
    sets = ("train.eval_every=0", "train.save_final=false", "train.log_every=1", *settings)
    command = train_command("micro-grt", data, out, steps, 2, "ds_configs/zero2.json", sets, *extra)
    args = ["-m", "pretrain.cli", *command]
    procs = run_ranks(args, world=world, env={"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", **(env or {})})
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{proc.stdout[-3000:]}"
    return [proc.stdout for proc in procs]


def _scalar_tags(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return set(events.Tags()["scalars"])


@pytest.mark.slow
def test_a_profiled_run_writes_a_trace_per_rank_with_the_labelled_ranges(tmp_path, manifest):  # noqa: F811
    out = tmp_path / "run"
    logs = _train(
        out,
        manifest,
        "train.profile=1,1,2",
        "train.profile_ranks=all",
        "train.activation_checkpointing=loop_step",
        "train.log_every=2",
    )
    for rank in (0, 1):
        traces = glob.glob(str(out / "profile" / f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, traces
        events = json.loads(open(traces[0]).read())["traceEvents"]
        names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
        assert LABELS <= names, LABELS - names
        assert sum(name.startswith("ProfilerStep#") for name in names) == 2  # the active steps
        assert any(e.get("name") == "[memory]" for e in events)  # profile_memory
    line = next(line for line in logs[0].splitlines() if "step 2/6" in line)
    assert "| time data/fwd/bwd/opt/wait/other " in line, line
    tags = _scalar_tags(out / "tb")
    want = {f"time/{s}_s" for s in ("data", "forward", "backward", "optimizer", "waiting", "other", "step")}
    want |= {"ranks/own_time_min_s", "ranks/own_time_median_s", "ranks/own_time_max_s"}
    assert want <= tags, want - tags


@pytest.mark.slow
def test_a_rank_slowed_by_an_injected_delay_is_named_with_its_host(tmp_path, manifest):  # noqa: F811
    logs = _train(
        tmp_path / "run",
        manifest,
        "train.slow_rank_windows=3",
        env={"GRT_INJECT_DELAY": "forward@1=0.3"},
    )
    warnings = [line for line in logs[0].splitlines() if "slow rank:" in line]
    assert len(warnings) == 1, logs[0][-3000:]  # once, not at every step it stays slow
    assert f"slow rank: rank 1 on {socket.gethostname()}" in warnings[0], warnings
    assert "on 3 logging steps in a row" in warnings[0]
    assert "slow rank: rank 0" not in logs[0]


@pytest.mark.slow
def test_a_data_starved_rank_says_so_once(tmp_path, manifest):  # noqa: F811
    (log,) = _train(tmp_path / "run", manifest, world=1, steps=3, env={"GRT_INJECT_DELAY": "data@0=0.3"})
    said = [line for line in log.splitlines() if "data-starved" in line]
    assert len(said) == 1 and "rank 0 waited for data" in said[0], log[-3000:]


def test_bad_watch_settings_are_refused_in_one_line():
    for key, value, why in (
        ("profile", "5,2", "train.profile='5,2': expected 'wait,warmup,active'"),
        ("profile", "1,1,0", "train.profile='1,1,0'"),
        ("profile_ranks", "0,x", "train.profile_ranks='0,x'"),
        ("slow_rank_factor", 1.0, "train.slow_rank_factor=1.0: must be > 1"),
        ("data_starved_share", 0.0, "train.data_starved_share=0.0"),
        ("loss_spike_threshold", -1.0, "train.loss_spike_threshold=-1.0: must be >= 0"),
    ):
        failed = [message for ok, message in train_checks(TrainConfig(**{key: value})) if not ok]
        assert len(failed) == 1 and failed[0].startswith(why) and "\n" not in failed[0], (key, failed)


@pytest.mark.slow
def test_an_injected_loss_spike_is_flagged_once_in_the_log_and_the_metrics(tmp_path, manifest):  # noqa: F811
    """The existing fault switch, a finite factor instead of NaN: step 26's loss times 20."""
    out = tmp_path / "run"
    (log,) = _train(
        out,
        manifest,
        "train.log_every=5",
        world=1,
        steps=30,
        env={"GRT_INJECT_NAN_STEPS": "26", "GRT_INJECT_LOSS_FACTOR": "20"},
    )
    said = [line for line in log.splitlines() if "loss spike" in line]
    assert len(said) == 1 and "loss spike at step 26:" in said[0], log[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("loss_spike")] == [26]
    assert "train/loss_spike" in _scalar_tags(out / "tb")


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_a_skipped_spike_is_dropped_on_every_rank_listed_and_a_resume_judges_the_same(tmp_path, manifest):  # noqa: F811
    """train.loss_spike_action=skip, two ranks, two micro-batches per step (the first one's check is
    read after its backward: dropped on the device): step 26's spike is replaced by the next
    micro-batch, listed with its samples; a run resumed at step 20 restores the loss history from
    the checkpoint and drops the same micro-batch, so its losses are the straight run's."""
    settings = ("train.loss_spike_action=skip", "train.log_every=5", "train.save_every=20", "train.schedule_steps=30")
    env = {"GRT_INJECT_NAN_STEPS": "26", "GRT_INJECT_LOSS_FACTOR": "20"}
    straight, split = tmp_path / "straight", tmp_path / "split"
    accum = ("--grad-accum", "2")
    logs = _train(straight, manifest, *settings, env=env, steps=30, extra=accum)
    said = [line for line in logs[0].splitlines() if "loss spike" in line]
    assert len(said) == 1 and "loss spike at step 26: a micro-batch's loss" in said[0], logs[0][-3000:]
    assert "skipped on every rank and replaced by the next" in said[0]
    (record,) = [json.loads(line) for line in (straight / "spikes.jsonl").read_text().splitlines()]
    width = 2 * 2  # ranks x micro-batch
    (skipped,) = record["skipped"]
    assert record["step"] == 26 and skipped["positions"][1] - skipped["positions"][0] == width, record
    assert skipped["loss"] > 10 * skipped["limit"] / 2  # the injected 20x loss
    losses = _losses(straight)
    assert losses[26] < 1.2 * losses[25]  # the step trained on the replacement, not the spike
    _train(split, manifest, *settings, env=env, steps=20, extra=accum)
    _train(split, manifest, *settings, env=env, steps=30, extra=(*accum, "--resume"))
    resumed = _losses(split)
    assert [resumed[s] for s in range(21, 31)] == [losses[s] for s in range(21, 31)]
    assert (split / "spikes.jsonl").read_text() == (straight / "spikes.jsonl").read_text()


@pytest.mark.slow
def test_a_rollback_reloads_the_checkpoint_skips_the_window_and_a_resume_does_not_replay_it(
    tmp_path,
    manifest,  # noqa: F811
):
    """train.loss_spike_action=rollback, two ranks, two micro-batches per step: the spike at step 26
    rolls back to the checkpoint of step 20 in the same process and goes on with the data after
    the spike; a run stopped after that rollback (before another checkpoint) and resumed from step
    20 follows <out>/data_skips.json, so it trains on the same data: the straight run's losses."""
    settings = (
        "train.loss_spike_action=rollback",
        "train.log_every=5",
        "train.save_every=20",
        "train.schedule_steps=30",
    )
    spike = {"GRT_INJECT_NAN_STEPS": "26", "GRT_INJECT_LOSS_FACTOR": "20"}
    straight, split = tmp_path / "straight", tmp_path / "split"
    accum = ("--grad-accum", "2")
    logs = _train(straight, manifest, *settings, env=spike, steps=30, extra=accum)
    said = [line for line in logs[0].splitlines() if "rolled back" in line]
    assert len(said) == 1 and "loss spike at step 26: rolled back to checkpoint step00000020 (step 20)" in said[0]
    skips = json.loads((straight / "data_skips.json").read_text())
    assert list(skips) == ["step00000020"] and skips["step00000020"]["spike_step"] == 26, skips
    # the data since the checkpoint is skipped: steps 21..26 (2 micro-batches of 2 on 2 ranks each) and more
    assert skips["step00000020"]["loader"]["position"] >= 26 * 8, skips
    losses = _losses(straight)
    assert sorted(losses) == list(range(1, 31))  # every step once: the steps before the rollback were trimmed
    # stopped after the rollback: 28 steps, no checkpoint after step 20; then resumed without the fault
    _train(split, manifest, *settings, "train.save_final=false", env=spike, steps=28, extra=accum)
    assert (split / "data_skips.json").read_text() == (straight / "data_skips.json").read_text()
    resumed_log = _train(split, manifest, *settings, steps=30, extra=(*accum, "--resume"))[0]
    assert "was rolled back to after the loss spike at step 26" in resumed_log
    resumed = _losses(split)
    assert [resumed[s] for s in range(21, 31)] == [losses[s] for s in range(21, 31)]


def test_memory_snapshots_on_demand_and_on_out_of_memory(tmp_path, monkeypatch):
    """The snapshot mechanism with the CUDA allocator's two calls recorded instead of made (the
    CPU has none): history recording from the start, a snapshot per touch of <out>/profile/SNAPSHOT
    at a logging step, one on an out-of-memory error, which is raised on."""
    import time

    import torch

    from pretrain.training.report.profiling import SNAPSHOT_TRIGGER, RunProfiler

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    profiler = RunProfiler(None, tmp_path, 3, torch.nn.Linear(2, 2), memory_history=True)
    assert not profiler.memory_history and calls == []  # no CUDA device: one line, nothing recorded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(type(next(model.parameters())), "is_cuda", property(lambda self: True))
    profiler = RunProfiler(None, tmp_path, 3, model, memory_history=True)
    assert calls == [("record", {"max_entries": 100_000})]
    profiler.snapshot_if_asked(10)  # no trigger yet
    (tmp_path / "profile" / SNAPSHOT_TRIGGER).touch()
    profiler.snapshot_if_asked(20)
    profiler.snapshot_if_asked(30)  # the same touch: no second snapshot
    time.sleep(0.01)
    os.utime(tmp_path / "profile" / SNAPSHOT_TRIGGER)
    profiler.snapshot_if_asked(40)
    with pytest.raises(torch.cuda.OutOfMemoryError), profiler.on_out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    dumps = [Path(path).name for kind, path in calls if kind == "dump"]
    assert dumps == [
        "memory_snapshot_rank3_step20.pickle",
        "memory_snapshot_rank3_step40.pickle",
        "memory_snapshot_rank3_oom.pickle",
    ]


def test_a_slow_rank_is_measured_against_the_others_and_the_wait_shows_as_waiting(monkeypatch, caplog):
    """Fabricated own times of two ranks, one five times slower: 5.0x the other rank (the median of
    both, their mean, read 1.7x); the fast rank's wait for it is "waiting", out of "other"."""
    import logging

    from pretrain.training.report import step_timing

    times = [0.1, 0.5]
    monkeypatch.setattr(step_timing, "gather_floats", lambda own: list(times))
    slow = step_timing.SlowRanks(0, ["a", "b"], factor=1.5, windows=2)
    seconds = {"data": 0.02, "forward": 0.08, "backward": 0.3, "optimizer": 0.05, "other": 0.45, "step": 0.9}
    with caplog.at_level(logging.WARNING, logger="grt.train"):
        for step in (1, 2, 3):
            breakdown, scalars = slow.observe(seconds, step)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("slow rank: rank 1 on b took 0.500 s of its own time per step at step 2, 5.0x")
    assert "the median of the other ranks' 0.100 s" in warning
    assert breakdown["waiting"] == pytest.approx(0.4) and breakdown["other"] == pytest.approx(0.05)
    assert sum(breakdown[k] for k in step_timing.BREAKDOWN) == pytest.approx(seconds["step"])
    assert scalars["ranks/slowest"] == 1.0 and scalars["ranks/own_time_max_s"] == 0.5
    shares = step_timing.breakdown_scalars(breakdown)
    assert shares["time/waiting_s"] == pytest.approx(0.4) and shares["time/waiting_share"] == pytest.approx(0.4 / 0.9)
    # the slow rank waits for no one; its wait is never more than its "other"
    slow_rank = step_timing.SlowRanks(1, ["a", "b"], factor=1.5, windows=2)
    own = {**seconds, "data": 0.1, "forward": 0.4}
    assert slow_rank.observe(own, 1)[0]["waiting"] == 0.0
    times[:] = [0.1, 5.0]
    assert slow.observe(seconds, 4)[0]["waiting"] == seconds["other"]
    # one rank: its own yardstick, never slow, never waiting
    times[:] = [0.1]  # its own
    alone = step_timing.SlowRanks(0, ["a"], factor=1.5, windows=1)
    breakdown, _ = alone.observe(seconds, 1)
    assert breakdown["waiting"] == 0.0 and not alone.named
