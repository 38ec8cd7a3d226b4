"""What `grt compare` measures on each looped run's final checkpoint, beyond the trainer's own
validation at r = 0..R, all on the batches that trainer validated on (its eval_batches,
micro-batch size, seed and document mask), so every column of a row sees the same tokens:

- the early-exit curve to F * R (`--exit-depth-factor F`);
- extrapolation: the loss at EXTRAPOLATION_FACTORS x R (2R and 4R), past the trained depth,
  as `grt eval --depths ... --allow-beyond-trained` computes it;
- adaptive exit (pretrain/infer/adaptive.py) at ADAPTIVE_EXITS, each (rule, threshold): the
  loss and the mean loop steps per scored token, for every variant whose loop step treats
  all tokens alike (not MoR, whose router is its own adaptive depth);
- Ouro's own learned exit (`exit="learned"` at its `extra.exit_threshold`): loss and mean
  loop steps, the method the adaptive rules are compared against.

The thresholds are one fixed setting per rule for every method (the table compares methods
at the same rule, not each at its best threshold): `update` 0.1 and `kl` 0.01, the largest
of the grids 0.3/0.1/0.05/0.02/0.01 (update) and 0.1/0.03/0.01/0.003/0.001 (kl) at which no
looped method of docs/comparison.md's CPU runs lost more than 0.005 nats against its own
full depth (`grt eval --adaptive-exit`, 20 validation batches; at the next larger ones RRT
lost 0.026 and 0.020). `kl` is the comparable rule across methods: it is measured in the
output distribution, while a state's relative update depends on the method's state scale
and gate. Results are cached in <run>/final_eval.json, keyed by the checkpoint and the
settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grt_common.files import atomic_write_text
from pretrain.model.baselines import LoopedBaseline
from pretrain.model_config import ModelConfig
from pretrain.runs.run_config import RunConfig
from pretrain.variants import get_variant

ADAPTIVE_EXITS: tuple[tuple[str, float], ...] = (("update", 0.1), ("kl", 0.01))
EXTRAPOLATION_FACTORS = (2, 4)


def adaptive_label(rule: str, threshold: float) -> str:
    return f"{rule} {threshold:g}"


@torch.no_grad()
def learned_exit(
    model: LoopedBaseline, batches: list[dict[str, torch.Tensor]], device: torch.device, doc_mask: bool
) -> dict:
    """Ouro's learned exit at its configured threshold: loss and mean loop steps per scored token."""
    from pretrain.infer.adaptive import adaptive_table
    from pretrain.infer.evaluation.scoring import exit_sums

    def forward(idx: torch.Tensor, doc_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(idx, doc_ids=doc_ids, exit="learned").logits
        return logits, model.last_aux["exit_step"]

    threshold = float(model.cfg.xget("exit_threshold"))
    sums = exit_sums([forward], batches, device, doc_mask=doc_mask)
    return {**adaptive_table(sums, [threshold])[threshold], "threshold": threshold}


def eval_depths(r: int, exit_factor: int) -> tuple[list[int], list[int]]:
    """(the exit curve's depths, every depth of final_evals' one fixed-depth pass)."""
    curve = list(range(exit_factor * r + 1)) if exit_factor > 1 else []
    return curve, sorted(set(curve) | {f * r for f in EXTRAPOLATION_FACTORS})


def final_eval_work(cfg: ModelConfig, exit_factor: int) -> dict[str, int]:
    """Loop steps and decodes (coda and head) final_evals runs per validation batch of a looped
    model, each adaptive pass at its most (R steps): the `grt compare --time-budget` plan's
    count (tests/infer/test_compare.py counts them in a real run)."""
    r, depths = cfg.max_loops, eval_depths(cfg.max_loops, exit_factor)[1]
    # one pass to the deepest depth: its forward decodes the last state, exit_hidden every depth
    steps, decodes = max(depths), 1 + len(depths)
    variant = get_variant(cfg.variant)
    for rule, _ in ADAPTIVE_EXITS if not variant.adaptive_exit_refusal else ():
        steps += r
        decodes += 1 + (r + 1 if rule == "kl" else 0)  # kl also decodes s_0 and the state after every step
    if variant.learned_exit:  # the learned exit decodes after every step
        steps, decodes = steps + r, decodes + r
    return {"loop_steps": steps, "decodes": decodes}


def final_evals(cfg: RunConfig, exit_factor: int) -> dict:
    """{"exit_curve": {r: loss} for r = 0..F*R (F > 1, else None), "extrapolation": {f*R: loss},
    "adaptive_exit": {label: {loss, mean_steps}}, "learned_exit": {...} or None} of a looped run."""
    from pretrain.distributed import Dist
    from pretrain.infer.adaptive import adaptive_table
    from pretrain.infer.evaluation.loss_by_depth import loss_table
    from pretrain.infer.evaluation.scoring import adaptive_sums, lm_sums, val_batches
    from pretrain.infer.load import load_model, pick_device, resolve_checkpoint

    out, t, r = Path(cfg.out), cfg.train, cfg.model.max_loops
    settings = {
        "checkpoint": resolve_checkpoint(out).name,
        "exit_factor": exit_factor,
        "extrapolation_factors": list(EXTRAPOLATION_FACTORS),
        "adaptive_exits": [list(a) for a in ADAPTIVE_EXITS],
    }
    cache = out / "final_eval.json"
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["settings"] == settings:
            return _depth_keys(saved["results"])
    device = pick_device()
    model = load_model(out, device=device).model
    batches = list(val_batches(cfg.data, t.micro_batch_size, Dist(), t.eval_batches, t.seed))  # read once, scored often
    curve_depths, depths = eval_depths(r, exit_factor)
    loss = {d: v["loss"] for d, v in loss_table(lm_sums(model, batches, depths, device, t.doc_mask), depths).items()}
    results: dict[str, Any] = {
        "exit_curve": {d: loss[d] for d in curve_depths} or None,
        "extrapolation": {f * r: loss[f * r] for f in EXTRAPOLATION_FACTORS},
        "adaptive_exit": None,
        "learned_exit": None,
    }
    variant = get_variant(cfg.model.variant)
    if not variant.adaptive_exit_refusal:
        results["adaptive_exit"] = {}
        for rule, threshold in ADAPTIVE_EXITS:
            sums = adaptive_sums(model, batches, [threshold], device, rule, doc_mask=t.doc_mask)
            results["adaptive_exit"][adaptive_label(rule, threshold)] = adaptive_table(sums, [threshold])[threshold]
    if variant.learned_exit:
        assert isinstance(model, LoopedBaseline), "a learned exit is a baseline's (Ouro)"
        results["learned_exit"] = learned_exit(model, batches, device, t.doc_mask)
    atomic_write_text(cache, json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    return results


def _depth_keys(results: dict) -> dict:
    """The cached results with integer depths as keys again (JSON keeps them as strings)."""
    for key in ("exit_curve", "extrapolation"):
        if results[key] is not None:
            results[key] = {int(d): v for d, v in results[key].items()}
    return results
