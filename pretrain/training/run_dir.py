"""--out of a run, and the log: nothing is written into the run directory before rank 0 holds its
lock (run_lock.py, agreed by every rank) and, on resume, before a checkpoint is loaded on every
rank; then `commit` writes the run's config files and the log held in memory so far. A refused
start leaves --out as it was (docs/reliability.md, "Bad runs")."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError
from pretrain.distributed import RankFailed, check_ranks
from pretrain.training import run_lock
from pretrain.training.ds_config import save_ds_config


def setup_logging(rank: int) -> logging.handlers.MemoryHandler | None:
    """The log on stdout; on rank 0 also kept in memory until `log_to_file` names the file
    (nothing is written into the run directory before the start is known good)."""
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for h in list(root.handlers):
        root.removeHandler(h)
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if rank != 0:
        return None
    held = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    held.setFormatter(fmt)
    root.addHandler(held)
    return held


def log_to_file(held: logging.handlers.MemoryHandler, path: Path) -> None:
    """From now on the log also goes to `path` (appended), the lines held so far first."""
    fh = logging.FileHandler(path)
    fh.setFormatter(held.formatter)
    held.setTarget(fh)
    held.flush()
    root = logging.getLogger()
    root.removeHandler(held)
    held.close()
    root.addHandler(fh)


class RunDir:
    """The run directory of rank `rank`: its lock (rank 0's, released by `closing`) and the log
    held until `commit`."""

    def __init__(self, out: Path, rank: int, closing: ExitStack) -> None:
        self.out, self.rank, self.closing = out, rank, closing
        self.held_log = setup_logging(rank)
        self.lock: run_lock.RunLock | None = None

    def take_lock(self) -> None:
        """Rank 0 takes the run directory's lock; every rank agrees on the outcome (a collective),
        so that a refusal stops them all (exit 2) before anything is written."""
        error = None
        if self.rank == 0:
            try:
                self.lock = run_lock.RunLock.acquire(self.out)
                self.closing.callback(self.lock.release)
            except ConfigError as err:
                error = str(err)
        try:
            check_ranks(error, code=2)
        except RankFailed as failed:
            raise ConfigError(error or str(failed)) from None

    def commit(self, config_json: str, ds: dict[str, Any]) -> None:
        """The start is good (the checkpoint loaded on every rank): from here the run writes into
        --out, first its config files and the log held so far (rank 0)."""
        if self.rank != 0:
            return
        if self.lock is not None:
            self.lock.commit()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.held_log is not None:
            log_to_file(self.held_log, self.out / "train.log")
            self.held_log = None
        (self.out / "config.json").write_text(config_json)
        save_ds_config(ds, self.out)
