"""Things applied to a model from outside it: activation checkpointing and compilation.

Checkpointing always uses torch's non-reentrant checkpoint: the reentrant variant (and
DeepSpeed's) fires a shared block's gradient hooks once per loop step and silently
drops gradients under ZeRO (see docs/zero3.md).
"""
from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .model.gpt import GPT
from .model.layers import Block

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
