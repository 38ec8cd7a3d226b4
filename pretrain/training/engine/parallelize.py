"""Things applied to a model from outside it: compilation and activation checkpointing.

Checkpointing always uses torch's non-reentrant checkpoint (selective checkpointing too): the reentrant variant (and
DeepSpeed's) fires a shared block's gradient hooks once per loop step and silently
drops gradients under ZeRO (see docs/zero3.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from grt_common.errors import ConfigError
from pretrain.model.gpt import GPT
from pretrain.model.layers import Block
from pretrain.model.loss import chunk_tokens
from pretrain.model_config import ModelConfig
from pretrain.runs.train_config import AUTO, CHECKPOINT_MODES
from pretrain.variants import get_variant

# `auto` (of CHECKPOINT_MODES, the run config's accepted values) picks one of AUTO_MODES for the run
AUTO_MODES = ("off", "selective", "loop_step")
# what `auto` may fill: device memory left after the engine is built (weights, optimizer state,
# buffers) minus headroom for the allocator's fragmentation and ZeRO's gather/reduce buckets
AUTO_MEMORY_SHARE = 0.8


def _saved_by_selective() -> list:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention (the
    FLOPs). Norms, activations, gates and residual adds are recomputed in the backward."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    ops = [getattr(aten, n).default for n in names if hasattr(aten, n)]
    flash = getattr(torch.ops, "flash_attn", None)  # flash-attn's own op, when installed
    if flash is not None and hasattr(flash, "_flash_attn_forward"):
        ops.append(flash._flash_attn_forward.default)
    return ops


def _selective_contexts() -> tuple[Any, Any]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_saved_by_selective())


def _checkpoint_forward(module: nn.Module, selective: bool = False) -> None:
    """Replace module.forward (on the instance) with a recomputed one; state dict keys stay.
    selective: keep the outputs of `_saved_by_selective` ops, recompute only the rest."""
    if getattr(module, "_grt_checkpointed", False):
        return
    inner = module.forward
    options: dict[str, Any] = {"use_reentrant": False, **({"context_fn": _selective_contexts} if selective else {})}

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, **options, **kwargs)

    module.forward = forward
    module._grt_checkpointed = True  # type: ignore[assignment]  # a flag on the instance, beside its new forward


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
    (tests/model/test_checkpointing.py measures it): a block keeps 16 d-sized tensors (LN inputs
    and outputs, q/k/v, attention output, the MLP's 4d input and GELU output), 10 of them
    matmul or attention outputs; a GRT loop step adds 8 for its projection and gate (3 of
    them matmul outputs); the training loss (`return_logits=False`, pretrain/model/loss.py) keeps
    the hidden states' gradient and, once, a chunk of fp32 logits; Ouro, which scores every
    step's logits, keeps them and their fp32 log-softmax. Each variant's own terms (its core
    blocks', the steps it runs without autograd or on a share of the tokens, what it keeps outside
    the loop steps, its decodes) come from its Variant (pretrain/variants/)."""
    d, a, layout, variant = cfg.d_model, dtype_bytes, cfg.parsed_layout, get_variant(cfg.variant)
    small = 4 * (cfg.n_heads + 4) + (2 * d if cfg.dropout > 0 else 0)  # fp32 norm stats, attention logsumexp, masks
    block_full, block_selective = 16 * d * a + small, 10 * d * a + small
    core_extra_full, core_extra_selective = variant.block_extra_bytes(cfg, a)
    core_full, core_selective = block_full + core_extra_full, block_selective + core_extra_selective
    extra_full, extra_selective = (8, 3) if cfg.gate else (2, 1)
    step_full = layout.core * core_full + extra_full * d * a
    step_selective = layout.core * core_selective + extra_selective * d * a
    # the steps run without autograd keep nothing; each kept step runs on its share of the tokens
    steps = depth - variant.no_grad_steps(cfg, depth) if layout.looped else 0
    shares = variant.step_shares(cfg, steps)
    loop_tokens = sum(shares)
    outside = variant.outside_loop_bytes(cfg, shares, a)
    # a model that decodes every loop step in training (Ouro) runs coda, final norm and head once per
    # step, and each step's logits live until the loss; no checkpointing mode removes them
    decodes = variant.training_decodes(steps)
    ends = layout.prelude + decodes * layout.coda  # prelude and coda blocks run
    units = ends + loop_tokens  # the units loop_step and selective checkpoint (their inputs)
    unit_input = d * a
    if mode == "off":
        kept, recompute = ends * block_full + loop_tokens * step_full, 0
    elif mode == "block":
        kept = (ends + loop_tokens * layout.core) * unit_input + loop_tokens * extra_full * d * a
        recompute = block_full
    elif mode == "loop_step":
        kept, recompute = units * unit_input, max(block_full, step_full if steps else 0)
    else:  # selective: the recompute rebuilds one unit's cheap tensors
        kept = units * unit_input + ends * block_selective + loop_tokens * step_selective
        recompute = max(block_full - block_selective, step_full - step_selective if steps else 0)
    anchor = 2 * d * a if layout.looped else 0  # the anchor terms, computed once per forward
    # a GRT state kept in fp32 under bf16 weights (ModelConfig.state_dtype): each step's state input
    state = (4 - a) * d * (2 if mode == "off" else 1) * loop_tokens if cfg.gate and cfg.state_dtype == "fp32" else 0
    if not variant.decodes_every_step:
        # the training loss straight from the hidden states (pretrain/model/loss.py): per token the final
        # norm's input and output and the hidden states' gradient; once, one chunk's fp32 logits (and their
        # copy in the model's dtype; the least chunk: on CUDA a larger one takes a share of what is left
        # free) and the head weight's fp32 gradient, with the next chunk's sum the GEMM writes
        chunk, copy = min(tokens, chunk_tokens(cfg.vocab_size)), (a if a != 4 else 0)
        loss_once = chunk * cfg.vocab_size * (4 + copy) + 8 * cfg.padded_vocab_size * d
        return int(tokens * (kept + outside + anchor + state + 3 * d * a) + max(tokens * recompute, loss_once))
    # every step's logits scored (Ouro): materialised, with their fp32 log-softmax and gradient
    head = 4 * cfg.vocab_size + 2 * d * a  # the fp32 log-softmax, the final norm's input and output
    held_logits = a * cfg.padded_vocab_size  # a step's logits, kept until the loss
    head_grad = (4 + a) * cfg.padded_vocab_size  # the logits' gradient, in fp32 and in the model's dtype
    return int(tokens * (kept + outside + anchor + state + decodes * (head + held_logits) + max(recompute, head_grad)))


def modes_for_stage(zero_stage: int) -> tuple[str, ...]:
    """The modes a ZeRO stage can run. Under ZeRO-3, torch's selective checkpointing gives
    wrong gradients upstream of the first checkpointed unit it recomputes in the backward
    (measured on torch 2.13 with DeepSpeed 0.19.8: the prelude, embeddings and loop, also
    with every parameter persistent, and also with DeepSpeed's ZeRO-3 linear,
    `zero3_linear_wrap`, alone without any engine), and its recompute does not repeat the
    forward's ops once ZeRO-3 gathers a parameter there; so ZeRO-3 refuses it and its
    `auto` never picks it. ZeRO-0/1/2 and plain PyTorch match the reference."""
    return tuple(m for m in CHECKPOINT_MODES if not (zero_stage == 3 and m == "selective"))


def check_checkpointing(mode: str, zero_stage: int) -> None:
    """Refuse a mode the ZeRO stage cannot run (one line): `grt launch` calls it before any
    rank starts, and the Trainer again for runs started by deepspeed or torchrun directly."""
    if mode not in (AUTO, *modes_for_stage(zero_stage)):
        raise ConfigError(
            f"train.activation_checkpointing={mode!r} is refused under ZeRO stage {zero_stage} "
            f"(wrong gradients, docs/performance.md): use {', '.join(modes_for_stage(zero_stage))} "
            "or auto, or ZeRO-2"
        )


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
    eager around it. The gate update is the eager formula inside the trace (kernels/gate.py
    `fused_path`), fused by the compiler. `checkpoint_and_compile` applies it in the right order."""
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


def checkpoint_and_compile(model: GPT, mode: str, compile: bool) -> GPT:
    """Activation checkpointing `mode`, then (compile) torch.compile, in the order that keeps each
    one's meaning:
    - selective: compiled around the checkpoint, so that the compiler traces it and keeps what
      its list of kept ops names (a checkpoint around a compiled forward sees one opaque call and
      its list cannot apply inside it). The checkpoint wrapper is one function for every unit, so
      its compiled code holds one graph per unit signature (3 on a GRT);
    - the other modes recompute whole units: each unit's own forward is compiled inside its
      checkpoint, one graph per unit type (2 on a GRT)."""
    if compile and mode != "selective":
        apply_compile(model)
    apply_activation_checkpointing(model, mode)
    if compile and mode == "selective":
        apply_compile(model)
    return model
