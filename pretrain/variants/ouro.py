"""Ouro (model: pretrain/model/baselines.py OuroGPT): plain recurrence, every step decoded,
trained on the expected step loss under a learned exit distribution (minus beta x its
entropy); at inference a token exits where that distribution's CDF passes a threshold."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError
from pretrain.variants.base import Baseline, register

if TYPE_CHECKING:
    from pretrain.variants.model_spec import ModelSpec


@register
class Ouro(Baseline):
    name = "ouro"
    label = "Ouro"
    extra = {"entropy_beta": 0.1, "exit_threshold": 0.5}
    learned_exit = True
    decodes_every_step = True

    def check_extra(self, cfg: ModelSpec) -> None:
        threshold = self.setting(cfg, "exit_threshold")
        if not 0 < threshold <= 1:
            raise ConfigError(f"extra.exit_threshold={threshold!r}: must be in (0, 1]")

    def train_recipe(self, cfg: ModelSpec) -> dict[str, Any]:
        return {"depth_sampling": "fixed"}  # the exit distribution is learned over all R steps

    def step_extra_flops(self, cfg: ModelSpec) -> float:
        return 2 * cfg.d_model  # the exit gate Linear(d -> 1) after every step
