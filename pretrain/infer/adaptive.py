"""Per-token adaptive exit at inference: a token stops looping when its state stops changing.

The rule. Every token starts at s_0 = e (the prelude output) and runs loop steps r = 1, 2, ...
up to `max_steps`. After step r, a still-active token's change is measured by one of

    update   ||s_r - s_{r-1}|| / ||s_{r-1}||                (relative update of the state)
    kl       KL(p_r || p_{r-1}) of the next-token distributions decoded from s_r and s_{r-1}

and the token exits once its change is below `threshold` (so every token runs at least one
step). An exited token's state is frozen: later steps leave it unchanged, and it is decoded
from the state it exited with. Tokens of one sequence run their steps together, so at a
later step the still-active tokens attend to keys and values computed from an exited
token's frozen state (what a batch-parallel implementation that skips the exited token's
update computes). `steps` reports the loop steps each token used: the compute an
implementation that skips exited tokens spends on the core.

`grt eval --adaptive-exit update --exit-thresholds 0.3,0.1,0.03` reports, on the held-out
split, the loss and the mean steps per token at each threshold, beside the loss at each
fixed depth of the same run: a curve of loss against compute.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from pretrain.config import ConfigError
from pretrain.infer.scoring import sum_over_ranks
from pretrain.model import GPT
from pretrain.model.layers import AttentionContext

CRITERIA = ("update", "kl")


def _change(model: GPT, criterion: str, prev: torch.Tensor, new: torch.Tensor, ctx: AttentionContext,
            prev_logp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token change [B, T] from state prev to new (and the new log-probabilities for kl)."""
    if criterion == "update":
        rel = (new - prev).float().norm(dim=-1) / prev.float().norm(dim=-1).clamp_min(1e-12)
        return rel, None
    logp = F.log_softmax(model.decode(new, ctx).float(), dim=-1)
    return (logp.exp() * (logp - prev_logp)).sum(-1), logp


@torch.no_grad()
def adaptive_forward(model: GPT, idx: torch.Tensor, threshold: float, criterion: str = "update",
                     max_steps: int | None = None,
                     doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, T, V], steps used per token [B, T]) with per-token adaptive exit."""
    if criterion not in CRITERIA:
        raise ConfigError(f"adaptive exit criterion {criterion!r}: accepted values are {', '.join(CRITERIA)}")
    if model.loop is None:
        raise ConfigError(f"adaptive exit needs a looped model; {model.cfg.name!r} ({model.cfg.layout}) has no loop")
    n_max = model.depth(max_steps)
    ctx = AttentionContext(doc_ids=doc_ids)
    e = model.run_prelude(model.embed(idx), ctx)
    terms = model.loop.anchor_terms(e)
    s = e
    active = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    steps = torch.zeros(idx.shape, dtype=torch.long, device=idx.device)
    logp = F.log_softmax(model.decode(e, ctx).float(), dim=-1) if criterion == "kl" else None
    for r in range(n_max):
        new, _ = model.loop_step(s, e, ctx, r, terms)
        change, new_logp = _change(model, criterion, s, new, ctx, logp)
        keep = active[..., None]
        s = torch.where(keep, new, s)
        if new_logp is not None:
            logp = torch.where(keep, new_logp, logp)
        steps += active
        active &= change >= threshold
        if not bool(active.any()):  # one host sync per step: evaluation, not the training loop
            break
    return model.decode(s, ctx), steps


@torch.no_grad()
def adaptive_sums(model: GPT, batches: Iterable[dict], thresholds: list[float], device, criterion: str = "update",
                  max_steps: int | None = None, dist=None) -> torch.Tensor:
    """[len(thresholds), 3] on the CPU: summed NLL, scored tokens and summed loop steps of the
    scored tokens, per threshold, summed over ranks."""
    sums = torch.zeros(len(thresholds), 3, dtype=torch.float64, device=device)
    for batch in batches:
        idx, targets = batch["input_ids"].to(device), batch["targets"].to(device)
        scored = targets != -100
        for i, thr in enumerate(thresholds):
            logits, steps = adaptive_forward(model, idx, thr, criterion, max_steps)
            sums[i, 0] += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                          reduction="sum")
            sums[i, 1] += scored.sum()
            sums[i, 2] += steps[scored].sum()
    return sum_over_ranks(sums, dist)


def adaptive_table(sums: torch.Tensor, thresholds: list[float]) -> dict[float, dict]:
    return {thr: {"loss": sums[i, 0].item() / max(sums[i, 1].item(), 1.0),
                  "mean_steps": sums[i, 2].item() / max(sums[i, 1].item(), 1.0)}
            for i, thr in enumerate(thresholds)}


def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--exit-thresholds {text!r}: want comma-separated numbers, e.g. 0.3,0.1,0.03") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"--exit-thresholds {text!r}: want one or more non-negative numbers")
    return values
