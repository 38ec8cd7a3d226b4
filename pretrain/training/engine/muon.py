"""train.optimizer=muon: DeepSpeed's Muon (`MuonWithAuxAdam`, "optimizer": {"type": "Muon"}) for the
hidden weight matrices, its auxiliary AdamW for everything else.

Muon orthogonalises each matrix's momentum (Newton-Schulz) and is defined for the weights of linear
maps between hidden states: the blocks' attention and MLP matrices, the loop's projection and the
gate MLP. The embeddings, the (tied) head, norms, biases and gains, and matrices with a dimension of
1 (a scalar read-out: Ouro's exit gate, MoR's routers) stay on AdamW.

DeepSpeed picks a parameter's half by its `use_muon` attribute, which `deepspeed.initialize` sets
from the parameter's name (2-D and no "embed" or "lm_head" in it, `deepspeed.set_optimizer_flags`):
here the embeddings are `wte`/`wpe`, which that rule would give to Muon. `tagged` re-tags every
parameter by the module that owns it, right after DeepSpeed's own tagging and before the engine
builds the optimizer from the tags.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def muon_names(model: torch.nn.Module) -> set[str]:
    """The names (as `model.named_parameters()` gives them) of the matrices Muon updates."""
    head = getattr(model, "lm_head", None)
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    chosen = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head and id(m.weight) not in embedded
    }
    return {
        name
        for name, p in model.named_parameters()
        if id(p) in chosen and min(getattr(p, "ds_shape", p.shape)) > 1  # zero.Init: the shape is ds_shape
    }


@contextmanager
def tagged(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """While `deepspeed.initialize` builds the engine of `model`: every parameter's `use_muon` is
    `muon_names`'s choice, whatever DeepSpeed's name rule said."""
    import deepspeed

    if not enabled:
        yield
        return
    chosen = muon_names(model)
    deepspeed_tags = deepspeed.set_optimizer_flags

    def retag(config: Any, module: torch.nn.Module) -> None:
        deepspeed_tags(config, module)
        for name, p in module.named_parameters():
            p.use_muon = name in chosen  # type: ignore[attr-defined]  # DeepSpeed's tag

    deepspeed.set_optimizer_flags = retag
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = deepspeed_tags
