"""Start N local ranks of a Python command the way a launcher would (env:// rendezvous)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# The ports tests hand to their ranks: below the kernel's ephemeral range (32768-60999 on
# Linux), where every outgoing connection and every listener bound to port 0 (gloo's, the
# single-process store's) takes its port, so no process takes one of these by chance between
# free_port() and the moment rank 0 listens on it (seconds later: imports); and below
# 20000-39999 (Slurm jobs' default MASTER_PORT) and 29500 (the default one).
TEST_PORTS = range(15000, 20000)
# Ports this process handed out: each with its reservation (see free_port), held until the process ends
_RESERVED: dict[int, socket.socket] = {}


def free_port(ports: range = TEST_PORTS) -> int:
    """A port of `ports` that no other test process was given and nothing listens on now.

    Binding port 0 and closing the socket (what this did before) hands out a port of the
    ephemeral range, which any connection can take again before the child process listens
    on it: rank 0 then died with EADDRINUSE. Here a port is reserved for the life of this
    process before it is handed out, by binding a Unix socket of the abstract namespace named
    after it (Linux: no file, one namespace per network namespace like the ports themselves,
    and the kernel releases it when the process ends, however it ends). Every test process on
    the host (pytest workers, the suites of other checkouts) skips the ports another one
    reserved, so two concurrent tests are never given the same port, and this process never
    gives one twice. A port something already uses (a bind to it fails) is skipped too."""
    start = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if port in _RESERVED:
            continue
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0grt-test-port-{port}")
        except OSError:  # another process holds it
            lock.close()
            continue
        try:
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", port))
        except OSError:  # in use by a process that is no test
            lock.close()
            continue
        _RESERVED[port] = lock
        return port
    raise RuntimeError(f"no free port left in {ports.start}-{ports.stop - 1}")


def release_port(port: int) -> None:
    """Give up the reservation of `port` (free_port hands it out again, here or elsewhere)."""
    lock = _RESERVED.pop(port, None)
    if lock is not None:
        lock.close()


def start_ranks(
    args: list[str],
    world: int = 2,
    port: int | None = None,
    env: dict | None = None,
    cwd: Path = REPO,
    rank_env: dict[int, dict] | None = None,
    logs: list[Path] | None = None,
) -> list[subprocess.Popen]:
    """Start `python <args>` as ranks 0..world-1 on `port` (default: free_port()) the way torchrun
    would (the tests' one starter of rank processes). `env` applies to every rank, `rank_env[r]` to
    rank r only. Output piped; with `logs`, rank r's goes to logs[r] and each rank leads its own
    session, and a job of one rank is a plain process (no rank variables)."""
    port = free_port() if port is None else port
    procs = []
    for rank in range(world):
        rank_vars = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(rank_vars if logs is None or world > 1 else {}),
            **(env or {}),
            **((rank_env or {}).get(rank, {})),
        }
        with open(logs[rank], "w") if logs is not None else contextlib.nullcontext() as log:
            proc = subprocess.Popen(
                [sys.executable, *args],
                env=full_env,
                cwd=cwd,
                stdout=log or subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=logs is not None,
            )
        procs.append(proc)
    return procs


def run_ranks(
    args: list[str],
    world: int = 2,
    timeout: float = 300,
    env: dict | None = None,
    cwd: Path = REPO,
    port: int | None = None,
) -> list[subprocess.CompletedProcess]:
    """Run `python <args>` as ranks 0..world-1; returns the finished processes (rank order)."""
    procs = start_ranks(args, world, port, env, cwd)
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
