"""The dense GPT-2 baseline: N blocks run once (pretrain/model/gpt.py, without a loop)."""

from __future__ import annotations

from pretrain.variants.base import Variant, register


@register
class Dense(Variant):
    name = "dense"
    label = "dense GPT-2"
    looped = False
    hf_gpt2 = True
