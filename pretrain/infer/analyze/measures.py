"""The measures of `grt analyze` (pretrain/infer/analyze/analysis.py), each a small function on tensors
or counts: linear CKA, the cosines, norms and singular values of a weight's state and anchor
halves, FLOPs per token at an exit depth and the share of the full-depth gain kept at half the
compute, token buckets by punctuation and frequency, the gate input's variance share."""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pretrain.model.flops import flops_per_token
from pretrain.model_config import ModelConfig
from pretrain.variants import block_flops

BUCKETS = ("punctuation", "frequent", "medium", "rare")


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019) between [N, d1] and [N, d2] representations."""
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    hsic = (y.T @ x).norm() ** 2
    denom = (x.T @ x).norm() * (y.T @ y).norm()
    return (hsic / denom).item() if denom > 0 else float("nan")


def cka_matrix(states: list[torch.Tensor]) -> list[list[float]]:
    n = len(states)
    m = [[1.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            m[i][j] = m[j][i] = linear_cka(states[i], states[j])
    return m


def cross_cka(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[list[float]]:
    return [[linear_cka(x, y) for y in b] for x in a]


TOP_SINGULAR_VALUES = 5  # how many of each half's singular values the report lists


def half_cosines(state_half: torch.Tensor, anchor_half: torch.Tensor, top: int = TOP_SINGULAR_VALUES) -> dict[str, Any]:
    """W = [W_s | W_e] (each [out, d]): cosine between the state half and the anchor half, each
    half's Frobenius norm and its `top` largest singular values (descending; the first is the
    spectral norm)."""
    a, b = state_half.detach().double(), anchor_half.detach().double()
    return {
        "cosine": F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item(),
        "mean_row_cosine": F.cosine_similarity(a, b, dim=1).mean().item(),
        "norm_state": a.norm().item(),
        "norm_anchor": b.norm().item(),
        "singular_values_state": torch.linalg.svdvals(a)[:top].tolist(),
        "singular_values_anchor": torch.linalg.svdvals(b)[:top].tolist(),
    }


def exit_flops(cfg: ModelConfig, seq_len: int, depth: int, executed: bool = False) -> int:
    """Forward FLOPs per token at an exit depth (pretrain.model.flops' formulas; executed: what
    the implementation runs, as there). A looped model's depth is loop steps (flops_per_token at
    that depth); a dense model's the layers run, 1..N: k blocks + the head, the full model's
    count less the N - k blocks it skips."""
    layout = cfg.parsed_layout
    if layout.looped:
        return flops_per_token(cfg, seq_len, depth, executed)
    if not 1 <= depth <= layout.prelude:
        raise ValueError(f"depth {depth}: a dense model of {layout.prelude} layers exits after 1..{layout.prelude}")
    return flops_per_token(cfg, seq_len, executed=executed) - round(
        (layout.prelude - depth) * block_flops(cfg, seq_len)
    )


def half_compute_share(depths: Sequence[int], flops: Sequence[float], losses: Sequence[float]) -> dict[str, Any]:
    """The share of the full-depth gain an early exit keeps at half the compute. depths in
    increasing order, the first the minimum exit depth and the last the full depth, with their
    FLOPs per token and losses. gain(r) = loss(minimum depth) - loss(r); the half-compute depth
    is the one whose FLOPs are closest to, and not above, half the full depth's; share =
    gain(half-compute depth) / gain(full depth). depth and share are None where no depth is at
    or under half the full FLOPs; share is None where the full-depth gain is 0."""
    half = flops[-1] / 2
    under = [i for i, f in enumerate(flops) if f <= half]
    full_gain = losses[0] - losses[-1]
    out: dict[str, Any] = {"full_gain": full_gain, "half_flops": half, "depth": None, "flops": None, "gain": None}
    out["share"] = None
    if under:
        i = max(under, key=lambda j: flops[j])
        out.update(depth=depths[i], flops=flops[i], gain=losses[0] - losses[i])
        out["share"] = out["gain"] / full_gain if full_gain != 0 else None
    return out


def exit_curve(cfg: ModelConfig, seq_len: int, loss_by_depth: dict[int, float]) -> dict[str, Any]:
    """One model's early exit: depths, FLOPs per token (exit_flops), losses, the half-compute share."""
    depths = sorted(loss_by_depth)
    flops = [exit_flops(cfg, seq_len, r) for r in depths]
    losses = [loss_by_depth[r] for r in depths]
    return {
        "layout": cfg.layout,
        "depth_unit": "loop steps" if cfg.parsed_layout.looped else "layers",
        "depths": depths,
        "flops_per_token": flops,
        "loss": losses,
        "half_compute": half_compute_share(depths, flops, losses),
    }


def is_punctuation(piece: str) -> bool:
    """A piece of punctuation and/or whitespace only (e.g. ',', ' .', '\n', '?!')."""
    return piece != "" and all(ch in string.punctuation or ch.isspace() for ch in piece)


def frequency_buckets(
    counts: Counter[int],
    vocab_size: int,
    punctuation: set[int],
    frequent_mass: float = 0.5,
    medium_mass: float = 0.9,
) -> torch.Tensor:
    """A bucket index (0..3, see BUCKETS) per token id. Non-punctuation tokens are ranked by
    count; the most frequent ones up to `frequent_mass` of the occurrences are 'frequent', up
    to `medium_mass` 'medium', the rest (and tokens never seen) 'rare'."""
    bucket = torch.full((vocab_size,), 3, dtype=torch.long)
    for t in punctuation:
        if t < vocab_size:
            bucket[t] = 0
    ranked = sorted(((c, t) for t, c in counts.items() if t not in punctuation and t < vocab_size), reverse=True)
    total = sum(c for c, _ in ranked) or 1
    seen = 0
    for c, t in ranked:
        share = seen / total  # mass of the tokens ranked above this one
        bucket[t] = 1 if share < frequent_mass else 2 if share < medium_mass else 3
        seen += c
    return bucket


def variance_share(a_sum: torch.Tensor, a_sq: torch.Tensor, b_sum: torch.Tensor, b_sq: torch.Tensor, n: int) -> float:
    """State share of tr Var from running sums (per hidden unit) of the two halves."""
    var_a = (a_sq / n - (a_sum / n) ** 2).sum()
    var_b = (b_sq / n - (b_sum / n) ** 2).sum()
    return (var_a / (var_a + var_b)).item()
