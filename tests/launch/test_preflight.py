"""`grt launch --preflight` / `--preflight-only` (launcher/preflight.py): every rank measured before
training, one table, the slow rank named and the launch stopped; a passing check is followed by the
training launch. Real launches (torchrun, 2 CPU ranks); a rank is slowed from outside, as a throttled
device would be: SIGSTOP and SIGCONT in turn."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from launch_helpers import grt_launch, read_metrics, throttle, train_args
from train_jobs import descendants

LAUNCH = ("--launcher", "local", "--cpu", "--procs-per-node", "2")


def rank_pid(root: int, rank: int) -> int | None:
    """The process under `root` whose environment says RANK=`rank` (a torchrun worker)."""
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


@pytest.mark.slow
def test_a_slowed_rank_is_named_and_stops_the_launch(tmp_path):
    out = tmp_path / "run"
    proc = grt_launch(*LAUNCH, "--preflight", "--", *train_args(out, 2), background=tmp_path / "launch.log")
    done = threading.Event()
    rank1, running = (lambda: rank_pid(proc.pid, 1)), (lambda: proc.poll() is None)
    slowing = threading.Thread(target=throttle, args=(rank1, done, running), daemon=True)
    slowing.start()
    try:
        rc = proc.wait(timeout=300)
    finally:
        done.set()
        slowing.join(5)
    log = (tmp_path / "launch.log").read_text()
    assert rc == 3, log[-3000:]
    assert "FAILED: rank 1 on " in log and "GEMM TFLOP/s" in log, log[-3000:]
    assert "grt launch --preflight: stopped: preflight failed: rank 1 on" in log
    record = json.loads((out / "launch" / "preflight.json").read_text())
    assert [r["rank"] for r in record["rows"]] == [0, 1] and record["failures"]
    gemm = {r["rank"]: r["gemm_tflops"] for r in record["rows"]}
    assert gemm[1] < 0.8 * gemm[0], gemm
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()  # no training started


@pytest.mark.slow
def test_a_passing_check_is_followed_by_training(tmp_path):
    out = tmp_path / "run"
    r = grt_launch(*LAUNCH, "--preflight", "--preflight-limits", "slow=0", "--", *train_args(out, 2))
    assert "preflight: 2 rank(s) on 1 node(s)" in r.stdout + r.stderr and "passed" in r.stdout
    record = json.loads((out / "launch" / "preflight.json").read_text())
    assert record["failures"] == [] and record["limits"]["slow"] == 0
    row = record["rows"][0]
    assert row["gemm_tflops"] > 0 and row["node_busbw"] > 0 and row["cross_busbw"] is None  # one node
    assert row["write_mbs"] > 0 and row["read_mbs"] > 0 and row["free_bytes"] > row["need_bytes"] > 0
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_limits_that_do_not_parse_are_one_line_before_any_rank(tmp_path):
    flags = ("--preflight", "--preflight-limits", "fast=2", "--dry-run")
    r = grt_launch(*LAUNCH, *flags, "--", *train_args(tmp_path / "r", 2), check=False)
    lines = [ln for ln in r.stderr.splitlines() if "grt launch" in ln]
    assert r.returncode == 2 and "--preflight-limits 'fast=2'" in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and not (tmp_path / "r").exists()
