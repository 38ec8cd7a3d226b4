"""Checkpoints that are complete or invisible.

Layout of `<out>/checkpoints/`:
    step00001000/            DeepSpeed's files (model, ZeRO partitions, optimizer, scheduler)
        rank<r>_state.pt     per-rank RNG states and data-loader position
        config.json          the run config; tokenizer.model beside it
        COMPLETE             written by rank 0 only after every rank has finished writing
    latest                   the tag of the newest COMPLETE checkpoint, replaced atomically

A kill at any moment leaves either the previous `latest` or the new one, never a
half-written checkpoint that is loaded. Old checkpoints are pruned to the last K.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_pipeline.files import atomic_path, atomic_write_text, is_temp
from pretrain.distributed import all_agree
from pretrain.training import deepspeed_internals

if TYPE_CHECKING:
    import deepspeed

log = logging.getLogger(__name__)
TAG_RE = re.compile(r"^step(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def tag_for(step: int) -> str:
    return f"step{step:08d}"


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


def complete_tags(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / "COMPLETE").is_file())


def find_latest(root: Path) -> str | None:
    """The newest complete checkpoint: `latest` if it points at one, else the newest COMPLETE tag."""
    marker = root / "latest"
    if marker.is_file():
        tag = marker.read_text().strip()
        if (root / tag / "COMPLETE").is_file():
            return tag
        log.warning("checkpoint marker %s names %r, which is not complete; using the newest complete one", marker, tag)
    tags = complete_tags(root)
    return tags[-1] if tags else None


def _fault(kind: str, step: int, rank: int) -> bool:
    """Fault injection for the reliability tests: GRT_INJECT_CKPT_FAULT=<kind>@<step>[@<rank>]
    (rank 0 by default). kind `kill`: the rank SIGKILLs itself after every rank has written
    its files and before COMPLETE; `enospc`: DeepSpeed's file writes fail with ENOSPC."""
    spec = os.environ.get("GRT_INJECT_CKPT_FAULT", "")
    parts = spec.split("@")
    return (
        len(parts) >= 2
        and parts[0] == kind
        and int(parts[1]) == step
        and int(parts[2] if len(parts) > 2 else 0) == rank
    )


def _error_text(err: BaseException | None, fallback: str) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split()) if err is not None else fallback


def _remove_debris(root: Path, tag: str) -> None:
    """What kills left behind: incomplete tags older than `tag` (never loadable, never
    rewritten) and marker temp files (in the root, and in `tag` when it was rewritten)."""
    for p in [*root.iterdir(), *(root / tag).iterdir()]:
        if TAG_RE.match(p.name) and p.name < tag and not (p / "COMPLETE").is_file():
            shutil.rmtree(p, ignore_errors=True)
        elif is_temp(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def save(
    engine: deepspeed.DeepSpeedEngine,
    root: Path,
    step: int,
    *,
    config_json: str,
    tokenizer_path: str | None,
    loader_state: dict[str, Any],
    keep: int,
    rank: int,
) -> str:
    """Write checkpoint `step` on every rank (collective). On a write failure on any rank
    (full disk, read-only or missing directory, I/O error) every rank raises
    CheckpointError, the half-written directory is removed and `latest` still names the
    previous complete checkpoint."""
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
            f"{_error_text(error, 'it failed on another rank')}; the previous checkpoint "
            f"({find_latest(root)}) is intact"
        ) from error
    # 2. DeepSpeed's files and this rank's state
    try:
        if _fault("enospc", step, rank):
            deepspeed_internals.inject_enospc(engine)
        with deepspeed_internals.RecordWriteErrors(engine) as writes:
            engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
        if writes.errors:
            raise writes.errors[0]
        state_path = path / f"rank{rank}_state.pt"
        with atomic_path(state_path) as tmp:
            torch.save({"rng": rng_state(), "loader": loader_state, "step": step}, tmp)
    except Exception as err:  # torch.save reports a full disk as RuntimeError, not OSError
        error = err
    if not all_agree(error is None):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {path} (rank {rank}: "
            f"{_error_text(error, 'its own files were written, a write failed on another rank')}); "
            f"removed it; the previous checkpoint ({find_latest(root)}) is intact"
        ) from error
    if _fault("kill", step, rank):
        os.kill(os.getpid(), 9)
    # 3. rank 0 marks it complete
    if rank == 0:
        try:
            (root / tag / "config.json").write_text(config_json)
            if tokenizer_path:
                shutil.copyfile(tokenizer_path, root / tag / "tokenizer.model")
            atomic_write_text(root / tag / "COMPLETE", f"{step}\n")
            atomic_write_text(root / "latest", tag + "\n")
            for old in complete_tags(root)[:-keep]:
                shutil.rmtree(root / old, ignore_errors=True)
            _remove_debris(root, tag)
        except OSError as err:
            error = err
            shutil.rmtree(path, ignore_errors=True)
    if not all_agree(error is None):
        raise CheckpointError(
            f"could not finish checkpoint {path}: {_error_text(error, 'rank 0 failed')}; "
            f"the previous checkpoint ({find_latest(root)}) is intact"
        )
    return tag


def load(engine: deepspeed.DeepSpeedEngine, root: Path, tag: str, rank: int) -> dict[str, Any]:
    """Load model/optimizer/scheduler into the engine; returns this rank's saved state."""
    state_path = root / tag / f"rank{rank}_state.pt"
    if not state_path.is_file():
        raise CheckpointError(
            f"{state_path} is missing: the checkpoint was written by a different number of ranks "
            "(convert it with DeepSpeed's ds_to_universal.py to resume on another world size)"
        )
    path, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {root / tag}")
    state = torch.load(state_path, weights_only=False)
    set_rng_state(state["rng"])
    return state
