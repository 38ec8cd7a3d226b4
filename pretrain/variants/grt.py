"""The Gated Recurrent Transformer (pretrain/model/gpt.py): a shared core looped R times, the
prelude output re-injected through a projection of [s; e], and a learned gate on each update.
With its switches off it is each rung of the paper's ablation ladder, down to loop only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pretrain.variants.base import Variant, projection_and_gate_flops, register

if TYPE_CHECKING:
    from pretrain.variants.model_spec import ModelSpec


# how `describe` names each placement of the loop (pretrain.model_config.Layout.placement): the
# full GRT, and the first word of an ablation rung ("loop + coda, noise")
GRT_NAMES = {
    "whole": "GRT (whole stack looped)",
    "middle": "GRT",
    "bottom": "GRT (bottom loop)",
    "top": "GRT (top loop)",
}
RUNG_WORDS = {"whole": "whole stack looped", "middle": "prelude/coda", "bottom": "coda", "top": "prelude"}


@register
class GRT(Variant):
    name = "grt"
    label = "GRT"
    anchored_kv = True
    # truncated backprop (Huginn's setting, pretrain/variants/huginn.py): training differentiates only the
    # last k loop steps, the earlier ones run without autograd (Variant.no_grad_steps); 0 = every step
    extra = {"backprop_steps": 0}

    def describe(self, cfg: ModelSpec) -> str:
        """GRT with all of its components (naming where the loop sits unless it is the middle:
        'GRT (bottom loop)'); otherwise the ablation rung the switches make."""
        placement = cfg.parsed_layout.placement
        parts = [RUNG_WORDS[placement]]
        if cfg.state_noise_std > 0:
            parts.append("noise")
        if cfg.reinject_anchor:
            parts.append("re-injection")
        if cfg.gate:
            parts.append("gate")
        if len(parts) == 4:
            return GRT_NAMES[placement]
        return "loop only" if parts == [RUNG_WORDS["whole"]] else "loop + " + ", ".join(parts)

    def train_recipe(self, cfg: ModelSpec) -> dict[str, Any]:
        return {"depth_sampling": "uniform"}  # r ~ U{1..R} per step (spec section 2)

    def step_extra_flops(self, cfg: ModelSpec) -> float:
        return projection_and_gate_flops(cfg)

    def loop_flops(self, cfg: ModelSpec, seq_len: int, steps: int, executed: bool) -> float:
        total = super().loop_flops(cfg, seq_len, steps, executed)
        if steps == 0:
            return total
        d = cfg.d_model
        if cfg.core_kv == "anchor":
            # the model's design, so in both counts: each core block's key and value projections
            # (2 d^2 each) run once per forward on the anchor, not once per loop step
            total -= 4 * d * d * cfg.parsed_layout.core * (steps - 1)
        if executed:
            # the anchor halves of the projection and of the gate's first layer (2 d^2 each) are
            # computed once per forward (model.gpt.AnchorProjection), not once per step
            anchor_half = (2 * d * d if cfg.reinject_anchor else 0) + (2 * d * d if cfg.gate else 0)
            total -= anchor_half * (steps - 1)
        return total
