"""A run's checkpoints as files: finding the complete ones and reading what they say, without
DeepSpeed or a process group, for training, inference and the launcher alike; the walk from the
newest to an older usable one (`Fallback`). The checkpoint's three homes, lowest first: this one
(the files), pretrain/training/checkpoint/ (writing and loading them with DeepSpeed's engine:
store.py) and pretrain/training/run_checkpoints.py (when a run loads, saves and rolls back).

Layout of `<out>/checkpoints/`:
    step00001000/            DeepSpeed's files (model, ZeRO partitions, optimizer, scheduler)
        rank<r>_state.pt     per-rank RNG states and data-loader position
        config.json          the run config; tokenizer.model beside it
        COMPLETE             written by rank 0 only after every rank has finished writing
    latest                   the tag of the newest COMPLETE checkpoint, replaced atomically
and beside it `<out>/data_skips.json` (DATA_SKIPS): per tag, where a resume from it takes the data
(a loss-spike rollback's record, pretrain/training/run_checkpoints.py); a decay branch's
`<out>/branch.json` (BRANCH_FILE): the checkpoint it was made from (pretrain/training/start/branch.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

from grt_common.errors import ConfigError, one_line

log = logging.getLogger(__name__)
T = TypeVar("T")
TAG_RE = re.compile(r"^step(\d{8})$")
# DeepSpeed's ZeRO optimizer partitions of a checkpoint, one per rank that wrote it (group 1: the rank)
ZERO_PARTITION_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
DATA_SKIPS = "data_skips.json"
BRANCH_FILE = "branch.json"


class UnreadableCheckpoint(ConfigError):
    """A complete checkpoint whose files cannot be read (cut off, corrupt, missing): a resume
    passes over it to the previous complete one; anywhere else it is a one-line error."""

    def __init__(self, tag: str, problem: str) -> None:
        super().__init__(f"checkpoint {tag} cannot be read: {problem}")
        self.tag, self.problem = tag, problem


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    m = TAG_RE.match(tag)
    if m is None:
        raise ValueError(f"{tag!r} is not a checkpoint tag (stepNNNNNNNN)")
    return int(m.group(1))


def complete_tags(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / "COMPLETE").is_file())


def find_latest(root: Path) -> str | None:
    """The newest complete checkpoint: `latest` if it points at one, else the newest COMPLETE tag."""
    marker = root / "latest"
    if marker.is_file():
        try:
            tag = marker.read_text(errors="replace").strip()
        except OSError:
            tag = ""
        if TAG_RE.match(tag) is None:  # a path (../other_run/...) is not followed out of the folder
            log.warning(
                "checkpoint marker %s names %r, which is not a checkpoint of %s (stepNNNNNNNN); using the newest "
                "complete one there",
                marker,
                tag[:200],
                root,
            )
        elif (root / tag / "COMPLETE").is_file():
            return tag
        else:
            log.warning(
                "checkpoint marker %s names %r, which is not complete; using the newest complete one", marker, tag
            )
    tags = complete_tags(root)
    return tags[-1] if tags else None


def tag_dirs(root: Path) -> list[str]:
    """Every checkpoint directory, complete or not (an interrupted save leaves one without COMPLETE)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if TAG_RE.match(p.name) and p.is_dir())


def named_checkpoint(given: str | Path, what: str, accepted: str) -> tuple[Path, Path | None]:
    """What a path given for a checkpoint names: a complete checkpoint (its tag directory) -> its
    checkpoints folder and it; a run's checkpoints folder or its run directory -> that folder and
    None (its newest complete checkpoint is meant: `newest_checkpoint`). Read alike by --branch-from
    and the commands that load a model (`grt eval`, `export`, `generate`). A ConfigError of one line,
    `what` (the flag, or "") and `given` first, where it names none: an interrupted checkpoint, or
    `accepted` (what the caller takes) saying what would be."""
    p = Path(given).resolve()
    if TAG_RE.match(p.name) and p.is_dir():
        if not (p / "COMPLETE").is_file():
            raise ConfigError(
                f"{what}{given}: not a complete checkpoint (no COMPLETE marker): it was interrupted while saving"
            )
        return p.parent, p
    for root in (p, p / "checkpoints"):
        if root.is_dir() and (root.name == "checkpoints" or (root / "latest").is_file() or tag_dirs(root)):
            return root, None
    raise ConfigError(f"{what}{given}: {accepted} (<out>, <out>/checkpoints or <out>/checkpoints/stepNNNNNNNN)")


def newest_checkpoint(root: Path, what: str) -> Path:
    """The tag directory of the newest complete checkpoint in `root`; a ConfigError naming `what`
    (the flag, or "") and the folder where there is none."""
    latest = find_latest(root)
    if latest is None:
        raise ConfigError(f"{what}{root} holds no complete checkpoint")
    return root / latest


def branch_source(given: str, out: str | None) -> Path:
    """The checkpoint (absolute tag directory) `--branch-from given` names (`named_checkpoint`).
    Where `out` already is a branch of that run (its BRANCH_FILE; a restart), the tag it was made
    from. ConfigError (one line) when there is none."""
    if not out:
        raise ConfigError("--branch-from needs --out: the branch's own, new run directory")
    accepted = "no run directory, checkpoints folder or checkpoint"
    root, tag_dir = named_checkpoint(given, "--branch-from ", accepted)
    recorded = read_json(Path(out) / BRANCH_FILE)
    if recorded is not None and Path(recorded.get("source_run", "")) == root.parent:
        made_from = Path(str(recorded.get("checkpoint", "")))
        if made_from.parent != root or TAG_RE.match(made_from.name) is None:  # the record is not followed out
            raise ConfigError(
                f"--out {out}: its {BRANCH_FILE} names checkpoint {str(made_from)[:300]!r}, which is not a checkpoint "
                f"of {root}, the run it records as the source: repair or remove {Path(out) / BRANCH_FILE}"
            )
        if tag_dir is not None and tag_dir != made_from:
            raise ConfigError(
                f"--out {out} is a branch of {made_from} ({BRANCH_FILE}), not of {tag_dir}: "
                f"resume it with --branch-from {made_from}, or choose another --out"
            )
        return made_from
    return tag_dir or newest_checkpoint(root, "--branch-from ")


@dataclass(frozen=True)
class SavedRun:
    """What a continued run starts from, as a run saved it (`saved_run`): the run config (`config`,
    None: none saved) read from the file `path`; for a decay branch the checkpoint it branches from
    (`source`), its step, and the ranks that wrote it (0 where its config was not read)."""

    config: dict[str, Any] | None = None
    path: Path | None = None
    source: Path | None = None
    step: int = 0
    ranks: int = 0


def saved_run(
    out: str | None,
    branch_from: str | None,
    resume: bool,
    *,
    config_json: str | None,
    model_given: bool,
    fetch: Callable[[Path], object] | None = None,
) -> SavedRun:
    """Every read of what a run continued into `out` starts from, in one place: a decay branch's
    source checkpoint (`branch_source`) and its config (or, pruned there since, the branch's copy of
    it); a `resume`'s run directory's config.json (the run as it last started), after `fetch` brought
    a newer checkpoint there from its mirror; none for a new run or a --resume of a directory that
    never started. Where the command line gives the config itself (`config_json`) that config, and
    the source alone. A run directory holding checkpoints without its config.json is refused unless
    the command line gives the model (`model_given`). First, an `out` that is a checkpoint is
    refused (`check_not_a_checkpoint`), before anything is read or fetched into it."""
    if out:
        check_not_a_checkpoint(Path(out))
    source = branch_source(branch_from, out) if branch_from else None
    if config_json:
        path = Path(config_json)
        return SavedRun(saved_config_dict(path.parent, "--config-json", path.name), path, source)
    if source is not None:
        for tag_dir in (source, Path(out or "") / "checkpoints" / source.name):
            if (tag_dir / "COMPLETE").is_file():
                config = saved_config_dict(tag_dir, f"--branch-from {tag_dir}")
                ranks = ranks_that_wrote(tag_dir) or 1
                return SavedRun(config, tag_dir / "config.json", source, step_of(source.name), ranks)
        raise ConfigError(f"--branch-from {source}: no complete checkpoint there")
    if not (resume and out):
        return SavedRun()
    run = Path(out)
    if fetch is not None:
        fetch(run)
    if (run / "config.json").is_file():
        return SavedRun(saved_config_dict(run, "--resume"), run / "config.json")
    if tag_dirs(run / "checkpoints") and not model_given:
        raise ConfigError(
            f"--resume: {run / 'config.json'} is missing: {run} holds checkpoints but not the run's settings; "
            f"restore it, or resume with a checkpoint's own (--config-json {run}/checkpoints/<tag>/config.json)"
        )
    return SavedRun()


def saved_config_dict(folder: Path, where: str, name: str = "config.json") -> dict[str, Any]:
    """The run config a run saved in `folder` (a checkpoint's, or a run directory's config.json,
    `read_config`; or a --config-json's file `name`); `where` names it in the one line that refuses
    an unreadable one."""
    try:
        return read_config(folder, name)
    except UnreadableCheckpoint as err:
        raise ConfigError(f"{where}: {folder / name}: {err.problem}") from None


def resume_candidates(root: Path) -> list[str]:
    """The complete checkpoints a resume may load, in the order it tries them: `find_latest`'s,
    then each older complete one (the fallbacks when a newer one cannot be read)."""
    newest = find_latest(root)
    return [] if newest is None else [t for t in reversed(complete_tags(root)) if t <= newest]


class Fallback:
    """A resume's walk over complete checkpoints, newest first (`resume_candidates`): iterating
    yields the newest tag not passed over yet, until the caller uses one; one that cannot be used is
    `pass_over`ed to the previous one, what made it unusable kept in order (`passed`) for the
    resume's lines and for the refusal when none is left (`none_left`). `first_usable` is the walk
    itself, which the start's plan, the dry run's read-through and the ranks' load all take."""

    def __init__(self, root: Path, tags: Iterable[str]) -> None:
        self.root = root
        self.remaining = list(tags)  # newest first: the tag in use, then its fallbacks
        self.passed: dict[str, str] = {}  # each tag passed over: what made it unusable

    def __iter__(self) -> Iterator[str]:
        while self.remaining:
            tag = self.remaining[0]
            yield tag
            if self.remaining[:1] == [tag]:
                raise RuntimeError(f"checkpoint {tag} was neither used nor passed over")

    def first_usable(self, use: Callable[[str | None], T], verb: str, proposes_none: bool = False) -> T:
        """The walk: `use(tag)` on the newest tag not passed over yet, then on each older one while it
        raises UnreadableCheckpoint (that tag, err.tag, is passed over with its problem); what the first
        that can be used returns. `proposes_none`: a rank with no tag left still takes part in its
        ranks' round, with None (a collective `use`, checkpoint/store.py). ConfigError (`none_left`,
        `verb`: "read", "loaded") when none is left; a refusal `use` raises ends the walk."""
        for tag in chain(self, [None]) if proposes_none else self:
            try:
                return use(tag)
            except UnreadableCheckpoint as err:
                self.pass_over(err.tag, err.problem)
        raise self.none_left(verb)

    def agree(self, tag: str) -> None:
        """The ranks agreed on `tag`: this rank's newer ones are not tried (another rank lacks them)."""
        self.remaining = [t for t in self.remaining if step_of(t) <= step_of(tag)]

    def pass_over(self, tag: str, problem: str) -> None:
        self.passed[tag] = problem
        self.remaining = [t for t in self.remaining if t != tag]

    def unloadable(self) -> list[str]:
        """The resume's line of each tag passed over by the load (the ranks' read of its files)."""
        return [f"checkpoint {tag} cannot be loaded ({problem})" for tag, problem in self.passed.items()]

    def none_left(self, verb: str, problems: list[str] | None = None) -> ConfigError:
        """The refusal when no tag can be used (`verb`: "read", "loaded"), naming what made each
        unusable, or `problems` where none was tried."""
        tried = [f"{tag}: {problem}" for tag, problem in self.passed.items()] or problems or []
        return ConfigError(
            f"--resume: no complete checkpoint in {self.root} can be {verb} ({'; '.join(tried)}); nothing was "
            "changed: repair or remove them, or choose another --out"
        )


def _is_checkpoints_folder(d: Path) -> bool:
    """A run's `checkpoints/`: named so, and holding checkpoints or beside the run's config.json (a
    folder of one's own named "checkpoints" holding run directories is none)."""
    return d.name == "checkpoints" and (
        bool(tag_dirs(d)) or (d / "latest").exists() or (d.parent / "config.json").is_file()
    )


def check_not_a_checkpoint(out: Path) -> None:
    """Refuse a run directory `out` that is a run's checkpoints folder, a checkpoint, or lies inside
    one: a run there would write its files among the checkpoints (a fresh start from step 0 inside a
    checkpoint rewrote its config.json)."""
    path = Path(os.path.abspath(out))
    for d in (path, *path.parents):
        tag = TAG_RE.match(d.name) is not None and d.parent.name == "checkpoints" and d.is_dir()
        if tag or _is_checkpoints_folder(d):
            run = d.parent.parent if tag else d.parent
            what = ("checkpoint " if tag else "checkpoints folder ") + str(d)
            where = "is" if d == path else "lies inside"
            raise ConfigError(
                f"--out {out} {where} the {what} of the run {run}: a run directory holds checkpoints, it is not "
                f"one; continue that run with --out {run} --resume, or choose another --out"
            )


# Names only a run, or what starts one (`grt launch`, `grt compare`), leaves at the top of its run directory
RUN_MARKERS = ("train.log", "train.lock", "metrics.jsonl", "summary.json", "launch", "compare_run_config.json")
# The folders a run, or what starts one, writes at the top of its run directory, and its files
WRITTEN_FOLDERS = ("checkpoints", "tb", "profile", "hangs", "wandb", "launch")
WRITTEN_FILES = ("config.json", "ds_config.json", DATA_SKIPS, BRANCH_FILE, "compare_data.json", "compare.lock")


def _a_runs_name(out: Path, name: str) -> bool:
    """Whether `name` in `out` is one a run writes: one of its folders, of whatever kind, or one of
    its files that is not a file (the start's check_run_paths names a wrong kind); a file of such
    a name outside a run is someone's (a run would write over it)."""
    return name in WRITTEN_FOLDERS or (name in WRITTEN_FILES and not (out / name).is_file())


def is_run_folder(out: Path) -> bool:
    """Whether the folder `out` holds a run of this project (to resume or continue, or one a launcher
    or `grt compare` has begun): its config.json is a run config, its checkpoints/ a run's, or a name
    only a run leaves is there (an export's config.json is a model's, not a run's)."""
    ckpts = out / "checkpoints"
    if (ckpts.is_dir() and _is_checkpoints_folder(ckpts)) or any(os.path.lexists(out / n) for n in RUN_MARKERS):
        return True
    saved = read_json(out / "config.json")
    return saved is not None and "model" in saved and "train" in saved


def check_run_output(out: Path, inputs: Iterable[str] = ()) -> None:
    """`grt train`'s share of the one rule of every command's output folder (`check_output_folder`,
    data_pipeline/prepare_output.py): --out is absent or empty, a run of this project
    (`is_run_folder`), or holds only what a run writes (`_a_runs_name`) and the run's own `inputs`
    (its data's manifests, its DeepSpeed file: the demo's data lies in its run directory); a
    prepared dataset, an export or other files are refused before anything is read or written.
    There is no --overwrite: a run deletes nothing it did not write."""
    from data_pipeline.prepare_output import OutputOfSomethingElse, among_inputs, check_output_folder

    check_not_a_checkpoint(out)  # a checkpoint or a checkpoints folder: its own words
    reads = tuple(inputs)

    def own(names: list[str]) -> bool:
        return is_run_folder(out) or all(_a_runs_name(out, n) or among_inputs(str(out), n, reads) for n in names)

    try:
        check_output_folder(str(out), own, None)
    except OutputOfSomethingElse as err:
        raise ConfigError(f"--out {err}") from None


def ranks_that_wrote(step_dir: Path) -> int:
    """How many ranks wrote a checkpoint (its per-rank state files; 0: none found)."""
    return len(list(step_dir.glob("rank*_state.pt")))


def read_json(path: Path) -> dict[str, Any] | None:
    """A small JSON record of the run's (branch.json, data_skips.json); None where it is missing,
    unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_config(step_dir: Path, name: str = "config.json") -> dict[str, Any]:
    """A checkpoint's saved run config (its `config.json`, or the file `name`) as a dict;
    UnreadableCheckpoint (one line) when it is missing, cut off or not a JSON object."""
    path = step_dir / name
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UnreadableCheckpoint(step_dir.name, f"{name} is missing (no such file)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        problem = f"{name} is cut off or corrupt (not valid JSON: {error_text(err, '')})"
        raise UnreadableCheckpoint(step_dir.name, problem) from None
    if not isinstance(data, dict):
        raise UnreadableCheckpoint(step_dir.name, f"{name} holds a JSON {type(data).__name__}, not an object")
    return data


def error_text(err: BaseException | None, fallback: str) -> str:
    """The error as one line, or `fallback` where there is none (it failed on another rank)."""
    return one_line(err) if err is not None else fallback
