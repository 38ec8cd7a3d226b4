"""Things applied to a model from outside it: compilation and activation checkpointing.

Checkpointing always uses torch's non-reentrant checkpoint (selective checkpointing too): the reentrant variant (and
DeepSpeed's) fires a shared block's gradient hooks once per loop step and silently
drops gradients under ZeRO (see docs/zero3.md).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from pretrain.config import ModelConfig
from pretrain.model.gpt import GPT
from pretrain.model.layers import Block

# explicit modes, cheapest recompute first; `auto` picks one of AUTO_MODES for the run
CHECKPOINT_MODES = ("off", "selective", "loop_step", "block")
AUTO = "auto"
AUTO_MODES = ("off", "selective", "loop_step")
# what `auto` may fill: device memory left after the engine is built (weights, optimizer state,
# buffers) minus headroom for the allocator's fragmentation and ZeRO's gather/reduce buckets
AUTO_MEMORY_SHARE = 0.8


def _saved_by_selective() -> list:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention (the
    FLOPs). Norms, activations, gates and residual adds are recomputed in the backward."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = [getattr(aten, n).default for n in names if hasattr(aten, n)]
    flash = getattr(torch.ops, "flash_attn", None)  # flash-attn's own op, when installed
    if flash is not None and hasattr(flash, "_flash_attn_forward"):
        ops.append(flash._flash_attn_forward.default)
    return ops


class _Kept:
    """A recorded op output and its version, to refuse one modified in place since."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor.detach(), tensor._version

    def get(self, func) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(f"selective checkpointing: an output of {func} was modified in place")
        return self.tensor


class _KeepOutputs(TorchDispatchMode):
    """Selective checkpointing's forward: records the outputs of `ops`, in call order."""

    def __init__(self, ops: frozenset, kept: dict):
        super().__init__()
        self.ops, self.kept = ops, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.kept.setdefault(func, []).append(tree_map_only(torch.Tensor, _Kept, out))
        return out


class _ReuseOutputs(TorchDispatchMode):
    """Selective checkpointing's recompute: returns the recorded outputs of `ops` in the same
    order, and runs every other op. Unlike torch's own selective checkpoint contexts it does
    not require the recompute to run exactly the forward's ops: ZeRO-3's parameter gathers
    allocate differently in a recompute (a parameter prefetched before the forward is
    gathered inside the recompute)."""

    def __init__(self, ops: frozenset, kept: dict):
        super().__init__()
        self.ops, self.kept = ops, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops and self.kept.get(func):
            return tree_map_only(_Kept, lambda k: k.get(func), self.kept[func].pop(0))
        return func(*args, **(kwargs or {}))


def _selective_contexts():
    ops, kept = frozenset(_saved_by_selective()), {}
    return _KeepOutputs(ops, kept), _ReuseOutputs(ops, kept)


def _checkpoint_forward(module: nn.Module, selective: bool = False) -> None:
    """Replace module.forward (on the instance) with a recomputed one; state dict keys stay.
    selective: keep the outputs of `_saved_by_selective` ops, recompute only the rest."""
    if getattr(module, "_grt_checkpointed", False):
        return
    inner = module.forward
    options = {"use_reentrant": False, **({"context_fn": _selective_contexts} if selective else {})}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, **options, **kwargs)

    module.forward = forward
    module._grt_checkpointed = True


def apply_activation_checkpointing(model: GPT, mode: str) -> GPT:
    """off: keep all activations; selective: per loop step and prelude/coda block, keep the
    matmul and attention outputs and recompute the cheap ops between them; loop_step:
    recompute each loop step (projection, core, gate) plus each prelude/coda block; block:
    recompute every transformer block. (`auto` is resolved first: `choose_checkpointing`.)"""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: accepted values are {', '.join(CHECKPOINT_MODES)}")
    if mode == "off":
        return model
    if mode in ("loop_step", "selective"):
        units = [*model.prelude, *model.coda] + ([model.loop] if model.loop is not None else [])
    else:
        units = [m for m in model.modules() if isinstance(m, Block)]
    for unit in units:
        _checkpoint_forward(unit, selective=mode == "selective")
    return model


def activation_bytes(cfg: ModelConfig, tokens: int, depth: int, mode: str, dtype_bytes: int) -> int:
    """Estimated peak activation memory of one training forward and backward of `tokens`
    tokens at loop depth `depth` under checkpointing `mode`: the tensors the forward keeps
    for the backward, plus the largest transient (the recompute of one unit, the logits'
    gradient). Per token and layer, counted from what autograd saves in `pretrain.model`
    (tests/test_checkpointing.py measures it): a block keeps 16 d-sized tensors (LN inputs
    and outputs, q/k/v, attention output, the MLP's 4d input and GELU output), 10 of them
    matmul or attention outputs; a GRT loop step adds 8 for its projection and gate (3 of
    them matmul outputs); the loss keeps the fp32 log-softmax over the vocabulary."""
    d, a, layout = cfg.d_model, dtype_bytes, cfg.parsed_layout
    small = 4 * (cfg.n_heads + 4) + (2 * d if cfg.dropout > 0 else 0)  # fp32 norm stats, attention logsumexp, masks
    block_full, block_selective = 16 * d * a + small, 10 * d * a + small
    extra_full, extra_selective = ((8, 3) if cfg.gate else (2, 1))
    step_full = layout.core * block_full + extra_full * d * a
    step_selective = layout.core * block_selective + extra_selective * d * a
    steps = depth if layout.looped else 0
    units = layout.prelude + layout.coda + steps  # the units loop_step and selective checkpoint
    unit_input = d * a
    if mode == "off":
        kept, recompute = (layout.prelude + layout.coda) * block_full + steps * step_full, 0
    elif mode == "block":
        kept = (layout.prelude + layout.coda + steps * layout.core) * unit_input + steps * extra_full * d * a
        recompute = block_full
    elif mode == "loop_step":
        kept, recompute = units * unit_input, max(block_full, step_full if steps else 0)
    else:  # selective: the recompute rebuilds one unit's cheap tensors
        kept = units * unit_input + (layout.prelude + layout.coda) * block_selective + steps * step_selective
        recompute = max(block_full - block_selective, step_full - step_selective if steps else 0)
    anchor = 2 * d * a if layout.looped else 0  # the anchor terms, computed once per forward
    head = 4 * cfg.vocab_size + 2 * d * a  # the fp32 log-softmax, the final norm's input and output
    head_grad = (4 + a) * cfg.padded_vocab_size  # the logits' gradient, in fp32 and in the model's dtype
    return int(tokens * (kept + anchor + head + max(recompute, head_grad)))


def modes_for_stage(zero_stage: int) -> tuple[str, ...]:
    """The modes a ZeRO stage can run. Selective checkpointing gave wrong gradients for the
    prelude and the embeddings under ZeRO-3 (tests/test_checkpointing.py; right under ZeRO-2
    and without DeepSpeed), so ZeRO-3 refuses it and its `auto` never picks it."""
    return tuple(m for m in CHECKPOINT_MODES if not (zero_stage == 3 and m == "selective"))


def choose_checkpointing(estimates: dict[str, int], free_bytes: int | None) -> str:
    """`auto`: the first mode of `estimates` (AUTO_MODES that the ZeRO stage allows, least
    recompute first) whose estimated activation memory fits AUTO_MEMORY_SHARE of the
    device's free memory; the last when none does. free_bytes None (the CPU): off."""
    if free_bytes is None:
        return "off"
    for mode, needed in estimates.items():
        if needed <= AUTO_MEMORY_SHARE * free_bytes:
            return mode
    return list(estimates)[-1]


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
