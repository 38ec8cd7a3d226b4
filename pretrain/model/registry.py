"""The variant registry: `build_model(cfg)` builds the model class of cfg.variant.

The GRT and the dense GPT-2 are `GPT`; each comparison baseline is its own subclass
(pretrain.model.baselines). Imports run one way: gpt <- baselines <- registry.
"""

from __future__ import annotations

from pretrain.config import ModelConfig
from pretrain.model.baselines import RRTGPT, HuginnGPT, MoRGPT, OuroGPT
from pretrain.model.gpt import GPT

MODEL_CLASSES: dict[str, type[GPT]] = {
    variant: cls for cls in (GPT, HuginnGPT, RRTGPT, OuroGPT, MoRGPT) for variant in cls.VARIANTS
}


def build_model(cfg: ModelConfig) -> GPT:
    """The model for cfg (any variant of pretrain.config.VARIANTS), freshly initialised."""
    cfg.validate()
    return MODEL_CLASSES[cfg.variant](cfg)
