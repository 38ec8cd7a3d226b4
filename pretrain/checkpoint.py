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

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
TAG_RE = re.compile(r"^step(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
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


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ok on every rank (a failed write on one rank stops all)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0


def save(engine, root: Path, step: int, *, config_json: str, tokenizer_path: str | None,
         loader_state: dict, keep: int, rank: int) -> str:
    tag = tag_for(step)
    error = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
        state_path = root / tag / f"rank{rank}_state.pt"
        tmp = state_path.with_suffix(".tmp")
        torch.save({"rng": rng_state(), "loader": loader_state, "step": step}, tmp)
        os.replace(tmp, state_path)
    except OSError as err:
        error = err
    if not _all_ok(error is None):
        raise CheckpointError(f"could not write checkpoint {root / tag}: {error or 'another rank failed to write'}; "
                              f"the previous checkpoint ({find_latest(root)}) is intact") from error
    if rank == 0:
        try:
            (root / tag / "config.json").write_text(config_json)
            if tokenizer_path:
                shutil.copyfile(tokenizer_path, root / tag / "tokenizer.model")
            atomic_write_text(root / tag / "COMPLETE", f"{step}\n")
            atomic_write_text(root / "latest", tag + "\n")
            for old in complete_tags(root)[:-keep]:
                shutil.rmtree(root / old, ignore_errors=True)
        except OSError as err:
            error = err
    if not _all_ok(error is None):
        raise CheckpointError(f"could not finish checkpoint {root / tag}: {error or 'rank 0 failed'}; "
                              f"the previous checkpoint ({find_latest(root)}) is intact")
    return tag


def load(engine, root: Path, tag: str, rank: int) -> dict:
    """Load model/optimizer/scheduler into the engine; returns this rank's saved state."""
    state_path = root / tag / f"rank{rank}_state.pt"
    if not state_path.is_file():
        raise CheckpointError(f"{state_path} is missing: the checkpoint was written by a different number of ranks "
                              "(convert it with DeepSpeed's ds_to_universal.py to resume on another world size)")
    path, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {root / tag}")
    state = torch.load(state_path, weights_only=False)
    set_rng_state(state["rng"])
    return state
