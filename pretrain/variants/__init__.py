"""The model variants: one `Variant` object per variant, registered by name.

`get_variant(cfg.variant)` is how any module asks about a variant (its settings and checks,
recipe, FLOP and memory terms, adaptive exit); nothing tests a variant's name. Torch-free, so
that pretrain.model_config, at the bottom of the import graph, checks configs with it.

A new variant is a `Variant` subclass decorated with `@register` (in this package, or in any
module imported before the variant is used), its torch model decorated with `@builds(name)`
(pretrain/model/), and its presets in pretrain/presets.py (tests/model/test_variants.py adds one
from a test file alone).
"""

from pretrain.variants.base import REGISTRY, Baseline, Variant, block_flops, get_variant, register

# the built-in variants, registered on import (`grt export` vendors these imports: keep them `from x import y`)
from pretrain.variants.dense import Dense
from pretrain.variants.grt import GRT
from pretrain.variants.huginn import Huginn
from pretrain.variants.mor import MoR
from pretrain.variants.ouro import Ouro
from pretrain.variants.rrt import RRT

__all__ = [
    "GRT",
    "REGISTRY",
    "RRT",
    "Baseline",
    "Dense",
    "Huginn",
    "MoR",
    "Ouro",
    "Variant",
    "block_flops",
    "get_variant",
    "register",
]
