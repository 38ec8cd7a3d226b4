"""`build_model(cfg)`: the torch model of cfg.variant, the class decorated with
`@builds(variant)`. The GRT and the dense GPT-2 are `GPT`; each comparison baseline is its
own subclass (pretrain.model.baselines, imported here so that its classes are registered)."""

from __future__ import annotations

from grt_common.errors import ConfigError
from pretrain.model.baselines import RRTGPT, HuginnGPT, MoRGPT, OuroGPT  # noqa: F401 (imported: their @builds)
from pretrain.model.gpt import GPT, MODEL_CLASSES
from pretrain.model_config import ModelConfig


def model_class(variant: str) -> type[GPT]:
    """The class that builds `variant`."""
    if variant not in MODEL_CLASSES:
        raise ConfigError(f"variant={variant!r} has no model class (decorate one with pretrain.model.gpt.builds)")
    return MODEL_CLASSES[variant]


def build_model(cfg: ModelConfig) -> GPT:
    """The model for cfg (any registered variant), freshly initialised."""
    cfg.validate()
    return model_class(cfg.variant)(cfg)
