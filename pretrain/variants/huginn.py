"""Huginn (Geiping et al. 2025; model: pretrain/model/baselines.py HuginnGPT): a random
initial state, an adapter on [s; e] every step, sandwich-norm core blocks, heavy-tail Poisson
depth, backprop through the last k steps only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError
from pretrain.variants.base import Baseline, projection_and_gate_flops, register

if TYPE_CHECKING:
    from pretrain.variants.model_spec import ModelSpec


@register
class Huginn(Baseline):
    name = "huginn"
    label = "Huginn (heavy-tail Poisson)"
    reinjects_anchor = True
    # s_0 std = init_state_scale * sqrt(2 / (5 d)), truncated at 3 std; backprop through the last k steps
    extra = {"init_state_scale": 1.0, "backprop_steps": 8}
    noise_extra = {"init_state_scale": 0.0}
    preset_extra = {"backprop_steps": 2}  # at R = 3 or 4 the default 8 would truncate nothing

    def check_extra(self, cfg: ModelSpec) -> None:
        if int(self.setting(cfg, "backprop_steps")) < 1:
            raise ConfigError("extra.backprop_steps must be >= 1")

    def train_recipe(self, cfg: ModelSpec) -> dict[str, Any]:
        # the heavy-tail Poisson with rbar scaled to the layout: mean depth rbar + 1 = the GRT's (R + 1) / 2
        # (the paper's rbar 32 is for its R; at a tiny R it would train far deeper than the GRT it is compared to)
        return {"depth_sampling": "poisson", "poisson_mean": max(0.5, (cfg.max_loops - 1) / 2)}

    def step_extra_flops(self, cfg: ModelSpec) -> float:
        return projection_and_gate_flops(cfg)  # the adapter Linear(2d -> d)

    def block_extra_bytes(self, cfg: ModelSpec, dtype_bytes: int) -> tuple[int, int]:
        extra_norms = 2 * cfg.d_model * dtype_bytes  # the sandwich's two extra norms keep their inputs
        return extra_norms, extra_norms
