"""train.async_save: a checkpoint's files written by a background thread while training goes on.

At the save, every file DeepSpeed writes (and this rank's state file) is taken as a host copy of
its state: tensors detached and copied to CPU memory (from a GPU: one pinned, non-blocking copy per
tensor, then one wait for the copies), containers rebuilt around them. The training thread then
goes on; a thread writes the copies (each file atomically: a temporary renamed) and the checkpoint
is marked complete only when every rank's writes have finished (checkpoint/store.py), so a crash during
a background write leaves the previous checkpoint as the newest complete one.

Why not DeepSpeed's own writers (deepspeed/runtime/checkpoint_engine/, 0.19.8): the decoupled
engine fails to build without a model-parallel unit (`UniversalParallelInfo` has no `dp_rank`)
unless `writer.data_parallel` is set, needs the deepspeed launcher's CROSS_RANK/CROSS_SIZE
variables, switches the whole process to the `spawn` start method, and then refuses ZeRO's
optimizer state ("Cowardly refusing to serialize non-leaf tensor which requires_grad"); it also
skips every later save without a word once its helper process has died. Its fast writer writes
synchronously (the stall stays) through an async-I/O extension that needs building.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grt_common.files import atomic_path
from pretrain.training.engine.deepspeed_internals import save_file


def host_copy(obj: Any, pinned: bool, memo: dict[Any, Any] | None = None) -> Any:
    """`obj` with every tensor replaced by a detached copy in CPU memory (a view met twice, as two
    tensors too, is copied once), lists, tuples and dicts rebuilt as their own types, anything else
    deep-copied: what training does next cannot change it. `pinned`: page-locked copies, filled
    without waiting (the caller waits)."""
    memo = {} if memo is None else memo
    key: Any = id(obj)
    if isinstance(obj, torch.Tensor):  # one copy of one view, however many tensors show it (a tied weight)
        key = (obj.device, obj.dtype, obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.shape, obj.stride())
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if pinned and t.device.type != "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
        else:
            out = t.to("cpu", copy=True)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # its type (OrderedDict, defaultdict) with its keys' order
        out.update({k: host_copy(v, pinned, memo) for k, v in obj.items()})
    elif isinstance(obj, (list, tuple)):  # its type kept: torch.Size (DeepSpeed's param_shapes), a namedtuple
        items = [host_copy(v, pinned, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj)
    memo[key] = out
    return out


class BackgroundWrites:
    """One checkpoint's files on this rank: while DeepSpeed saves, its checkpoint engine (`save`
    takes a host copy and queues it; everything else is the engine's own), then written by a thread
    (`start`); `wait` gives the first error."""

    def __init__(self, ds_checkpoint_engine: Any) -> None:
        self.files: list[tuple[Path, Any]] = []
        self.error: BaseException | None = None
        self._own = ds_checkpoint_engine
        self._pinned = torch.cuda.is_available()
        self._thread: threading.Thread | None = None
        self.write_file: Callable[[Any, Path], None] = save_file  # or a test's fault (fault_injection.py)

    def __getattr__(self, name: str) -> Any:  # makedirs, load, create, commit, ...: DeepSpeed's engine's
        return getattr(self._own, name)

    def save(self, state_dict: Any, path: str) -> None:
        self.add(Path(path), state_dict)

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone views before `save`: the host copy is compact already

    def add(self, path: Path, state: Any) -> None:
        self.files.append((path, host_copy(state, self._pinned)))

    def start(self) -> None:
        """Write the copies in a thread (after the one wait for a GPU's copies)."""
        if self._pinned:
            torch.cuda.current_stream().synchronize()
        self._thread = threading.Thread(target=self._write, name="checkpoint-writes", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            for path, state in self.files:
                with atomic_path(path) as tmp:
                    self.write_file(state, tmp)
        except Exception as err:  # torch.save reports a full disk as RuntimeError
            self.error = err
        finally:
            self.files = []  # the copies' memory back once written

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        assert self._thread is not None, "start() first"
        self._thread.join()
        return self.error
