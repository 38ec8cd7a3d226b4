"""Files that are complete or absent: each is written beside its final name, flushed to disk,
then renamed into place, so a crash, a full disk or a kill leaves the old file or none."""

from __future__ import annotations

import argparse
import fcntl
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path in `path`'s directory (named as `is_temp` recognises); renamed to
    `path` when the block succeeds. An OSError of the block (a full disk: the write of an open
    file names no path) is raised again naming `path`, for the command's one line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        if err.filename not in (None, str(tmp), tmp):
            raise
        raise OSError(err.errno, err.strerror, str(path)) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only file system refuses even that: the error above is the one to say
            pass


def is_temp(name: str) -> bool:
    """An `atomic_path` temporary that a killed writer left behind."""
    return _TEMP_RE.match(name) is not None


_TEMP_RE = re.compile(r"^\..+\.tmp\d+$")


def check_output_path(path: str, what: str, is_dir: bool) -> None:
    """Refuse an output path that cannot be made: one of another kind (a file where a folder
    goes, or the reverse), under a file, or under a folder this process may not write."""
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
        kind = "a file" if is_dir else "a directory"
        raise ValueError(f"{what} {path!r} is {kind}")
    ancestor = os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else os.path.abspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{what} {path!r} cannot be made: {ancestor!r} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path!r} cannot be written: no permission in {ancestor!r}")


def output_path(is_dir: bool) -> Callable[[str], str]:
    """The argparse `type` of every command's output path (a report, a JSON file, a folder):
    `check_output_path` at the door, so that a path that cannot be written is one line, exit 2,
    before any work (not a traceback after an evaluation or a benchmark)."""

    def parse(text: str) -> str:
        try:
            check_output_path(text, "path", is_dir)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    return parse


class FolderLock:
    """The lock of an output folder while a command writes it (`grt data prepare`, `join`): an
    advisory `flock` on the folder itself (no file of its own: a refused command leaves the folder
    byte for byte as it was). A second writer is refused in one line, not merged into the first."""

    def __init__(self, path: str | os.PathLike[str], command: str) -> None:
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise ValueError(
                f"{command}: the output folder {str(path)!r} is being written by another grt data command (it holds "
                "the folder's lock): wait for it to end, or choose another folder"
            ) from None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the descriptor
            self.fd = None


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_savefig(fig: Figure, path: str | os.PathLike[str], **kw: Any) -> None:
    """matplotlib's savefig, complete or absent (the format from `path`'s suffix)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", **kw)
