"""The tests' fault injections: the one module that reads the GRT_INJECT_* variables (docs/reliability.md,
"Fault injection"), once, as `grt train` starts (`Faults.from_environment`), and the one that installs
them, from outside the code they break: through the seams that code leaves (a save's two points in
checkpoint/store.py, the background writes' file writer, DeepSpeed's file writer through
engine/deepspeed_internals.py, run_lock.py's flock) and hooks on the engine and a wrapper of the
loader. A run without them installs nothing.

GRT_INJECT_NAN_STEPS=3,4 makes the loss of the first micro-batch tried at steps 3 and 4 NaN (the
retry with the next micro-batch is clean); a step listed k times poisons its first k tries (5,5,5:
three bad micro-batches in a row). GRT_INJECT_LOSS_FACTOR=20 multiplies those losses by 20 instead
(a finite loss spike, its gradients scaled with it).
GRT_INJECT_DELAY=forward@1=0.3 sleeps 0.3 s before each forward of rank 1; data@0=0.2 before each
batch rank 0 takes from the loader.
GRT_INJECT_CKPT_FAULT=<kind>@<step>[@<rank>] (rank 0 by default), at the save of that step on that
rank: `kill`, the rank SIGKILLs itself once every rank has written its files, before COMPLETE;
`enospc`, its file writes fail as on a full disk (DeepSpeed's, or train.async_save's thread's).
GRT_INJECT_LOCK_FAULT=enolck makes every flock on a run directory fail with ENOLCK, as on a mount
without locks.

Installing patches module attributes with `patch` (setattr: for the life of the process; a test in
its own process passes pytest's monkeypatch.setattr, which undoes them).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from pretrain.training.checkpoint import store
from pretrain.training.engine import deepspeed_internals
from pretrain.training.start import run_lock

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine

    from pretrain.model.gpt import ModelOutput
    from pretrain.training.checkpoint.async_save import BackgroundWrites
    from pretrain.training.data import RunData

Patch = Callable[[Any, str, Any], None]  # setattr, or pytest's monkeypatch.setattr


class Run(Protocol):
    """What the faults of a built run act on (the Trainer's)."""

    engine: DeepSpeedEngine
    rank: int
    step: int  # the step being trained, 0-based
    data: RunData


@dataclass(frozen=True)
class SaveFault:
    """GRT_INJECT_CKPT_FAULT: `kind` (kill | enospc) at the save of `step` on `rank`."""

    kind: str
    step: int
    rank: int

    def writing(self, engine: DeepSpeedEngine, step: int, rank: int, writes: BackgroundWrites | None) -> None:
        if (self.kind, self.step, self.rank) == ("enospc", step, rank):
            if writes is None:
                deepspeed_internals.write_files_with(engine, write_as_full_disk)
            else:
                writes.write_file = write_as_full_disk

    def completing(self, step: int, rank: int) -> None:
        if (self.kind, self.step, self.rank) == ("kill", step, rank):
            os.kill(os.getpid(), signal.SIGKILL)


def write_as_full_disk(state_dict: object, path: str | os.PathLike[str]) -> NoReturn:
    """A file write that fails as on a full disk: part of the file written, then ENOSPC (its
    parameters named as DeepSpeed's checkpoint engine calls them)."""
    Path(path).write_bytes(b"\0" * 100)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def refuse_locks(_fd: int, _op: int) -> NoReturn:
    """flock on a mount without a lock manager."""
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


@dataclass(frozen=True)
class Faults:
    """The faults a test asked this process for (the module doc); the default: none."""

    nan_steps: tuple[int, ...] = ()  # 0-based; a step k times: its first k tries
    loss_factor: float = math.nan  # what their losses are multiplied by
    delays: tuple[tuple[str, int, float], ...] = ()  # (forward | data, rank, seconds)
    save: SaveFault | None = None
    locks_refused: bool = False

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> Faults:
        delays = []
        for item in filter(None, (part.strip() for part in env.get("GRT_INJECT_DELAY", "").split(","))):
            where, rest = item.split("@")
            rank, seconds = rest.split("=")
            delays.append((where, int(rank), float(seconds)))
        save = None
        if spec := env.get("GRT_INJECT_CKPT_FAULT", ""):
            kind, step, *on_rank = spec.split("@")
            save = SaveFault(kind, int(step), int(on_rank[0]) if on_rank else 0)
        return cls(
            nan_steps=tuple(int(s) - 1 for s in env.get("GRT_INJECT_NAN_STEPS", "").split(",") if s.strip()),
            loss_factor=float(env.get("GRT_INJECT_LOSS_FACTOR", "nan")),
            delays=tuple(delays),
            save=save,
            locks_refused=env.get("GRT_INJECT_LOCK_FAULT") == "enolck",
        )

    def install_at_start(self, patch: Patch = setattr) -> None:
        """The faults of the start and of every save: before the start's plan probes the run lock."""
        if self.locks_refused:
            patch(run_lock, "flock", refuse_locks)
        if self.save is not None:
            patch(store, "on_writing", self.save.writing)
            patch(store, "on_completing", self.save.completing)

    def install_in(self, run: Run, patch: Patch = setattr) -> None:
        """The faults of the steps, on a built run before its first step: NaN losses, delays."""
        if self.nan_steps:
            run.engine.register_forward_hook(PoisonedLosses(run, self.nan_steps, self.loss_factor))
        seconds = {where: s for where, rank, s in self.delays if rank == run.rank}
        if forward := seconds.get("forward"):
            run.engine.register_forward_pre_hook(lambda *_: time.sleep(forward))
        if data := seconds.get("data"):
            patch(run.data, "loader", LateBatches(run.data.loader, data))


class PoisonedLosses:
    """A forward hook on the engine: the loss of each training micro-batch tried at a listed step
    is NaN (or `factor` times itself); validation and tasks (the model in eval mode) are left alone."""

    def __init__(self, run: Run, steps: tuple[int, ...], factor: float) -> None:
        self.run, self.remaining, self.factor = run, Counter(steps), factor

    def __call__(self, _engine: torch.nn.Module, _args: tuple, out: ModelOutput) -> ModelOutput | None:
        step = self.run.step
        if not self.run.engine.module.training or out.loss is None or self.remaining[step] <= 0:
            return None
        self.remaining[step] -= 1
        return out._replace(loss=out.loss * self.factor)


class LateBatches:
    """The loader, each of its batches `seconds` late (a data-starved rank); the rest is the loader's."""

    def __init__(self, loader: Any, seconds: float) -> None:
        self.loader, self.seconds = loader, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            time.sleep(self.seconds)
            yield batch
