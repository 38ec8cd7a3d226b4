"""Mixture-of-Recursions (model: pretrain/model/baselines.py MoRGPT): per loop step a router
picks the top-k tokens still active (capacity (R - r + 1) / R), the shared core runs on those
alone (causal among them), and an auxiliary loss teaches the router its selection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pretrain.variants.base import Baseline, register

if TYPE_CHECKING:
    from pretrain.variants.model_spec import ModelSpec


@register
class MoR(Baseline):
    name = "mor"
    label = "MoR"
    extra = {"aux_loss_coef": 0.01, "router_noise_std": 0.0}
    noise_extra = {"router_noise_std": 0.0}
    adaptive_exit_refusal = (
        "adaptive exit by a threshold does not apply to MoR: its learned router already picks "
        "the tokens each loop step runs"
    )

    def train_recipe(self, cfg: ModelSpec) -> dict[str, Any]:
        return {"depth_sampling": "fixed"}  # the router learns its capacities over all R steps

    def step_shares(self, cfg: ModelSpec, steps: int) -> list[float]:
        r = cfg.max_loops  # step i runs on (R - i) / R of the tokens (the last share repeats past R)
        return [(r - min(i, r - 1)) / r for i in range(steps)]

    def step_extra_flops(self, cfg: ModelSpec) -> float:
        return 2 * cfg.d_model  # the router Linear(d -> 1) scores every token

    def outside_loop_bytes(self, cfg: ModelSpec, shares: list[float], dtype_bytes: int) -> float:
        # the router keeps the full state, the gated update the chosen tokens' (out - x), outside
        # the checkpointed loop step
        return sum(1 + share for share in shares) * cfg.d_model * dtype_bytes
