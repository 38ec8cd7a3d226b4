"""What a variant reads of a model config: `ModelSpec`, the part of pretrain.model_config.ModelConfig
that the variants' checks, recipes and cost terms use. A protocol, so that of the two only
pretrain.model_config imports the other (it asks the variants about a config); a variant that reads
another setting of the config declares it here."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

_S = TypeVar("_S")  # typing.Self is 3.11+; this file is vendored into exported models (model/hf.py)


class LayoutSpec(Protocol):
    """pretrain.model_config.Layout, as far as the variants read it."""

    @property
    def core(self) -> int: ...

    @property
    def looped(self) -> bool: ...

    @property
    def placement(self) -> str: ...


class ModelSpec(Protocol):
    """pretrain.model_config.ModelConfig, as far as the variants read it."""

    variant: str
    layout: str
    d_model: int
    mlp_ratio: int
    state_noise_std: float
    reinject_anchor: bool
    gate: bool
    core_kv: str
    extra: dict[str, Any]

    @property
    def parsed_layout(self) -> LayoutSpec: ...

    @property
    def max_loops(self) -> int: ...

    def replace(self: _S, **changes: Any) -> _S: ...
