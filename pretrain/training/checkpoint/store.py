"""Checkpoints that are complete or invisible: written and loaded through DeepSpeed's engine.

The layout of `<out>/checkpoints/` and how a complete one is found: pretrain/runs/checkpoint_files.py;
when a run saves, loads and rolls back: pretrain/training/run_checkpoints.py.
A kill at any moment leaves either the previous `latest` or the new one, never a
half-written checkpoint that is loaded. Old checkpoints are pruned to the last K. A save writes
its files (`save`), or with train.async_save takes host copies that a thread writes while training
goes on (`start_save`, async_save.py); either way rank 0 marks it COMPLETE only once every rank's
writes have succeeded (`finish_save`).

A resume tries the complete checkpoints newest first (`resume_candidates`, `Fallback`) and loads the
first one that every rank can read (`load_agreed`): each file of a tag is read through
once before the load (`verify`: the zip structure and CRC of every `*.pt`, split over the
ranks), the ranks agree on the outcome, and a tag that fails anywhere is passed over by
every rank together, so that no two ranks ever load different tags. A failed load inside
DeepSpeed would leave the ranks in different collectives; it is read-checked first for that.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from grt_common.errors import ConfigError
from grt_common.files import atomic_path, atomic_write_text, is_temp
from pretrain.distributed import RankFailed, all_agree, all_reduce, check_ranks, comm_device
from pretrain.runs.checkpoint_files import (
    TAG_RE,
    Fallback,
    UnreadableCheckpoint,
    complete_tags,
    error_text,
    find_latest,
    ranks_that_wrote,
    step_of,
    tag_for,
)
from pretrain.runs.trusted_files import load_weights_only, read_through, state_files, weights_only_loads
from pretrain.training.checkpoint import universal
from pretrain.training.checkpoint.async_save import BackgroundWrites
from pretrain.training.engine import deepspeed_internals

if TYPE_CHECKING:
    import deepspeed

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def verify(root: Path, tag: str, rank: int = 0, world: int = 1) -> str | None:
    """Read through this rank's share (every world-th, by name) of the tag's `*.pt` files
    (`read_through`: intact, and data only: nothing in them runs when they are loaded): the
    problem of the first that is not, or None. Split over the ranks, the tag is read once."""
    path = root / tag
    try:
        files = state_files(path)
    except OSError as err:
        return f"cannot list {path} ({error_text(err, '')})"
    if not files:
        return f"{path} holds no model or optimizer state (*.pt)"
    for name in files[rank::world]:
        try:
            read_through(path / name, tag)
        except UnreadableCheckpoint as err:
            return err.problem
    return None


def _previous(root: Path) -> str:
    """What a failed save leaves: the previous complete checkpoint, intact, if there is one."""
    latest = find_latest(root)
    return f"the previous checkpoint ({latest}) is intact" if latest else "no checkpoint was complete before it"


def _no_fault(*_: Any) -> None:
    """A save's fault seam while no test has installed a fault."""


# The two points of a save where the tests' faults act (fault_injection.py installs them; nothing here reads
# the environment): as this rank's files are about to be written (the engine, step, rank, and the
# background writes, None for a synchronous save), and once every rank's are written, before COMPLETE.
on_writing: Callable[[deepspeed.DeepSpeedEngine, int, int, BackgroundWrites | None], None] = _no_fault
on_completing: Callable[[int, int], None] = _no_fault


def _remove_debris(root: Path, tag: str) -> None:
    """What kills left behind: incomplete tags older than `tag` (never loadable, never
    rewritten) and marker temp files (in the root, and in `tag` when it was rewritten)."""
    for p in [*root.iterdir(), *(root / tag).iterdir()]:
        if TAG_RE.match(p.name) and p.name < tag and not (p / "COMPLETE").is_file():
            shutil.rmtree(p, ignore_errors=True)
        elif is_temp(p.name) and p.is_file():
            p.unlink(missing_ok=True)


@dataclass
class PendingSave:
    """A checkpoint whose files a background thread writes (train.async_save): complete once
    `finish_save` has seen every rank's writes end."""

    tag: str
    writes: BackgroundWrites | None  # None: written already (a synchronous save)
    marker: dict[str, Any]  # what rank 0 writes beside the files before COMPLETE (`_complete`)


def save(engine: deepspeed.DeepSpeedEngine, root: Path, step: int, **how: Any) -> str:
    """Write checkpoint `step` on every rank (collective); rank 0 also writes `run_files`
    ({file name: text}, e.g. the W&B run id) beside config.json, before COMPLETE; `fit_state` joins
    each rank's state file (what the fit loop carries across a resume: the loss-spike history). On a write
    failure on any rank (full disk, read-only or missing directory, I/O error) every rank raises
    CheckpointError, the half-written directory is removed and `latest` still names the
    previous complete checkpoint. `how`: the keyword arguments of `_write`."""
    pending = _write(engine, root, step, background=False, **how)
    return finish_save(pending, root, how["rank"])


def start_save(engine: deepspeed.DeepSpeedEngine, root: Path, step: int, **how: Any) -> PendingSave:
    """`save`, its files taken as host copies that a thread writes (train.async_save, async_save.py)
    while training goes on; `finish_save` waits for them and marks the checkpoint complete."""
    return _write(engine, root, step, background=True, **how)


def _write(
    engine: deepspeed.DeepSpeedEngine,
    root: Path,
    step: int,
    *,
    config_json: str,
    tokenizer_path: str | None,
    loader_state: dict[str, Any],
    keep: int,
    rank: int,
    background: bool,
    run_files: Mapping[str, str] | None = None,
    fit_state: Mapping[str, Any] | None = None,
) -> PendingSave:
    tag = tag_for(step)
    path = root / tag
    error: BaseException | None = None
    # 1. the directory, agreed by every rank before DeepSpeed starts its collectives
    try:
        root.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # a resumed run rewrites a tag it wrote before: it is incomplete until rewritten
            (path / "COMPLETE").unlink(missing_ok=True)
        path.mkdir(exist_ok=True)
    except OSError as err:
        error = err
    if not all_agree(error is None):
        raise CheckpointError(
            f"could not create checkpoint directory {path}: "
            f"{error_text(error, 'it failed on another rank')}; {_previous(root)}"
        ) from error
    # 2. DeepSpeed's files and this rank's state (or their host copies, for the thread to write)
    writes = BackgroundWrites(engine.checkpoint_engine) if background else None
    state = {**(fit_state or {}), "rng": rng_state(), "loader": loader_state, "step": step}
    try:
        on_writing(engine, step, rank, writes)
        with _checkpoint_engine(engine, writes), deepspeed_internals.RecordWriteErrors(engine) as recorded:
            engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
        if recorded.errors:
            raise recorded.errors[0]
        if writes is not None:
            writes.add(path / f"rank{rank}_state.pt", state)
            writes.start()
        else:
            with atomic_path(path / f"rank{rank}_state.pt") as tmp:
                deepspeed_internals.save_file(state, tmp)
    except Exception as err:  # torch.save reports a full disk as RuntimeError, not OSError
        error = err
    _agree_written(error, root, path, rank)
    marker = {"config_json": config_json, "run_files": run_files, "tokenizer_path": tokenizer_path, "keep": keep}
    return PendingSave(tag, writes, marker)


@contextmanager
def _checkpoint_engine(engine: deepspeed.DeepSpeedEngine, writes: BackgroundWrites | None) -> Iterator[None]:
    """DeepSpeed's checkpoint engine is `writes` for the save (None: its own)."""
    own = engine.checkpoint_engine
    engine.checkpoint_engine = writes or own
    try:
        yield
    finally:
        engine.checkpoint_engine = own


def _agree_written(error: BaseException | None, root: Path, path: Path, rank: int) -> None:
    if not all_agree(error is None):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {path} (rank {rank}: "
            f"{error_text(error, 'its own files were written, a write failed on another rank')}); "
            f"removed it; {_previous(root)}"
        ) from error


def writes_ended(pending: PendingSave) -> bool:
    """Whether every rank's background writes of `pending` have ended (collective)."""
    return all_agree(pending.writes is None or pending.writes.done())


def finish_save(pending: PendingSave, root: Path, rank: int) -> str:
    """Wait for this rank's background writes of `pending`; when every rank's succeeded, mark it
    complete (collective), else every rank raises CheckpointError as `save` does."""
    if pending.writes is not None:
        _agree_written(pending.writes.wait(), root, root / pending.tag, rank)
    _complete(root, pending.tag, step_of(pending.tag), rank, **pending.marker)
    return pending.tag


def _complete(
    root: Path,
    tag: str,
    step: int,
    rank: int,
    *,
    config_json: str,
    run_files: Mapping[str, str] | None,
    tokenizer_path: str | None,
    keep: int,
) -> None:
    """3. rank 0 marks checkpoint `tag` complete, every rank's files being written (collective)."""
    error: BaseException | None = None
    on_completing(step, rank)
    if rank == 0:
        try:
            (root / tag / "config.json").write_text(config_json)
            for name, text in (run_files or {}).items():
                (root / tag / name).write_text(text)
            if tokenizer_path:
                shutil.copyfile(tokenizer_path, root / tag / "tokenizer.model")
            atomic_write_text(root / tag / "COMPLETE", f"{step}\n")
            atomic_write_text(root / "latest", tag + "\n")
            # among the tags up to this one: a run resumed from an older checkpoint than the newest
            # complete one (that one unreadable) must not count the newer ones and prune its own
            for old in [t for t in complete_tags(root) if t <= tag][:-keep]:
                shutil.rmtree(root / old, ignore_errors=True)
            _remove_debris(root, tag)
        except OSError as err:
            error = err
            shutil.rmtree(root / tag, ignore_errors=True)
    if not all_agree(error is None):
        raise CheckpointError(
            f"could not finish checkpoint {root / tag}: {error_text(error, 'rank 0 failed')}; {_previous(root)}"
        )


def load(engine: deepspeed.DeepSpeedEngine, root: Path, tag: str, rank: int, world: int) -> dict[str, Any]:
    """Load model/optimizer/scheduler into the engine; returns this rank's saved state, with
    "rng_restored": whether its RNG streams are the saved ones. On the world size that wrote the
    checkpoint, this rank's own state file; on another, DeepSpeed's universal copy (the engine
    was built for it, `universal.with_universal_load`; `convert_for_world` made it) and rank 0's
    state: the data loader's position is global, the per-rank RNG streams cannot be carried over."""
    step_dir = root / tag
    same_world = ranks_that_wrote(step_dir) == world
    state_path = step_dir / f"rank{rank if same_world else 0}_state.pt"
    if not state_path.is_file():
        raise CheckpointError(f"{state_path} is missing")
    with weights_only_loads():  # DeepSpeed's torch.load too (verify has read every file through first)
        if engine.load_universal_checkpoint():
            universal.load(engine, step_dir)
        else:
            path, _ = engine.load_checkpoint(
                str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load checkpoint {root / tag}")
    state = load_weights_only(state_path, tag)
    if same_world:
        set_rng_state(state["rng"])
    state["rng_restored"] = same_world
    return state


def convert_for_world(root: Path, tag: str, rank: int, world: int) -> None:
    """Where checkpoint `tag` was written by another number of ranks under ZeRO: rank 0 converts
    it to DeepSpeed's universal checkpoint (once; a complete copy is reused) while the others
    wait; every rank then checks the copy is there. Collective; UnreadableCheckpoint on every
    rank when it fails anywhere (rank 0's words)."""
    step_dir = root / tag
    if not universal.needs_universal(step_dir, world):
        return
    for stage in ("convert", "see"):
        error = None
        try:
            if stage == "convert" and rank == 0:
                universal.convert(step_dir)
            elif stage == "see" and not universal.is_converted(step_dir):
                raise universal.ConversionError(step_dir, f"rank {rank} does not see the converted copy")
        except UnreadableCheckpoint as err:
            error = err.problem
        try:
            check_ranks(error)
        except RankFailed as failed:
            why = "; ".join(text for _, text in sorted(failed.errors.items()))
            raise UnreadableCheckpoint(tag, why) from None


def load_agreed(
    engine: deepspeed.DeepSpeedEngine,
    fallback: Fallback,
    rank: int,
    world: int,
    precheck: Callable[[str], None] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Load the newest of `fallback`'s tags (complete checkpoints, newest first) that every rank
    can read (collective); returns (its tag, this rank's saved state).

    Each round the ranks agree on one tag (the oldest of their proposals: a tag another rank
    does not see is never loaded), each runs `precheck(tag)` (raises ConfigError to refuse the
    resume, UnreadableCheckpoint to pass over the tag) and reads its share of the tag's files
    (`verify`), and the ranks agree on the outcome (`check_ranks`): every rank loads the tag,
    or every rank passes over it (kept in `fallback.passed`) to the previous one, or every rank
    raises ConfigError (a refusal, or no tag left), with nothing loaded and nothing written."""
    root = fallback.root

    def agreed_round(newest: str | None) -> str:
        """One round: the tag the ranks agree on (None: this rank has none left, and proposes none),
        checked and readable on every rank, or UnreadableCheckpoint on every rank with the ranks' words."""
        proposal = torch.tensor([float(step_of(newest) if newest else -1)], dtype=torch.float64, device=comm_device())
        agreed = int(all_reduce(proposal, op="min").item())
        if agreed < 0:
            raise fallback.none_left("loaded", ["none is complete on every rank"])
        tag = tag_for(agreed)
        fallback.agree(tag)
        error, code = None, 1
        try:
            if fallback.remaining[:1] != [tag]:
                raise UnreadableCheckpoint(tag, f"it is not a complete checkpoint in {root} as rank {rank} sees it")
            if precheck is not None:
                precheck(tag)
            problem = verify(root, tag, rank, world)
            if problem is not None:
                raise UnreadableCheckpoint(tag, problem)
        except UnreadableCheckpoint as err:
            error = err.problem
        except ConfigError as err:
            error, code = str(err), 2
        try:
            check_ranks(error, code)
        except RankFailed as failed:
            if failed.code == 2:  # a refusal on some rank: every rank refuses, with the refusing rank's words
                raise ConfigError(error if code == 2 and error is not None else str(failed)) from None
            why = "; ".join(text if world == 1 else f"rank {r}: {text}" for r, text in sorted(failed.errors.items()))
            raise UnreadableCheckpoint(tag, why) from None
        convert_for_world(root, tag, rank, world)  # agreed; UnreadableCheckpoint where its conversion failed
        return tag

    # the last proposal (None) is agreed on by every rank: none_left, on every rank together
    tag = fallback.first_usable(agreed_round, "loaded", proposes_none=True)
    return tag, load(engine, root, tag, rank, world)
