"""Every private DeepSpeed name this project touches, in one place, checked at start-up.

DeepSpeed renames its internals between releases; `check()` runs before any engine is
built and fails with one line naming the installed version when a name is gone (setup.py
pins the tested range). What is patched, and why:

- ZeRO-3 and a looped core: pin the shared core and count what ZeRO-3 does. A loop step
  calls the same core R times per forward, and R changes every step. ZeRO-3 would
  all-gather the core's parameters on every call and, because the module order changes
  with R, invalidate its recorded trace (which disables prefetching). Pinning the core
  marks its parameters persistent: they are all-gathered once after each optimizer step
  and stay resident through every loop step, forward and backward, at the cost of one
  full copy of the core per rank (small: the core is the model's few unique blocks). The
  optimizer still shards their fp32 master weights and moments, and gradients are still
  reduce-scattered. With nothing left for them to gather or release, ZeRO-3's module
  hooks are then removed from the core: its R calls leave the recorded module order, which
  for the GRT, Huginn and RRT no longer depends on R (Ouro's per-step decode and MoR's
  per-step routers are outside the core). A re-recorded order costs hundreds of host syncs,
  and the hooks' compiler-disabled calls split a compiled loop step into many graphs. The
  coordinator's gather and trace invalidation are wrapped to count.
- ZeRO-1/2's gradient clipping without a host read (`install_device_clip`): DeepSpeed turns
  an invalid norm into an infinite one with `bool()` of a device tensor (a sync every step, the
  last one left in its bf16 step once `bf16.check_grad_overflow` is off); the same formula with
  `torch.where` keeps it on the device.
- Checkpoints: DeepSpeed's file writes record their errors instead of raising, so that a
  rank whose disk is full still joins the collectives the save makes (checkpoint/store.py).
- Warnings: torch's FutureWarnings about the collectives DeepSpeed calls, several per step.
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from grt_common.errors import ConfigError

if TYPE_CHECKING:
    import deepspeed

TESTED = "deepspeed>=0.19.8,<0.20"  # setup.py pins the same range
_COORDINATOR = ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator")
_ZERO12 = ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")
_GATHER = "_PartitionedParameterCoordinator__all_gather_params"
_NAMES = [
    (_COORDINATOR, _GATHER),
    (_COORDINATOR, "_invalidate_trace"),
    (("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus"), "NOT_AVAILABLE"),
    (("deepspeed.utils.tensor_fragment", "tensor_fragment"), "get_lp_grad_fragment"),
    (("deepspeed.utils.tensor_fragment", "tensor_fragment"), "lp_fragment_address"),
    (_ZERO12, "unscale_and_clip_grads"),
]


def check() -> None:
    """Fail with one line if a DeepSpeed name patched below is missing (once, at start-up)."""
    import importlib

    missing = []
    for (module, cls), name in _NAMES:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{cls}")
            continue
        if not (hasattr(owner, name) or name in getattr(owner, "__dataclass_fields__", {})):
            missing.append(f"{cls}.{name}")
    _refuse(missing)


_OFFLOAD_NAMES = ("persistent_parameters", "forward_hooks", "backward_hooks")


def check_engine(engine: deepspeed.DeepSpeedEngine) -> None:
    """The same check for the names that exist only on a built engine."""
    missing = [] if hasattr(getattr(engine, "checkpoint_engine", None), "save") else ["engine.checkpoint_engine.save"]
    if engine.zero_optimization_stage() == 3:
        offload = getattr(engine.optimizer, "parameter_offload", None)
        missing += [f"optimizer.parameter_offload.{name}" for name in _OFFLOAD_NAMES if not hasattr(offload, name)]
    _refuse(missing)


def _refuse(missing: list[str]) -> None:
    import deepspeed

    if missing:
        raise ConfigError(
            f"DeepSpeed {deepspeed.__version__} lacks {', '.join(missing)}, which "
            f"pretrain/training/engine/deepspeed_internals.py patches; install the tested range: "
            f"pip install '{TESTED}'"
        )


def quiet_deprecated_collectives() -> None:
    """Hide torch's FutureWarnings about the collectives DeepSpeed calls (reduce_scatter_tensor,
    all_gather_into_tensor, ...: several lines per step); every other warning still shows."""
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor|"
        r"_all_gather_base|_reduce_scatter_base)` is deprecated",
    )


def install_device_clip() -> None:
    """ZeRO-1/2's `unscale_and_clip_grads` with the clip factor computed on the device (once per
    process): DeepSpeed 0.19's formula, `((norm / loss_scale) + 1e-6) / clip` clamped to at least 1,
    an invalid norm (not finite, or DeepSpeed's -1 for one) taken as infinite, as DeepSpeed does,
    but chosen by `torch.where` instead of `bool()` on the host."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z

    if getattr(Z.unscale_and_clip_grads, "grt_device_clip", False):
        return

    def unscale_and_clip_grads(self: Any, grad_groups_flat: list[Any], total_norm: Any) -> None:
        if self.clip_grad == 0.0 and self.loss_scale == 1.0:
            return
        combined_scale: Any = self.loss_scale
        if self.clip_grad > 0.0:
            norm = torch.as_tensor(total_norm, dtype=torch.float, device=self.device)
            norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.inf)
            combined_scale = torch.clamp(((norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0) * self.loss_scale
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(1.0 / combined_scale)

    unscale_and_clip_grads.grt_device_clip = True  # type: ignore[attr-defined]  # marks the patch installed
    unscale_and_clip_grads.grt_replaced = Z.unscale_and_clip_grads  # type: ignore[attr-defined]  # what it replaces
    Z.unscale_and_clip_grads = unscale_and_clip_grads


@dataclass
class Zero3Counters:
    gathers: int = 0  # parameters all-gathered (a parameter fetched twice counts twice)
    trace_invalidations: int = 0  # times ZeRO-3 threw away its recorded module order


COUNTERS = Zero3Counters()
_installed = False


def install_counters() -> Zero3Counters:
    """Wrap DeepSpeed's parameter coordinator (once per process) to count gathers and
    trace invalidations. DeepSpeed prints the latter without a logger; see docs/zero3.md."""
    global _installed
    if _installed:
        return COUNTERS
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

    original_gather, original_invalidate = getattr(C, _GATHER), C._invalidate_trace

    def counted_gather(self: C, params: Collection[torch.nn.Parameter], forward: bool) -> None:
        COUNTERS.gathers += len(params)
        return original_gather(self, params, forward)

    def counted_invalidate(self: C) -> None:
        COUNTERS.trace_invalidations += 1
        return original_invalidate(self)

    setattr(C, _GATHER, counted_gather)
    C._invalidate_trace = counted_invalidate
    _installed = True
    return COUNTERS


# A module id no real module has: while it is in a parameter's `ds_active_sub_modules`,
# DeepSpeed's coordinator never partitions that parameter. `ds_persist` alone is not
# enough: while the trace is recording or was just invalidated (every time the depth
# changes), the coordinator releases persistent parameters too.
_PIN_ID = -0x6A7


def pin_parameters(engine: deepspeed.DeepSpeedEngine, module: torch.nn.Module) -> int:
    """Keep `module`'s ZeRO-3 parameters gathered for the whole run; returns how many.
    They are re-gathered and re-marked after each optimizer step and checkpoint save or
    load, which partition them or clear their in-use marks."""
    persistent = engine.optimizer.parameter_offload.persistent_parameters
    known = {id(p) for p in persistent}
    params = list(module.parameters())
    new = [p for p in params if id(p) not in known]
    for p in new:
        p.ds_persist = True  # type: ignore[attr-defined]  # DeepSpeed's dynamic ZeRO-3 attribute
    persistent.extend(new)
    engine.grt_pinned_parameters = params
    hold_pinned(engine)
    _remove_module_hooks(engine, module)
    for name in ("step", "save_checkpoint", "load_checkpoint"):  # each partitions or releases them
        _hold_after(engine, name)
    return len(params)


def _hold_after(engine: deepspeed.DeepSpeedEngine, name: str) -> None:
    call = getattr(engine, name)

    def call_and_hold(*args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)
        hold_pinned(engine)
        return result

    setattr(engine, name, call_and_hold)


HOOKS_PER_MODULE = 4  # DeepSpeed 0.19: pre- and post-forward, pre- and post-backward


def _remove_module_hooks(engine: deepspeed.DeepSpeedEngine, module: torch.nn.Module) -> None:
    """Remove ZeRO-3's forward and backward module hooks from `module` and its submodules.
    Only for pinned modules: the hooks gather and release parameters
    (pinned ones stay gathered) and record the module order (which then leaves out every
    call of `module`). Gradients are reduced by per-parameter hooks, which stay."""
    offload = engine.optimizer.parameter_offload
    inside = {id(hooks) for m in module.modules() for hooks in (m._forward_pre_hooks, m._forward_hooks)}
    removed = 0
    for handles in (offload.forward_hooks, offload.backward_hooks):
        kept = []
        for handle in handles:
            if id(handle.hooks_dict_ref()) in inside:
                handle.remove()
                removed += 1
            else:
                kept.append(handle)
        handles[:] = kept
    modules = len(list(module.modules()))
    if (
        removed != HOOKS_PER_MODULE * modules
    ):  # a DeepSpeed that hooks modules otherwise: the speed-up would be lost silently
        import deepspeed

        raise ConfigError(
            f"DeepSpeed {deepspeed.__version__}: found {removed} ZeRO-3 module hooks on the {modules} "
            f"pinned modules, not {HOOKS_PER_MODULE} each; pretrain/training/engine/deepspeed_internals.py "
            f"removes them: install the tested range: pip install '{TESTED}'"
        )


def hold_pinned(engine: deepspeed.DeepSpeedEngine) -> None:
    """Re-gather pinned parameters the step partitioned and mark them in use again."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = getattr(engine, "grt_pinned_parameters", ())
    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        COUNTERS.gathers += len(missing)
        missing[0].all_gather(missing)
    for p in params:
        p.ds_active_sub_modules.add(_PIN_ID)


def write_files_with(engine: deepspeed.DeepSpeedEngine, save: Callable[[Any, str], None]) -> None:
    """DeepSpeed's checkpoint file writes of `engine` go through `save(state_dict, path)` from now on:
    the seam of the tests' write faults (fault_injection.py)."""
    engine.checkpoint_engine.save = save


FULL_BELOW = 1 << 20  # bytes left to this process on a file system where a write failed: a full disk


def disk_full(err: BaseException, path: str | os.PathLike[str] | None) -> BaseException:
    """What a failed write of checkpoint file `path` was: where torch.save failed on a full disk (it
    says "enforce fail at inline_container.cc: unexpected pos", not ENOSPC), an OSError(ENOSPC)
    naming the file and its file system's free space, so that every save, synchronous or not, says
    which disk is full in one line (grt_common/errors.py); `err` itself otherwise. Asked at the failure,
    before a partial file is removed."""
    if isinstance(err, OSError) or path is None:
        return err
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.statvfs(folder)
    except OSError:
        return err
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize  # root may use the reserve
    if free >= FULL_BELOW:
        return err
    why = f"{os.strerror(errno.ENOSPC)}: the file system of {folder} has {free} bytes free"
    return OSError(errno.ENOSPC, why, os.fspath(path))


def save_file(state: Any, path: str | os.PathLike[str]) -> None:
    """torch.save of one checkpoint file, a full disk raised as one (`disk_full`): the rank's state
    file (checkpoint/store.py) and train.async_save's thread (async_save.py) write through it;
    DeepSpeed's own writes are translated by `RecordWriteErrors`."""
    try:
        torch.save(state, path)
    except Exception as err:  # torch.save reports a full disk as RuntimeError
        said = disk_full(err, path)
        if said is err:
            raise
        raise said from err


class RecordWriteErrors:
    """For one save: DeepSpeed's file writes (checkpoint_engine.save, the recovery script
    copy) record their errors instead of raising. A rank whose write fails must still join
    every collective that save_checkpoint makes after the writes (ZeRO-3 re-gathers its
    persistent parameters, a barrier ends it): raising out of it would leave the other
    ranks waiting until dist_timeout_s. The ranks then agree that the checkpoint failed."""

    def __init__(self, engine: deepspeed.DeepSpeedEngine) -> None:
        self.errors: list[BaseException] = []
        self.targets: list[tuple[Any, str]] = [(engine.checkpoint_engine, "save")]
        if hasattr(engine, "_copy_recovery_script"):
            self.targets.append((engine, "_copy_recovery_script"))
        self.saved: list[tuple[Any, str, bool, Any]] = []  # (object, attribute, own attribute?, its value)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.errors:
                return None  # the checkpoint is lost already: write nothing more
            try:
                return fn(*args, **kwargs)
            except Exception as err:  # torch.save reports a full disk as RuntimeError
                path = args[1] if len(args) > 1 else kwargs.get("path")  # save(state_dict, path)
                self.errors.append(disk_full(err, path) if isinstance(path, (str, os.PathLike)) else err)
                return None

        return guarded

    def __enter__(self) -> RecordWriteErrors:
        for obj, name in self.targets:
            self.saved.append((obj, name, name in vars(obj), vars(obj).get(name)))
            setattr(obj, name, self._wrap(getattr(obj, name)))
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        for obj, name, had, value in self.saved:
            if had:
                setattr(obj, name, value)
            else:
                delattr(obj, name)
        return False


def local_shares(p: torch.nn.Parameter) -> tuple[torch.Tensor, bool, torch.Tensor | None, bool]:
    """(param, partitioned?, gradient, partitioned?): this rank's share of p and of its
    reduced gradient, with no collective. A partitioned share summed (in squares) over the
    ranks makes the whole; a replicated one is the whole on every rank. ZeRO-3: both are
    the rank's partition. ZeRO-1/2 (and the bf16 optimizer): the full parameter and the
    gradient fragment this rank's optimizer owns. ZeRO-0: both full. Valid after the last
    backward of an optimizer step and before `engine.step()`, which clears the gradients."""
    if hasattr(p, "ds_id"):
        from deepspeed.utils import safe_get_local_grad

        return p.ds_tensor, True, safe_get_local_grad(p), True  # type: ignore[attr-defined]  # set by ZeRO-3
    if not hasattr(p, "_hp_mapping"):
        return p.data, False, p.grad, False
    mapping = p._hp_mapping
    if mapping is None:  # no part of p is in this rank's optimizer partition
        return p.data, False, None, True
    index = p._index_in_param_group  # type: ignore[attr-defined]  # set by DeepSpeed's optimizer
    grad = mapping.get_lp_grad_fragment(index).flatten()
    address = mapping.lp_fragment_address
    if grad.numel() == p.numel():  # the bf16 optimizer keeps a full accumulation buffer: this rank's fragment
        grad = grad.narrow(0, address.start, address.numel)
    return p.data, False, grad, True
