"""Things applied to a model from outside it: compilation and activation checkpointing.

Checkpointing always uses torch's non-reentrant checkpoint: the reentrant variant (and
DeepSpeed's) fires a shared block's gradient hooks once per loop step and silently
drops gradients under ZeRO (see docs/zero3.md).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pretrain.model.gpt import GPT
from pretrain.model.layers import Block

CHECKPOINT_MODES = ("off", "loop_step", "block")


def _checkpoint_forward(module: nn.Module) -> None:
    """Replace module.forward (on the instance) with a recomputed one; state dict keys stay."""
    if getattr(module, "_grt_checkpointed", False):
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._grt_checkpointed = True


def apply_activation_checkpointing(model: GPT, mode: str) -> GPT:
    """off: keep all activations; loop_step: recompute each loop step (projection, core,
    gate) plus each prelude/coda block; block: recompute every transformer block."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: accepted values are {', '.join(CHECKPOINT_MODES)}")
    if mode == "off":
        return model
    if mode == "loop_step" and model.loop is not None:
        _checkpoint_forward(model.loop)
        units = [*model.prelude, *model.coda]
    else:
        units = [m for m in model.modules() if isinstance(m, Block)]
    for unit in units:
        _checkpoint_forward(unit)
    return model


def apply_compile(model: GPT) -> GPT:
    """torch.compile each repeated unit's forward: the loop step (compiled once, reused by
    every loop step and every sampled depth, since the depth is a Python loop outside it)
    and each prelude/coda block. Only `forward` is compiled, so ZeRO-3's module hooks stay
    eager around it. Apply before activation checkpointing."""
    units = [*model.prelude, *model.coda]
    if model.loop is not None:
        units.append(model.loop)
    for unit in units:
        unit.forward = torch.compile(unit.forward)
    return model


def compile_stats() -> dict[str, int]:
    """Graphs compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"])}
