"""ZeRO-3 and a looped core: keep the shared core gathered, and count what ZeRO-3 does.

A loop step calls the same core R times per forward, and R changes every step. ZeRO-3
would all-gather the core's parameters on every call and, because the module order
changes with R, invalidate its recorded trace (which disables prefetching). Pinning the
core marks its parameters persistent: they are all-gathered once after each optimizer
step and stay resident through every loop step, forward and backward, at the cost of
one full copy of the core per rank (small: the core is the model's few unique blocks).
The optimizer still shards their fp32 master weights and moments, and gradients are
still reduce-scattered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Zero3Counters:
    gathers: int = 0              # parameters all-gathered (a parameter fetched twice counts twice)
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

    gather_name = "_PartitionedParameterCoordinator__all_gather_params"
    original_gather, original_invalidate = getattr(C, gather_name), C._invalidate_trace

    def counted_gather(self, params, forward):
        COUNTERS.gathers += len(params)
        return original_gather(self, params, forward)

    def counted_invalidate(self):
        COUNTERS.trace_invalidations += 1
        return original_invalidate(self)

    setattr(C, gather_name, counted_gather)
    C._invalidate_trace = counted_invalidate
    _installed = True
    return COUNTERS


# A module id no real module has: while it is in a parameter's `ds_active_sub_modules`,
# DeepSpeed's coordinator never partitions that parameter. `ds_persist` alone is not
# enough: while the trace is recording or was just invalidated (every time the depth
# changes), the coordinator releases persistent parameters too.
_PIN_ID = -0x6A7


def pin_parameters(engine, module: torch.nn.Module) -> int:
    """Keep `module`'s ZeRO-3 parameters gathered for the whole run; returns how many.
    `engine.step` re-gathers them after each optimizer step (which partitions them)."""
    persistent = engine.optimizer.parameter_offload.persistent_parameters
    known = {id(p) for p in persistent}
    params = list(module.parameters())
    new = [p for p in params if id(p) not in known]
    for p in new:
        p.ds_persist = True
    persistent.extend(new)
    engine.grt_pinned_parameters = params
    hold_pinned(engine)
    step = engine.step

    def step_and_hold(*args, **kwargs):
        result = step(*args, **kwargs)
        hold_pinned(engine)
        return result

    engine.step = step_and_hold
    return len(params)


def hold_pinned(engine) -> None:
    """Re-gather pinned parameters the step partitioned and mark them in use again."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = getattr(engine, "grt_pinned_parameters", ())
    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        COUNTERS.gathers += len(missing)
        missing[0].all_gather(missing)
    for p in params:
        p.ds_active_sub_modules.add(_PIN_ID)
