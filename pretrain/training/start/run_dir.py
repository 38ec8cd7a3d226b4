"""--out of a run, and the log: nothing is written into the run directory before rank 0 holds its
lock (run_lock.py, agreed by every rank) and, on resume, before a checkpoint is loaded on every
rank; then `commit` writes the run's config files and the log held in memory so far. A refused
start leaves --out as it was (docs/reliability.md, "Bad runs")."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError, file_system_problem, path_kind
from grt_common.files import atomic_write_text, check_output_path
from pretrain.distributed import RankFailed, check_ranks
from pretrain.runs.checkpoint_files import check_not_a_checkpoint
from pretrain.training.engine.ds_config import save_ds_config
from pretrain.training.start import run_lock

# What a run writes into --out, by kind (checked before anything starts: `check_run_paths`)
RUN_FOLDERS = ("checkpoints", "tb", "profile")
COMMIT_FILES = ("config.json", "ds_config.json", "train.log")  # written by `commit`
RUN_FILES = (*COMMIT_FILES, "metrics.jsonl", "summary.json", run_lock.LOCK_NAME)


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
    """From now on the log also goes to `path` (appended), the lines held so far first (written
    here, so that a full disk is an OSError naming the file, not the logging module's report)."""
    try:
        with open(path, "a") as f:
            f.write("".join(held.format(record) + "\n" for record in held.buffer))
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None
    held.buffer.clear()
    fh = RunLog(path)
    fh.setFormatter(held.formatter)
    root = logging.getLogger()
    root.removeHandler(held)
    held.close()
    root.addHandler(fh)


class RunLog(logging.FileHandler):
    """train.log: the first line that cannot be written (a full disk) stops the run through the
    command's error boundary (one line naming the file), not the logging module's report and
    traceback. The lines logged while the run stops are dropped where they cannot be written:
    raised, the log's error would take the place of the stop being reported (seen: the warning
    of `Trainer.close` after the failure turned exit 3 into 2)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            if not self.failed:
                self.failed = True
                raise err
            return
        super().handleError(record)


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
        --out, first its config files and the log held so far (rank 0). Every rank agrees on the
        outcome (a collective): rank 0 unable to write them (a full disk) stops every rank, exit 2,
        before any writes its own files, and --out is left as it was."""
        error = None
        if self.rank == 0:
            try:
                self._write_run_files(config_json, ds)
            except OSError as err:
                error = file_system_problem(err) or str(err)
        try:
            check_ranks(error, code=2)
        except RankFailed as failed:
            raise ConfigError(error or str(failed)) from None
        if self.lock is not None:
            self.lock.commit()

    def _write_run_files(self, config_json: str, ds: dict[str, Any]) -> None:
        """config.json, ds_config.json and train.log (the log held so far), each complete or absent;
        a failure removes what this call wrote (train.log back to its length)."""
        self.out.mkdir(parents=True, exist_ok=True)
        new = [p for p in (self.out / name for name in COMMIT_FILES) if not p.exists()]
        sizes = {p: p.stat().st_size for p in [self.out / "train.log"] if p.exists()}
        try:
            atomic_write_text(self.out / "config.json", config_json)
            save_ds_config(ds, self.out)
            if self.held_log is not None:
                log_to_file(self.held_log, self.out / "train.log")
                self.held_log = None
        except OSError:
            for path in new:
                path.unlink(missing_ok=True)
            for path, size in sizes.items():
                os.truncate(path, size)
            raise


def check_run_paths(out: Path) -> None:
    """Refuse a run whose --out, or a path it writes there (RUN_FOLDERS, RUN_FILES), is of the wrong
    kind (a file for a folder, a folder for a file, a dangling symlink), or that is or lies inside a run's
    checkpoints, before anything starts."""
    check_not_a_checkpoint(out)
    wanted = [(out, True)] + [(out / n, True) for n in RUN_FOLDERS] + [(out / n, False) for n in RUN_FILES]
    for path, folder in wanted:
        if os.path.lexists(path) and (os.path.isdir(path) != folder or not os.path.exists(path)):
            flag = "--out " if path == out else ""
            need = "a folder" if folder else "a file"
            raise ConfigError(f"{flag}{path} is {path_kind(str(path))}; the run needs {need} there")
    check_links_stay_inside(out)
    try:
        check_output_path(str(out), "--out", is_dir=True)  # under a file, or in a folder this process may not write
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_links_stay_inside(out: Path) -> None:
    """Refuse a run directory where a file the run writes or appends to (train.log, metrics.jsonl,
    config.json, any record at its top, checkpoints/latest) is a symbolic link that leaves it: a
    run directory from elsewhere would have the run write over a file outside it. A folder may be a
    link (checkpoints on another disk: the user's choice of storage)."""
    if not out.is_dir():
        return
    top = os.path.realpath(out)
    files = [p for p in out.iterdir() if not p.is_dir()] + [out / "checkpoints" / "latest"]
    for path in files:
        if path.is_symlink() and os.path.commonpath([top, os.path.realpath(path)]) != top:
            raise ConfigError(
                f"--out {out}: {path.name} is a symbolic link to {os.path.realpath(path)}, outside the run directory; "
                "a run writes its logs and records only inside it: remove the link, or choose another --out"
            )
