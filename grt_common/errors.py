"""The errors every command shares, at the bottom of the import graph (grt_common imports nothing
of the project): `ConfigError`, raised for input a user can fix (its message names the key, the
file or the value, and what is accepted; commands print it as one line and exit 2), `Stopped`
and `Interrupted`; an exception as one line (`one_line`: in a refusal, a warning, the failure
every rank reports); and the one line of a file-system refusal, which the error boundary of every
command (`pretrain.distributed.run_command`) says (docs/reliability.md).
"""

import errno
import io
import os
import re
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and what is accepted."""


def one_line(err: BaseException) -> str:
    """`Type: message`, the message's whitespace folded (a traceback's or a server's text stays one
    line; an empty message is the type's name), at most 1000 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:1000]


class Stopped(RuntimeError):
    """A command that stopped on purpose with its last good state intact (a run's last checkpoint):
    the error boundary says `stopped: <message>` in one line, exit 3 (docs/reliability.md)."""


class Interrupted(KeyboardInterrupt):
    """A signal that a command's error boundary (`run_command`) turned into an exception
    (SIGINT: Ctrl-C): a command undoes what it wrote, as for a refusal; exit 130. A bare
    KeyboardInterrupt (no boundary installed) is treated as a kill: nothing is undone."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


# The file system's refusals that a user fixes (space, permissions, a path of the wrong kind):
# the error boundary prints them as one line naming the path, exit 2 (`run_command`).
FILE_SYSTEM_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EACCES", "EPERM", "ENOENT", "EEXIST", "ENOTDIR", "EISDIR",
        "ELOOP", "ENAMETOOLONG", "ENOTEMPTY", "EXDEV", "EIO", "EMFILE", "ENFILE",
    )
    if hasattr(errno, name)
)  # fmt: skip


def path_kind(path: str) -> str:
    """What `path` is, in words: "a file", "a folder", "a symlink to the missing X", "missing"."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a symlink to the missing {os.readlink(path)}"
    if os.path.isdir(path):
        return "a folder"
    return "a file" if os.path.exists(path) else "missing"


def file_system_problem(err: BaseException) -> str | None:
    """The one line for a file-system refusal (`err` an OSError of FILE_SYSTEM_ERRNOS, one raised
    from such an error, or a native library's error that says "(os error N)": safetensors),
    naming the path and what is wrong; None for anything else."""
    seen: BaseException | None = err
    while seen is not None and _errno_of(seen) not in FILE_SYSTEM_ERRNOS:
        seen = seen.__cause__  # `raise ... from err` only: an error raised while handling one is its own
    if seen is None:
        return None
    code = _errno_of(seen) or 0
    what = f"{getattr(seen, 'strerror', None) or os.strerror(code)} ({errno.errorcode.get(code, '')})"
    given = [getattr(seen, "filename", None), getattr(seen, "filename2", None)]
    paths = [_final_name(os.fsdecode(p)) for p in given if p is not None] or _file_being_written(seen)
    if not paths:
        return what
    blocker = _not_a_folder(paths[0]) if code == errno.ENOTDIR else paths[0]
    if code in (errno.EEXIST, errno.ENOTDIR) and path_kind(blocker) != "a folder":  # "File exists": a file
        return f"{paths[0]}: {what}: {blocker} is {path_kind(blocker)}, a folder is needed"  # or dangling symlink
    return f"{' -> '.join(paths)}: {what}"


def _errno_of(err: BaseException) -> int | None:
    if isinstance(err, OSError):
        return err.errno
    found = re.search(r"\(os error (\d+)\)", str(err))
    return int(found.group(1)) if found else None


def _not_a_folder(path: str) -> str:
    """The first of `path`'s ancestors (or itself) that exists and is not a folder."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        here = os.sep.join(parts[:i])
        if os.path.lexists(here) and not os.path.isdir(here):
            return here
    return path


def _file_being_written(err: BaseException) -> list[str]:
    """The file of an OSError that names none (the write or close of an open file: a full disk),
    from the frame that raised it: an open file there, or its `filename`/`path` argument."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return []
    here = tb.tb_frame.f_locals
    named = _open_files(here.values()) or [here[k] for k in ("filename", "path") if isinstance(here.get(k), _PATH)]
    if not named and hasattr(here.get("self"), "__dict__"):  # a method writing its own (only) file
        named = _open_files(vars(here["self"]).values())
        named = named if len(named) == 1 else []
    return [_final_name(os.fsdecode(p)) for p in named[:1]]


# a temporary written beside its final name (grt_common/files.py `.NAME.tmpPID`, a shard's
# NAME.tmp, an export's .NAME.partial-XXXX folder): the line names the final name
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?:tmp\d+|partial-\w+)$|^(?P<shard>.+\.tar)\.tmp$")


def _final_name(path: str) -> str:
    parts = path.split(os.sep)
    for i, part in enumerate(parts):
        m = _TEMP_NAME.match(part)
        if m:
            parts[i] = m.group("name") or m.group("shard")
    return os.sep.join(parts)


def _open_files(values: Iterable[object]) -> list[str | bytes]:
    names = [getattr(v, "name", None) for v in values if isinstance(v, io.IOBase)]
    return [name for name in names if isinstance(name, (str, bytes))]


_PATH = (str, bytes, os.PathLike)
