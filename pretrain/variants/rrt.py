"""The Relaxed Recursive Transformer (model: pretrain/model/baselines.py RRTGPT): plain
recurrence with a LoRA adapter per loop step on every linear of the shared core."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError
from pretrain.variants.base import Baseline, register

if TYPE_CHECKING:
    from pretrain.variants.model_spec import ModelSpec


@register
class RRT(Baseline):
    name = "rrt"
    label = "RRT"
    extra = {"lora_rank": 4, "lora_alpha": 4.0}

    def check_extra(self, cfg: ModelSpec) -> None:
        rank = self.setting(cfg, "lora_rank")
        if int(rank) < 1 or rank != int(rank):
            raise ConfigError(f"extra.lora_rank={rank!r}: must be a positive integer")

    def train_recipe(self, cfg: ModelSpec) -> dict[str, Any]:
        return {"depth_sampling": "fixed"}  # each step's adapters train at their own step: all R of them

    def block_extra_flops(self, cfg: ModelSpec) -> float:
        d, h, rank = cfg.d_model, cfg.mlp_ratio * cfg.d_model, int(self.setting(cfg, "lora_rank"))
        return 2 * rank * ((d + 3 * d) + (d + d) + (d + h) + (h + d))  # down + up at the block's 4 linears

    def block_extra_bytes(self, cfg: ModelSpec, dtype_bytes: int) -> tuple[int, int]:
        # the 4 LoRA sites keep their rank-sized inner activation; selective also the outputs of
        # their up matmuls (3d + d + 4d + d)
        rank = int(self.setting(cfg, "lora_rank"))
        return 4 * rank * dtype_bytes, (4 * rank + 9 * cfg.d_model) * dtype_bytes
