"""Parameter and FLOP accounting for every variant: MFU, `grt presets`, `grt compare`, the benches.

FLOPs count the matmuls (2 per multiply-add), as PyTorch's FLOP counter does; elementwise
work (norms, activations, the gate's sigmoid) is left out. tests/test_model.py checks the
counts against torch.utils.flop_counter for every variant.
"""

from __future__ import annotations

import torch

from pretrain.config import ModelConfig


def _block_flops(cfg: ModelConfig, seq_len: int, share: float = 1.0) -> float:
    """One transformer block per token: the matmuls (qkv 6 d^2, attention out 2 d^2, MLP
    2 * 2 * mlp_ratio d^2) plus the attention scores and values over the keys it sees,
    4 S d at full (unmasked) length; `share` of the sequence for MoR's gathered tokens."""
    d = cfg.d_model
    return (8 + 4 * cfg.mlp_ratio) * d * d + 4 * share * seq_len * d


def _loop_flops(cfg: ModelConfig, seq_len: int, r: int, executed: bool) -> float:
    """What r loop steps add per token, by variant."""
    layout, d = cfg.parsed_layout, cfg.d_model
    core = layout.core * _block_flops(cfg, seq_len)
    if cfg.variant in ("grt", "huginn"):
        # the projection W_proj [s; e] (4 d^2) and the gate MLP (6 d^2: 2d -> d -> d) of each step
        extra = (4 * d * d if cfg.reinject_anchor else 0) + (6 * d * d if cfg.gate else 0)
        total = r * (core + extra)
        if executed and cfg.variant == "grt" and r > 0:
            # the GRT computes the anchor halves (2 d^2 each) once per forward (model.gpt.AnchorProjection)
            anchor_half = (2 * d * d if cfg.reinject_anchor else 0) + (2 * d * d if cfg.gate else 0)
            total -= anchor_half * (r - 1)
        return total
    if cfg.variant == "rrt":
        h, rank = cfg.mlp_ratio * d, int(cfg.xget("lora_rank"))
        lora = 2 * rank * ((d + 3 * d) + (d + d) + (d + h) + (h + d))  # down + up at the block's 4 linears
        return r * layout.core * (_block_flops(cfg, seq_len) + lora)
    if cfg.variant == "ouro":
        return r * (core + 2 * d)  # the exit gate Linear(d -> 1) after every step
    if cfg.variant == "mor":
        # step i runs the core on a share (R - i) / R of the tokens (attending within that share),
        # and its router Linear(d -> 1) scores every token
        total = 0.0
        for i in range(r):
            share = (layout.loops - min(i, layout.loops - 1)) / layout.loops
            total += share * layout.core * _block_flops(cfg, seq_len, share) + 2 * d
        return total
    raise ValueError(f"variant={cfg.variant!r}: no FLOP count")


def flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, n_loops: int | None = None, executed: bool = False
) -> int:
    """Forward FLOPs per token of any variant at a depth of n_loops loop steps (default: R),
    sequence length seq_len (default: max_seq_len), inference (Ouro: one decode at a fixed exit).

    For the GRT this is the spec's formula, (P + C*R + K) * (24 d^2 + 4 S d) + R * 10 d^2 + 2 d V
    (24 d^2 at mlp_ratio 4; 10 d^2 = projection 4 + gate MLP 6, less without them).
    executed=True counts what this implementation runs: the GRT computes the anchor halves of
    the projection and of the gate's first layer once per forward, not once per loop step. MFU
    uses the executed count. Training is about 3x (see train_flops_per_token).
    """
    layout = cfg.parsed_layout
    s = seq_len or cfg.max_seq_len
    r = layout.loops if n_loops is None else n_loops
    outside = (layout.prelude + layout.coda) * _block_flops(cfg, s) + 2 * cfg.d_model * cfg.padded_vocab_size
    loop = _loop_flops(cfg, s, r, executed) if layout.looped else 0
    return int(round(outside + loop))


def train_flops_per_token(cfg: ModelConfig, seq_len: int, depth: int, executed: bool = False) -> float:
    """Forward + backward (3x forward) of one training step at the sampled depth. Ouro decodes
    every step in training (depth - 1 more codas and heads); Huginn differentiates only the
    last k steps (the others cost one forward)."""
    fwd = flops_per_token(cfg, seq_len, depth, executed)
    if cfg.variant == "ouro" and depth > 1:
        layout = cfg.parsed_layout
        fwd += (depth - 1) * (layout.coda * _block_flops(cfg, seq_len) + 2 * cfg.d_model * cfg.padded_vocab_size)
    if cfg.variant == "huginn":
        k = int(cfg.xget("backprop_steps"))
        if depth > k:
            no_grad = fwd - flops_per_token(cfg, seq_len, k, executed)
            return 3 * fwd - 2 * no_grad
    return 3 * fwd


def count_params(model: torch.nn.Module) -> dict[str, int]:
    """Unique parameters (a tied head counts once) and those outside the embeddings; a ZeRO-3
    partitioned parameter counts its full size (ds_numel)."""

    def numel(p):
        return getattr(p, "ds_numel", p.numel())

    unique = {id(p): p for p in model.parameters()}
    total = sum(numel(p) for p in unique.values())
    embedding = sum(numel(p) for name, p in model.named_parameters() if name.split(".")[0] in ("wte", "wpe"))
    return {"params": total, "non_embedding_params": total - embedding}
