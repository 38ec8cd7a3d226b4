"""The output folder of `prepare`: `OutputDir`, through which every file there is written, set
aside and put back or cleaned up, and the tokenizer file copied next to the shards."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from collections.abc import Callable
from typing import Any

from grt_common.files import FolderLock, is_temp

from .manifest import MANIFEST_NAME
from .shards import write_shard_atomic
from .tokenizer import Tokenizer

TOKENIZER_NAME = "tokenizer.model"
_SHARD_RE = re.compile(r"^(train|val)-\d{6}\.tar$")
_SHARD_TMP_RE = re.compile(r"^(train|val)-\d{6}\.tar\.tmp$")
# what a run set aside (`OutputDir`): `.NAME.oldN` of the pipeline's own names only
_ASIDE_RE = re.compile(r"^\.(manifest\.json|tokenizer\.model|(train|val)-\d{6}\.tar(\.tmp)?)\.old\d+$")


class OutputOfSomethingElse(ValueError):
    """An existing output that a command would replace without --overwrite (`refuse_other_output`)."""


def refuse_other_output(path: str, holds: str, same: bool, overwrite: bool | None) -> None:
    """The one rule of every command that writes a folder (`grt data prepare`, `join` and `chains`,
    `grt export`, `grt analyze`, `grt train`): an existing output of something else (`holds`: what it
    is) is replaced only with --overwrite, and then only once the new one is complete; the same
    command's own output again (a rerun) is not something else. `overwrite` None: the command has
    no --overwrite (`grt train`: it deletes nothing it did not write). One line."""
    if same or overwrite:
        return
    if overwrite is None:
        raise OutputOfSomethingElse(f"{path} exists and holds {holds}; choose another output (a new or empty folder)")
    raise OutputOfSomethingElse(
        f"{path} exists and holds {holds}; pass --overwrite to replace it (once the new one is complete), "
        "or choose another output"
    )


# What each command of the project leaves in its folder, by a name only it writes (a refusal's words)
_MADE_BY = (
    (MANIFEST_NAME, "a prepared dataset"),
    ("model.safetensors", "an export"),
    ("checkpoints", "a training run"),
    ("train.log", "a training run"),
    ("analysis.json", "an analysis report"),
    ("comparison.json", "a comparison"),
)


def folder_entries(path: str) -> list[str]:
    """The names in an existing folder that count as content: all but this project's leftovers (a
    killed command's temporaries, what a prepare set aside); none for a path that is not a folder."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if not (is_temp(n) or _ASIDE_RE.match(n)))


def folder_holds(path: str) -> str:
    """What a non-empty folder holds, in words: the command's output it is, or its first names."""
    names = folder_entries(path)
    for name, what in _MADE_BY:
        if name in names:
            return f"{what} ({name})"
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"files of something else ({shown})"


def among_inputs(path: str, name: str, inputs: tuple[str, ...]) -> bool:
    """Whether the entry `name` of the folder `path` is one of the files a command reads (`inputs`),
    or a folder holding one: a command's own input inside its output folder is not something else."""
    entry = os.path.realpath(os.path.join(path, name))
    return any(os.path.commonpath([entry, os.path.realpath(p)]) == entry for p in inputs if "://" not in p)


def check_output_folder(path: str, own: Callable[[list[str]], bool], overwrite: bool | None) -> None:
    """`refuse_other_output` for a folder: absent or empty is accepted, and so is one whose names
    (`folder_entries`) `own` takes for the command's own output; anything else is refused in the
    same words by every command (`folder_holds`). A ValueError (`OutputOfSomethingElse`)."""
    names = folder_entries(path)
    if names:
        refuse_other_output(path, folder_holds(path), own(names), overwrite)


def made_by(manifest_path: str, identity: dict[str, Any]) -> bool:
    """Whether the manifest at `manifest_path` was written by the prepare `identity` describes
    (`prepare_identity`: its inputs, options and tokenizer); a manifest that cannot be read was not."""
    try:
        with open(manifest_path, encoding="utf-8") as fh:
            raw = json.load(fh)
        recorded = prepare_identity(
            [(s["path"], s["split"]) for s in raw["sources"]], raw["options"], raw["tokenizer"]["sha256"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return recorded == identity


def prepare_identity(files: list[tuple[str, str]], options: dict[str, Any], tokenizer_sha256: str) -> dict[str, Any]:
    """What makes a prepare's output its own: the input files (path, split), the options as its manifest
    records them, the tokenizer's sha256 (JSON's types: a manifest read back compares equal)."""
    return json.loads(json.dumps({"files": files, "options": options, "tokenizer": tokenizer_sha256}))


class OutputDir:
    """The output folder of one run, changed so that a refused run can be undone.

    Nothing there is deleted or overwritten before the run is complete: whatever a new file
    replaces is first renamed to a hidden ``.NAME.oldN`` beside it, the old manifest before
    the first file it may describe (so that no manifest describes shards being replaced).
    `commit` deletes what was set aside, and stale shards, once the new manifest is in place;
    `rollback` (a refused run) deletes what this run wrote, renames everything back and
    removes the folders it made. An interrupted run (a kill, Ctrl-C) leaves complete
    ``*.tar`` files only, and the old manifest only if none of its files was replaced yet;
    the next complete run deletes what it set aside.
    """

    def __init__(
        self, path: str, identity: dict[str, Any] | None = None, overwrite: bool = False, inputs: tuple[str, ...] = ()
    ) -> None:
        self.path = path
        # `open` refuses what is not this command's own output; `inputs`: files it reads that may lie there
        self.identity, self.overwrite, self.inputs = identity, overwrite, inputs
        self.created: list[str] = []  # folders this run made, outermost first
        self.aside: list[tuple[str, str]] = []  # (name, hidden name it was renamed to), in order
        self.written: list[str] = []  # names this run wrote (temporaries included)
        self.lock: FolderLock | None = None  # held from `open` to `commit` or `rollback`

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self) -> None:
        """Make the folder and its missing parents, and take its lock (refused while another command
        writes it: a ValueError); refuse a folder that holds something other than this command's own
        output without --overwrite (`check_output_folder`; nothing is changed)."""
        missing, d = [], os.path.abspath(self.path)
        while not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:  # another command made it first: its lock says whose it is
                continue
            self.created.append(d)
        self.lock = FolderLock(self.path, "prepare")
        check_output_folder(self.path, self._own, self.overwrite)

    def _own(self, names: list[str]) -> bool:
        """Whether the folder's `names` are this command's own output: the pipeline's names only
        (shards without a manifest: an interrupted run's) or the files it reads, and a manifest
        there written by the same command (`made_by`)."""
        for name in names:
            ours = name in (MANIFEST_NAME, TOKENIZER_NAME) or _SHARD_RE.match(name) or _SHARD_TMP_RE.match(name)
            if not ours and not among_inputs(self.path, name, self.inputs):
                return False
        if MANIFEST_NAME not in names or self.identity is None:  # None: no record to tell one of its own runs
            return True
        return made_by(self._join(MANIFEST_NAME), self.identity)

    def _set_aside(self, name: str) -> None:
        if not os.path.lexists(self._join(name)):
            return
        if name != MANIFEST_NAME and not name.endswith(".tmp"):  # a file the old manifest may describe
            self._set_aside(MANIFEST_NAME)
        n = os.getpid()
        while os.path.lexists(self._join(f".{name}.old{n}")):
            n += 1
        os.rename(self._join(name), self._join(f".{name}.old{n}"))
        self.aside.append((name, f".{name}.old{n}"))

    def put_shard(self, name: str, data: bytes) -> str:
        """Write shard ``name`` (through ``NAME.tmp``); returns its sha256."""
        if name + ".tmp" not in self.written:
            self._set_aside(name + ".tmp")  # a partial shard of an interrupted run: garbage, but not ours
            self.written.append(name + ".tmp")
        return write_shard_atomic(self._join(name), data, before_replace=lambda: self._replacing(name))

    def _replacing(self, name: str) -> None:
        """``name`` is about to be this run's: the old one set aside (a write that fails before
        this, a full disk, leaves the old file where it is, for `rollback` not to remove)."""
        self._set_aside(name)
        self.written.append(name)

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` complete (fsynced under a temporary name), then set the old one aside and rename."""
        tmp = f".{name}.tmp{os.getpid()}"
        self.written.append(tmp)
        with open(self._join(tmp), "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self._replacing(name)
        os.replace(self._join(tmp), self._join(name))

    def commit(self, keep: set[str]) -> None:
        """The new manifest is in place: delete what was set aside, shards an earlier (larger) run
        left behind and leftovers of interrupted runs; only this pipeline's own names."""
        for f in os.listdir(self.path):
            stale_shard = _SHARD_RE.match(f) is not None and f not in keep
            if stale_shard or _SHARD_TMP_RE.match(f) or _ASIDE_RE.match(f) or is_temp(f):
                os.unlink(self._join(f))
        self.unlock()

    def unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def rollback(self) -> list[str]:
        """Undo the run: the folder as it was before `open` (a second signal waits until it is).
        Returns what could not be undone."""
        stops = {signal.SIGINT, signal.SIGTERM}
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            return self._undo()
        finally:
            self.unlock()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _undo(self) -> list[str]:
        problems = []
        for name in reversed(self.written):
            try:
                if os.path.lexists(self._join(name)):
                    os.unlink(self._join(name))
            except OSError as err:
                problems.append(f"remove {name}: {err}")
        for name, hidden in reversed(self.aside):
            try:
                os.rename(self._join(hidden), self._join(name))
            except OSError as err:
                problems.append(f"rename {hidden} back to {name}: {err}")
        for d in reversed(self.created):
            try:
                os.rmdir(d)
            except OSError as err:
                problems.append(f"remove the folder {d}: {err}")
        return problems


def tokenizer_bytes(tok: Tokenizer, out: OutputDir) -> bytes | None:
    """The tokenizer to put next to the shards, or None when it is that file already."""
    dst = os.path.join(out.path, TOKENIZER_NAME)
    if os.path.exists(dst) and os.path.samefile(dst, tok.model_path):
        return None
    with open(tok.model_path, "rb") as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != tok.sha256:
        raise ValueError(f"the tokenizer {tok.model_path!r} changed while prepare ran")
    return data
