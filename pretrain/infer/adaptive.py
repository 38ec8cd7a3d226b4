"""Per-token adaptive exit at inference: a token stops looping when its state stops changing.

The rule. Every token starts at the variant's s_0 (the prelude output e, which is the
embeddings when the layout has no prelude; Huginn's random state) and runs loop steps
r = 1, 2, ... up to `max_steps`. After step r, a still-active token's change is measured
by one of

    update   ||s_r - s_{r-1}|| / ||s_{r-1}||                (relative update of the state)
    kl       KL(p_r || p_{r-1}) of the next-token distributions decoded from s_r and s_{r-1}

and the token exits once its change is below `threshold` (so every token runs at least one
step). An exited token's state is frozen: later steps leave it unchanged, and it is decoded
from the state it exited with. Tokens of one sequence run their steps together, so at a
later step the still-active tokens attend to keys and values computed from an exited
token's frozen state (what a batch-parallel implementation that skips the exited token's
update computes). `steps` reports the loop steps each token used: the compute an
implementation that skips exited tokens spends on the core.

Any looped variant whose loop step treats every token alike runs it (GRT, Huginn, RRT,
Ouro), through the model's own `recurrence()`; MoR routes tokens through its loop by its own
learned router, which is its adaptive depth, so a threshold rule does not apply to it
(its Variant's `adaptive_exit_refusal`).

`grt eval --adaptive-exit update --exit-thresholds 0.3,0.1,0.03` reports, on the held-out
split, the loss and the mean steps per token at each threshold, beside the loss at each
fixed depth of the same run: a curve of loss against compute. `grt generate --exit-threshold
X --exit-rule update|kl` runs the same rule at decode (pretrain/infer/kv_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from grt_common.errors import ConfigError
from pretrain.model import GPT
from pretrain.model.layers import AttentionContext
from pretrain.variants import get_variant

CRITERIA = ("update", "kl")


def step_change(
    criterion: str,
    prev: torch.Tensor,
    new: torch.Tensor,
    prev_logp: torch.Tensor | None,
    decode: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token change [B, T] from state prev to new, and for kl the new state's
    log-probabilities (`decode`: a state to logits; prev_logp: the previous state's)."""
    if criterion == "update":
        rel = (new - prev).float().norm(dim=-1) / prev.float().norm(dim=-1).clamp_min(1e-12)
        return rel, None
    if prev_logp is None:
        raise ValueError("the kl rule needs the previous state's log-probabilities (prev_logp)")
    logp = F.log_softmax(decode(new).float(), dim=-1)
    # KL >= 0; rounding can give -1e-9, which would let threshold 0 exit a token early
    return (logp.exp() * (logp - prev_logp)).sum(-1).clamp_min(0.0), logp


def check_criterion(model: GPT, criterion: str) -> None:
    if criterion not in CRITERIA:
        raise ConfigError(f"adaptive exit criterion {criterion!r}: accepted values are {', '.join(CRITERIA)}")
    if model.loop is None:
        raise ConfigError(f"adaptive exit needs a looped model; {model.cfg.name!r} ({model.cfg.layout}) has no loop")
    refusal = get_variant(model.cfg.variant).adaptive_exit_refusal
    if refusal:
        raise ConfigError(refusal)


def adaptive_loop(
    s: torch.Tensor,
    step: Callable[[torch.Tensor, int], torch.Tensor],
    n_max: int,
    threshold: float,
    criterion: str,
    decode: Callable[[torch.Tensor], torch.Tensor],
    active: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Up to n_max steps from s_0 = s under the rule; (the final states, loop steps run). The
    masks active [B, T] (bool, all True) and steps [B, T] (zeros) are updated in place, so that
    a KV cache sees which tokens a step still runs (pretrain/infer/kv_cache.py)."""
    logp = F.log_softmax(decode(s).float(), dim=-1) if criterion == "kl" else None
    ran = 0
    for r in range(n_max):
        new = step(s, r)
        change, new_logp = step_change(criterion, s, new, logp, decode)
        keep = active[..., None]
        s = torch.where(keep, new, s)
        if new_logp is not None and logp is not None:  # kl: both, from the first step on
            logp = torch.where(keep, new_logp, logp)
        steps += active
        active &= change >= threshold
        ran = r + 1
        if not bool(active.any()):  # one host sync per step: inference, not the training loop
            break
    return s, ran


@torch.no_grad()
def adaptive_forward(
    model: GPT,
    idx: torch.Tensor,
    threshold: float,
    criterion: str = "update",
    max_steps: int | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, T, V], steps used per token [B, T]) with per-token adaptive exit."""
    check_criterion(model, criterion)
    n_max = model.depth(max_steps)
    ctx = AttentionContext(doc_ids=doc_ids)
    s, step = model.recurrence(model.run_prelude(model.embed(idx), ctx), ctx)
    decode = lambda state: model.decode(state, ctx)  # noqa: E731
    active = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    steps = torch.zeros(idx.shape, dtype=torch.long, device=idx.device)
    s, _ = adaptive_loop(s, step, n_max, threshold, criterion, decode, active, steps)
    return model.decode(s, ctx), steps


def adaptive_table(sums: torch.Tensor, thresholds: list[float]) -> dict[float, dict[str, float]]:
    return {
        thr: {
            "loss": sums[i, 0].item() / max(sums[i, 1].item(), 1.0),
            "mean_steps": sums[i, 2].item() / max(sums[i, 1].item(), 1.0),
        }
        for i, thr in enumerate(thresholds)
    }


def parse_thresholds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--exit-thresholds {text!r}: want comma-separated numbers, e.g. 0.3,0.1,0.03") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"--exit-thresholds {text!r}: want one or more non-negative numbers")
    return values
