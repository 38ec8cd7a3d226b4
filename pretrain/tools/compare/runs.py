"""`grt compare`'s runs as processes: each one `grt train --config-json` in its own run
directory (resumed if interrupted, locked against a second `grt compare` on the same --out),
up to --parallel at a time, with a line on where each stands every PROGRESS_EVERY_S seconds."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pretrain import PROJECT_ROOT
from pretrain.runs.run_config import RunConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The data a run of the comparison trains on, by identity (its manifest's sha256), beside its config:
# a finished run is reused only for the same data, whatever the path names now (`other_data`)
DATA_RECORD = "compare_data.json"


def other_data(run_dir: Path, data: str) -> str | None:
    """Why the run in `run_dir` was trained on other data than the manifest `data` (its recorded
    sha256 is not the file's now), or None (the same, or no record: a run of an older compare)."""
    from data_pipeline.tokenizer import file_sha256

    try:
        recorded = json.loads((run_dir / DATA_RECORD).read_text())["manifest_sha256"]
        now = file_sha256(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if recorded == now else f"manifest sha256 {recorded[:16]} then, {now[:16]} now"


def record_data(run_dir: Path, data: str) -> None:
    """The run's DATA_RECORD, as it starts (a manifest behind a URL has none: taken by its name)."""
    from data_pipeline.tokenizer import file_sha256

    if os.path.isfile(data):
        record = {"data": data, "manifest_sha256": file_sha256(data)}
        (run_dir / DATA_RECORD).write_text(json.dumps(record) + "\n")


def start_run(cfg: RunConfig, nproc: int, log_path: Path, threads: int = 0) -> list[subprocess.Popen]:
    """`grt train --config-json` in nproc local processes (resuming if interrupted)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "compare_run_config.json"
    cfg.save(cfg_path)
    record_data(out, cfg.data)
    cmd = [sys.executable, "-m", "pretrain.cli", "train", "--config-json", str(cfg_path), "--resume"]
    port = _free_port()
    procs = []
    with open(log_path, "a") as log:
        for rank in range(nproc):
            # the caller's working directory, so that every path it gave (and the run config's) means
            # what it meant to the caller; the checkout on the path for a tree that is not installed
            path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            if nproc > 1:
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                )
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=log if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _lock(run_dir: Path) -> Path:
    """Refuse to train a run that another live `grt compare` is training (same --out)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / "compare.lock"
    try:
        pid = int(lock.read_text().strip())
        os.kill(pid, 0)
        if pid != os.getpid():
            raise RuntimeError(
                f"{run_dir} is being trained by another grt compare (pid {pid}); wait for it, "
                f"or remove {lock} if that process is gone"
            )
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass  # no lock, or a stale one
    lock.write_text(f"{os.getpid()}\n")
    return lock


def finished(run_dir: Path) -> bool:
    """Whether a run trained to its end: its summary.json is written, and not by a stop on a signal
    (a SIGTERM'd run writes one too, and is resumed rather than taken as done)."""
    try:
        return not json.loads((run_dir / "summary.json").read_text()).get("stopped_by_signal", False)
    except (FileNotFoundError, ValueError):
        return False


PROGRESS_EVERY_S = 30.0  # how often train_all says where each running run is


def progress(run_dir: Path, steps: int) -> str:
    """Where a run is, from the last record of its metrics.jsonl: "step 40/100, loss 5.12"."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        lines = []
    for line in reversed(lines):  # the last whole record (the newest line may be half written)
        try:
            record = json.loads(line)
            return f"step {record['step']}/{steps}, loss {record['loss']:.3f}"
        except (ValueError, KeyError, TypeError):
            continue
    return f"starting (0/{steps} steps)"


def train_all(todo: list[dict], args: argparse.Namespace, out: Path) -> dict[str, float]:
    """Train the runs, up to --parallel at a time; {label: wall seconds}. Raises on a failed run."""
    running: dict[str, tuple[list[subprocess.Popen], float]] = {}
    pending, walls, reported = list(todo), {}, time.time()
    steps = {run["label"]: run["cfg"].train.steps for run in todo}
    while pending or running:
        while pending and len(running) < max(1, args.parallel):
            run = pending.pop(0)
            _lock(Path(run["cfg"].out))
            log = out / f"{run['label']}.log"
            print(f"training {run['label']} ... (log: {log})", flush=True)
            running[run["label"]] = (start_run(run["cfg"], args.nproc, log, args.threads), time.time())
        time.sleep(1.0)
        if time.time() - reported >= PROGRESS_EVERY_S:
            reported = time.time()
            for label, (_, start) in running.items():
                print(f"  {label}: {progress(out / label, steps[label])}, {time.time() - start:.0f} s", flush=True)
        for label, (procs, start) in list(running.items()):
            codes = [p.poll() for p in procs]
            if any(c is None for c in codes):
                continue
            del running[label]
            (out / label / "compare.lock").unlink(missing_ok=True)
            if any(codes):
                for other, _ in running.values():
                    for p in other:
                        p.terminate()
                raise RuntimeError(f"grt train for {label} failed (exit codes {codes}); see {out / (label + '.log')}")
            walls[label] = time.time() - start
            print(f"  {label} done in {walls[label]:.0f} s", flush=True)
    return walls
