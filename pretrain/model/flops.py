"""Parameter and FLOP accounting (the spec's formula, used for MFU)."""
from __future__ import annotations

import torch

from pretrain.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, n_loops: int | None = None,
                    executed: bool = False) -> int:
    """Forward FLOPs per token: (P + C*R + K) * (24 d^2 + 4 S d) + R * loop_extra + 2 d V.

    24 d^2 is a block's matmuls (qkv 6, attention out 2, MLP 16, at mlp_ratio 4), 4 S d
    the attention scores and values at full (unmasked) length, loop_extra the projection
    (4 d^2) and the gate MLP (6 d^2) of each loop step, 2 d V the LM head. Training is ~3x.

    executed=True counts what this implementation runs: the anchor halves of the
    projection and of the gate's first layer (2 d^2 each) are computed once per forward,
    not once per loop step (model.gpt.AnchorProjection). MFU uses the executed count.
    """
    layout = cfg.parsed_layout
    d, s = cfg.d_model, seq_len or cfg.max_seq_len
    r = layout.loops if n_loops is None else n_loops
    block = (8 + 4 * cfg.mlp_ratio) * d * d + 4 * s * d
    anchor_half = (2 * d * d if cfg.reinject_anchor else 0) + (2 * d * d if cfg.gate else 0)
    loop_extra = (4 * d * d if cfg.reinject_anchor else 0) + (6 * d * d if cfg.gate else 0)
    loop = r * loop_extra - (anchor_half * (r - 1) if executed and r > 0 else 0) if layout.looped else 0
    return layout.effective_depth(r) * block + loop + 2 * d * cfg.padded_vocab_size


def count_params(model: torch.nn.Module) -> dict[str, int]:
    """Unique parameters (a tied head counts once) and those outside the embeddings."""
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    embedding = sum(p.numel() for name, p in model.named_parameters() if name.split(".")[0] in ("wte", "wpe"))
    return {"params": total, "non_embedding_params": total - embedding}
