"""Parameter and FLOP accounting for every variant: MFU, `grt presets`, `grt compare`, the benches.

FLOPs count the matmuls (2 per multiply-add), as PyTorch's FLOP counter does; elementwise
work (norms, activations, the gate's sigmoid) is left out. tests/model/test_model.py checks the
counts against torch.utils.flop_counter for every variant.
"""

from __future__ import annotations

import torch

from pretrain.model_config import ModelConfig
from pretrain.variants import block_flops, get_variant


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
    outside = (layout.prelude + layout.coda) * block_flops(cfg, s) + 2 * cfg.d_model * cfg.padded_vocab_size
    loop = get_variant(cfg.variant).loop_flops(cfg, s, r, executed) if layout.looped else 0
    return int(round(outside + loop))


def train_flops_per_token(cfg: ModelConfig, seq_len: int, depth: int, executed: bool = False) -> float:
    """Forward + backward (3x forward) of one training step at the sampled depth, with the
    variant's terms: the decodes after every step of a model that trains on each (Ouro: depth - 1
    more codas and heads), the steps run without autograd (Huginn differentiates only the last k
    steps: the others cost one forward)."""
    variant, layout = get_variant(cfg.variant), cfg.parsed_layout
    fwd: float = flops_per_token(cfg, seq_len, depth, executed)
    extra_decodes = variant.training_decodes(depth) - 1
    if extra_decodes:
        fwd += extra_decodes * (layout.coda * block_flops(cfg, seq_len) + 2 * cfg.d_model * cfg.padded_vocab_size)
    # the loop steps run without autograd cost their forward alone
    k = depth - variant.no_grad_steps(cfg, depth)
    no_grad = flops_per_token(cfg, seq_len, depth, executed) - flops_per_token(cfg, seq_len, k, executed)
    return 3 * fwd - 2 * no_grad


def count_params(model: torch.nn.Module) -> dict[str, int]:
    """Unique parameters (a tied head counts once) and those outside the embeddings; a ZeRO-3
    partitioned parameter counts its full size (ds_numel)."""

    def numel(p: torch.nn.Parameter) -> int:
        return getattr(p, "ds_numel", p.numel())

    unique = {id(p): p for p in model.parameters()}
    total = sum(numel(p) for p in unique.values())
    embedding = sum(numel(p) for name, p in model.named_parameters() if name.split(".")[0] in ("wte", "wpe"))
    return {"params": total, "non_embedding_params": total - embedding}
