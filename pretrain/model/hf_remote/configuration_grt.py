"""Hugging Face config of a looped model exported by `grt export` (remote code).

Every field of the project's ModelConfig (grt_model_config.py, vendored from pretrain/model_config.py)
is a top-level key of config.json, plus:

    trained_depth   the R the model was trained with (the layout's R, recorded explicitly)
    depth           loop steps run at inference (default: trained_depth); any depth >= 0,
                    set with from_pretrained(path, trust_remote_code=True, depth=k)
    kv_cache        the KV-cache strategy of generate() for the looped core:
                    full (exact), first, last or average (grt_kv_cache.py)
"""

import dataclasses

from transformers import PretrainedConfig

from .grt_kv_cache import STRATEGIES
from .grt_model_config import ConfigError, ModelConfig

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


class GRTConfig(PretrainedConfig):
    model_type = "grt"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
    }

    def __init__(self, trained_depth=None, depth=None, kv_cache="full", **kwargs):
        fields = {key: kwargs.pop(key) for key in MODEL_FIELDS if key in kwargs}
        for key, value in ModelConfig(**fields).to_dict().items():  # validated, defaults filled in
            setattr(self, key, value)
        r = self.model_config().max_loops
        if trained_depth is not None and int(trained_depth) != r:
            raise ConfigError(f"trained_depth={trained_depth} disagrees with layout={self.layout!r} (R={r})")
        self.trained_depth = r
        self.depth = r if depth is None else depth
        self.kv_cache = kv_cache
        kwargs.setdefault("tie_word_embeddings", self.tie_embeddings)
        super().__init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The project's ModelConfig of this model."""
        return ModelConfig(**{key: getattr(self, key) for key in MODEL_FIELDS})

    def inference_settings(self) -> tuple[int, str]:
        """(depth, kv_cache), checked: read at every forward, so a changed config takes effect."""
        depth = self.depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"depth={depth!r}: must be an integer >= 0 (trained_depth={self.trained_depth})")
        if self.kv_cache not in STRATEGIES:
            raise ConfigError(f"kv_cache={self.kv_cache!r}: accepted values are {', '.join(STRATEGIES)}")
        return depth, self.kv_cache
