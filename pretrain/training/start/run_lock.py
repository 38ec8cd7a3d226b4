"""One run at a time in a run directory: an advisory lock on `<out>/train.lock`.

Rank 0 of `grt train` takes an exclusive `flock` on the file before anything is written
into `--out` (run config, logs, TensorBoard, checkpoints) and keeps it for the life of the
process; the kernel releases it when the process ends, however it ends (a SIGKILL or a
node that dies leaves no stale lock to remove). The file names the holder as one JSON
line (host, pid, start time), so that a second `grt train` on the same `--out` is refused
in one line naming it, without changing anything.

Before the process group exists, every rank only *probes* the lock (`refuse_if_in_use`:
a shared lock taken and dropped at once, on an existing file only): a run directory in use
is refused before any checkpoint is read. The exclusive lock itself is taken by rank 0
after the process group starts (`RunLock.acquire`), so that a refusal there reaches every
rank (the trainer agrees on it) instead of leaving them in the rendezvous.

Until the run `commit()`s (starts writing into `--out`), a refused run leaves the lock
file as it found it: its previous text is written back on `release()`, or the file (and a
`--out` this run created) removed. After the commit the file keeps naming the last holder.

Where the file system refuses locks (`flock` raising ENOLCK or EOPNOTSUPP, as some NFS
mounts do) the run is refused in one line; `GRT_ALLOW_UNLOCKED_OUT=1` trains anyway,
unprotected, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from grt_common.errors import ConfigError
from pretrain.say import say

LOCK_NAME = "train.lock"
OVERRIDE_ENV = "GRT_ALLOW_UNLOCKED_OUT"
UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})


class RunDirInUse(ConfigError):
    """Another process holds the run directory's lock."""


# The descriptor of the lock this process holds. A forked child (a DataLoader worker) closes
# its copy at once: the lock then ends with this process, not with the last child to exit.
_held: list[int] = []


def _close_in_child() -> None:
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def lock_path(out: str | Path) -> Path:
    return Path(out) / LOCK_NAME


def unlocked_allowed() -> bool:
    return os.environ.get(OVERRIDE_ENV) == "1"


# every flock on a lock file: fcntl's, or a test's fault in its place (fault_injection.py: a mount without locks)
flock = fcntl.flock


def _holder(path: Path) -> str:
    """The holder named in the lock file, in words."""
    try:
        info = json.loads(path.read_text())
        return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder not recorded yet"


def _in_use(out: Path) -> RunDirInUse:
    path = lock_path(out)
    return RunDirInUse(
        f"--out {out} is in use by another grt train ({_holder(path)}; lock {path}): wait for it to finish "
        "or stop it, or choose another --out"
    )


def _unsupported(out: Path, err: OSError) -> ConfigError:
    return ConfigError(
        f"--out {out}: its file system refuses file locks (flock on {lock_path(out)}: {os.strerror(err.errno or 0)}), "
        f"so two runs could write into it at once; use a run directory on a file system with locks, or set "
        f"{OVERRIDE_ENV}=1 to train without the lock"
    )


def _warn_unlocked(out: Path, err: OSError) -> None:
    say(
        f"warning: {out}: file locks are not supported here ({os.strerror(err.errno or 0)}); "
        f"training without the run-directory lock ({OVERRIDE_ENV}=1)"
    )


def refuse_if_in_use(out: str | Path) -> None:
    """Refuse (RunDirInUse, one line naming the holder) when a live run holds `out`'s lock.
    Writes nothing: an absent lock file is not created, an existing one only locked shared
    for an instant."""
    out = Path(out)
    path = lock_path(out)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (no run has started here), or one acquire() will explain
    try:
        try:
            flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in _BUSY:
                raise _in_use(out) from None
            if err.errno in UNSUPPORTED and unlocked_allowed():
                return
            raise _unsupported(out, err) from None
        flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class RunLock:
    """The exclusive lock of one run directory, held by rank 0 (`acquire`)."""

    def __init__(self, out: Path, fd: int | None, previous: bytes | None, made_out: bool) -> None:
        self.out, self.fd = out, fd  # fd None: not locked (GRT_ALLOW_UNLOCKED_OUT on a file system without locks)
        self.previous = previous  # the lock file's text before this run (None: this run created it)
        self.made_out = made_out  # this run created --out
        self.committed = False

    @classmethod
    def acquire(cls, out: str | Path) -> RunLock:
        """Lock `out` (created if absent) for this process; RunDirInUse naming the holder if
        another process has it, ConfigError if the file system refuses locks (unless allowed)."""
        out = Path(out)
        made_out = not out.exists()
        path = lock_path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--out {out}: cannot create the run directory ({err.strerror})") from None
        for attempt in range(10):  # another run may remove a lock file it gave up between our open and lock
            try:
                try:
                    fd, existed = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), False
                except FileExistsError:
                    fd, existed = os.open(path, os.O_RDWR), True
            except FileNotFoundError as err:
                if attempt == 9:
                    raise ConfigError(f"--out {out}: cannot open the lock file {path} ({err.strerror})") from None
                continue  # removed in between by a run that gave it up: create it
            except OSError as err:
                raise ConfigError(f"--out {out}: cannot open the lock file {path} ({err.strerror})") from None
            try:
                flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in _BUSY:  # (a file created here a moment ago is the winner's: it stays)
                    raise _in_use(out) from None
                if not existed:
                    path.unlink(missing_ok=True)  # ours, and nobody can lock it: leave --out as it was
                if err.errno in UNSUPPORTED and unlocked_allowed():
                    _warn_unlocked(out, err)
                    return cls(out, None, None, made_out)
                if made_out:
                    _remove_empty(out)
                raise _unsupported(out, err) from None
            try:  # a refused run may have removed the file we opened before we locked it: lock the one in place
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise ConfigError(f"--out {out}: the lock file {path} keeps being replaced; is another run starting here?")
        try:
            previous = os.pread(fd, 1 << 16, 0) if existed else None
        except OSError as err:
            os.close(fd)
            raise ConfigError(f"--out {out}: cannot read the lock file {path} ({err.strerror})") from None
        _held.append(fd)
        lock = cls(out, fd, previous, made_out)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            _rewrite(fd, (json.dumps(record) + "\n").encode())
        except OSError as err:  # a full disk, a read-only mount: say so, leave the file as it was
            lock.release()
            raise ConfigError(f"--out {out}: cannot write the lock file {path} ({err.strerror})") from None
        return lock

    def commit(self) -> None:
        """The run now writes into --out: from here on the lock file keeps naming this run."""
        self.committed = True

    def release(self) -> None:
        """Drop the lock (the kernel does it anyway when the process ends). A run that did not
        commit leaves the lock file, and --out, as it found them."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        if fd in _held:
            _held.remove(fd)
        try:
            if not self.committed:
                if self.previous is None:
                    lock_path(self.out).unlink(missing_ok=True)
                else:
                    _rewrite(fd, self.previous)
                if self.made_out:
                    _remove_empty(self.out)
        finally:
            os.close(fd)  # closing the only descriptor releases the flock


def _rewrite(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _remove_empty(out: Path) -> None:
    try:
        out.rmdir()
    except OSError:
        pass  # not empty: something else is in it
