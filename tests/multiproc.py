"""Start N local ranks of a Python command the way a launcher would (env:// rendezvous)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    args: list[str], world: int = 2, timeout: float = 300, env: dict | None = None, cwd: Path = REPO
) -> list[subprocess.CompletedProcess]:
    """Run `python <args>` as ranks 0..world-1; returns the finished processes (rank order)."""
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env=rank_env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, None))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def grt(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m pretrain.cli <args>` (the `grt` command) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
