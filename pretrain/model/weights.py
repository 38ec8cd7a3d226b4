"""A model's weights as the project's files store them: the tied head (`TIED_KEY`, the embedding
itself) stored once, since safetensors refuses aliases, and re-tied on load (infer/load.py)."""

from __future__ import annotations

import torch

from pretrain.model.gpt import GPT

TIED_KEY = "lm_head.weight"


def state_for_saving(model: GPT) -> dict[str, torch.Tensor]:
    """The state dict with shared tensors stored once."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop(TIED_KEY, None)
    return state
