"""Conversion between the dense model and Hugging Face `transformers`' GPT2LMHeadModel.

Both are the same function (pre-norm, learned positions, tanh GELU, tied embeddings);
HF stores linear weights as Conv1D ([in, out]), hence the transposes.
"""
from __future__ import annotations

import torch

from pretrain.config import ConfigError, ModelConfig
from pretrain.model.gpt import GPT
from pretrain.model.registry import build_model

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _check_dense(cfg: ModelConfig) -> None:
    if cfg.variant != "dense":
        raise ConfigError(f"only dense models convert to GPT2LMHeadModel, got variant={cfg.variant!r}")


def hf_config(cfg: ModelConfig):
    from transformers import GPT2Config

    _check_dense(cfg)
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                      n_layer=cfg.parsed_layout.prelude, n_head=cfg.n_heads, n_inner=cfg.mlp_ratio * cfg.d_model,
                      activation_function="gelu_new", layer_norm_epsilon=cfg.layer_norm_eps,
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                      tie_word_embeddings=cfg.tie_embeddings)


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our dense state dict -> GPT2LMHeadModel's (missing biases become zeros)."""
    cfg = model.cfg
    _check_dense(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if name.startswith("prelude."):
            _, i, rest = name.split(".", 2)
            key = f"transformer.h.{i}.{rest}"
            if rest in _CONV1D:
                tensor = tensor.t()
        elif name.startswith(("wte.", "wpe.", "ln_f.")):
            key = f"transformer.{name}"
        elif name == "lm_head.weight":
            key = name
        else:
            raise KeyError(f"unexpected parameter {name!r} in a dense model")
        if name in ("wte.weight", "lm_head.weight"):
            tensor = tensor[: cfg.vocab_size]
        out[key] = tensor.contiguous()
    if not cfg.bias:  # HF always has biases: zeros are the same function
        hf_keys = set(hf_model_keys(cfg))
        for key in hf_keys - set(out):
            if key.endswith(".bias"):
                weight = out[key[: -len("bias")] + "weight"]
                out[key] = torch.zeros(weight.shape[-1] if key.split(".")[-2] in ("c_attn", "c_proj", "c_fc") else weight.shape[0])
    return out


def hf_model_keys(cfg: ModelConfig) -> list[str]:
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        return list(GPT2LMHeadModel(hf_config(cfg)).state_dict())


def to_hf(model: GPT):
    """A GPT2LMHeadModel with our dense model's weights."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_config(model.cfg))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [k for k in missing if not k.endswith("attn.bias") and not k.endswith("masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"conversion to GPT2LMHeadModel failed: missing {missing}, unexpected {unexpected}")
    return hf


def from_hf(hf_model, **overrides) -> GPT:
    """Our dense model with a GPT2LMHeadModel's weights (HF conventions: biases on)."""
    c = hf_model.config
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation_function={c.activation_function!r}: only GPT-2's tanh GELU converts")
    cfg = ModelConfig(name=overrides.pop("name", "hf-gpt2"), variant="dense", layout=str(c.n_layer),
                      d_model=c.n_embd, n_heads=c.n_head, vocab_size=c.vocab_size, pad_vocab_multiple=1,
                      max_seq_len=c.n_positions, bias=True, layer_norm_eps=c.layer_norm_epsilon,
                      mlp_ratio=(c.n_inner or 4 * c.n_embd) // c.n_embd, **overrides)
    model = build_model(cfg)
    ours = {}
    for key, tensor in hf_model.state_dict().items():
        if key.endswith(("attn.bias", "attn.masked_bias")) and tensor.dtype == torch.bool:
            continue
        name = key.removeprefix("transformer.")
        if name.startswith("h."):
            _, i, rest = name.split(".", 2)
            name = f"prelude.{i}.{rest}"
            if rest in _CONV1D:
                tensor = tensor.t()
        ours[name] = tensor
    model.load_state_dict(ours, strict=True)
    return model
