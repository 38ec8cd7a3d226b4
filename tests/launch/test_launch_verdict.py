"""`grt launch` ends with its ranks' verdict (issue 49, docs/reliability.md exit codes): on a rank
failure, on SIGTERM and on Ctrl-C, through the project's exit path, with no torchrun traceback (before:
torchrun's ChildFailedError or SignalException traceback and exit 1, while the ranks themselves had
stopped, or saved and stopped, cleanly).

Real launches: `grt launch --cpu --procs-per-node 2` (torchrun) of micro-grt on the shared shards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiproc import free_port
from train_jobs import REPO, train_args

pytestmark = pytest.mark.slow
LAUNCH = ["launch", "--cpu", "--procs-per-node", "2"]
ENV = {
    k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
}
ENV.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
TORCHRUN_WORDS = ("Traceback", "ChildFailedError", "SignalException", "torch.distributed.elastic")


def launch(shards: Path, out: Path, steps: int, *sets: str, env: dict | None = None) -> subprocess.Popen:
    args = [*LAUNCH, "--master-port", str(free_port()), "--", *train_args(shards, out, steps, *sets)[1:]]
    return subprocess.Popen(
        [sys.executable, "-m", "pretrain.cli", *args],
        cwd=REPO,
        env={**ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal gives it
    )


def no_torchrun_report(stderr: str) -> None:
    for word in TORCHRUN_WORDS:
        assert word not in stderr, (word, stderr[-4000:])


def wait_for_steps(out: Path, proc: subprocess.Popen, steps: int = 2, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps logged (exit {proc.poll()})")


def test_a_rank_failure_ends_the_launch_with_the_ranks_code(shards, tmp_path):
    """Three non-finite losses in a row on rank 1 (train.max_bad_steps=3): every rank stops, exit 3."""
    out = tmp_path / "run"
    proc = launch(shards, out, 20, "train.max_bad_steps=3", env={"GRT_INJECT_NAN_STEPS": "2,2,2"})
    _, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 3, stderr[-4000:]
    no_torchrun_report(stderr)
    assert "grt launch: the ranks ended: rank 0 exit 3, rank 1 exit 3; exit 3" in stderr, stderr[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launch_reaches_the_ranks_and_ends_with_their_verdict(shards, tmp_path, sig):
    """SIGTERM (a pre-emption): the ranks finish the step, save and exit 0, and so does the launch.
    SIGINT (Ctrl-C): the ranks stop at once (exit 130), and so does the launch."""
    out = tmp_path / "run"
    proc = launch(shards, out, 400, "train.log_every=1")
    wait_for_steps(out, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    no_torchrun_report(stderr)
    if sig == signal.SIGTERM:
        assert proc.returncode == 0, stderr[-4000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["stopped_by_signal"] and (out / "checkpoints" / "latest").is_file(), summary
    else:
        assert proc.returncode == 130, stderr[-4000:]
        assert "grt launch: the ranks ended: rank 0 exit 130, rank 1 exit 130; exit 130" in stderr, stderr[-3000:]
