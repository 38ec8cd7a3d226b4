"""Hugging Face copies of our models, written by `grt export` into <export>/hf/.

Dense: transformers' own GPT2LMHeadModel. Both are the same function (pre-norm, learned
positions, tanh GELU, tied embeddings); HF stores linear weights as Conv1D ([in, out]),
hence the transposes.

Looped (the GRT and every baseline): remote code for
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`. transformers copies
only the files of that folder, so the model's code has to travel with it; rather than a
second, hand-written model that could drift from ours, the export vendors the project's own
source (pretrain/model/gpt.py, layers.py, baselines.py, the KV cache and what they import,
found by following their `from pretrain... import` lines) with those imports made relative,
next to the thin wrapper in pretrain/model/hf_remote/. One source of truth: what trains is
what transformers runs.

Both get an HF tokenizer beside them, from the layer that has one (pretrain/infer/hf_export.py:
the model never reads the data side); here, only its separator's id.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grt_common.errors import ConfigError
from pretrain import PROJECT_ROOT
from pretrain.model.gpt import GPT
from pretrain.model.registry import build_model
from pretrain.model_config import ModelConfig
from pretrain.variants import REGISTRY, get_variant

if TYPE_CHECKING:
    from transformers import GPT2Config, GPT2LMHeadModel

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _check_dense(cfg: ModelConfig) -> None:
    if not get_variant(cfg.variant).hf_gpt2:
        takers = ", ".join(name for name, v in REGISTRY.items() if v.hf_gpt2)
        raise ConfigError(f"only the variants {takers} convert to GPT2LMHeadModel, got variant={cfg.variant!r}")


def hf_config(cfg: ModelConfig) -> GPT2Config:
    from transformers import GPT2Config

    _check_dense(cfg)
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.parsed_layout.prelude,
        n_head=cfg.n_heads,
        n_inner=cfg.mlp_ratio * cfg.d_model,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.layer_norm_eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings,
    )


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
                out[key] = torch.zeros(
                    weight.shape[-1] if key.split(".")[-2] in ("c_attn", "c_proj", "c_fc") else weight.shape[0]
                )
    return out


def hf_model_keys(cfg: ModelConfig) -> list[str]:
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        return list(GPT2LMHeadModel(hf_config(cfg)).state_dict())


def to_hf(model: GPT) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with our dense model's weights."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_config(model.cfg))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [k for k in missing if not k.endswith("attn.bias") and not k.endswith("masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"conversion to GPT2LMHeadModel failed: missing {missing}, unexpected {unexpected}")
    return hf


def from_hf(hf_model: GPT2LMHeadModel, **overrides: Any) -> GPT:
    """Our dense model with a GPT2LMHeadModel's weights (HF conventions: biases on)."""
    c = hf_model.config
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation_function={c.activation_function!r}: only GPT-2's tanh GELU converts")
    cfg = ModelConfig(
        name=overrides.pop("name", "hf-gpt2"),
        variant="dense",
        layout=str(c.n_layer),
        d_model=c.n_embd,
        n_heads=c.n_head,
        vocab_size=c.vocab_size,
        max_seq_len=c.n_positions,
        bias=True,
        layer_norm_eps=c.layer_norm_epsilon,
        mlp_ratio=(c.n_inner or 4 * c.n_embd) // c.n_embd,
        **overrides,
    )
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
        if name in ("wte.weight", "lm_head.weight"):  # zero rows up to the padded vocabulary (masked in the loss)
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, cfg.padded_vocab_size - cfg.vocab_size))
        ours[name] = tensor
    model.load_state_dict(ours, strict=True)
    return model


# -- looped models: remote code ---------------------------------------------------------------
REMOTE_TEMPLATES = Path(__file__).parent / "hf_remote"  # configuration_grt.py, modeling_grt.py
VENDOR_ROOTS = ("pretrain.model.registry", "pretrain.infer.kv_cache")  # what modeling_grt.py imports
_PROJECT_IMPORT = re.compile(r"^(\s*)from ((?:pretrain|grt_common)(?:\.\w+)*) import ", re.M)
_IMPORTED_NAMES = re.compile(r"^\s*from ((?:pretrain|grt_common)(?:\.\w+)*) import \(?([\w\s,]+)\)?", re.M)
AUTO_MAP = {"AutoConfig": "configuration_grt.GRTConfig", "AutoModelForCausalLM": "modeling_grt.GRTForCausalLM"}


def _vendored_file(module: str) -> str:
    return f"grt_{module.rsplit('.', 1)[-1]}.py"


def refuse_module_imports(path: Path, text: str) -> None:
    """`from pretrain.pkg import module` would vendor as `from .grt_pkg import module`, which fails:
    transformers copies only the files named by `from .x import` lines, and no file holds the module."""
    for package, names in _IMPORTED_NAMES.findall(text):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue  # a module, not a package: its names cannot be modules
        for name in (n.strip().split(" as ")[0] for n in names.split(",") if n.strip()):
            if importlib.util.find_spec(f"{package}.{name}") is not None:
                raise RuntimeError(
                    f"{path}: 'from {package} import {name}' imports a module, which the exported remote code "
                    f"cannot vendor: import its names ('from {package}.{name} import ...')"
                )


def vendored_sources() -> dict[str, str]:
    """{file name: source} of the project modules the remote code needs (of pretrain/ and of the
    grt_common/ bottom it imports), imports made relative."""
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    todo = list(VENDOR_ROOTS)
    while todo:
        module = todo.pop()
        name = _vendored_file(module)
        if name in origin:
            if origin[name] != module:
                raise RuntimeError(f"{module} and {origin[name]} would both be vendored as {name}")
            continue
        origin[name] = module
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"{module}: no source file to vendor")
        path = Path(spec.origin)
        text = path.read_text()
        refuse_module_imports(path, text)
        todo += [dep for _, dep in _PROJECT_IMPORT.findall(text)]
        text = _PROJECT_IMPORT.sub(lambda m: f"{m[1]}from .{_vendored_file(m[2])[:-3]} import ", text)
        if re.search(r"^\s*(import|from) (pretrain|grt_common)\b", text, re.M):
            raise RuntimeError(
                f"{path}: an import of the project that cannot be vendored (use 'from pretrain.x import y')"
            )
        source = path.relative_to(PROJECT_ROOT).as_posix()
        header = f"# Vendored by `grt export` from {source}, its imports made relative: edit that file, not this copy."
        out[name] = f"{header}\n{text}"
    return out


def remote_config(cfg: ModelConfig, dtype: torch.dtype, sep_id: int | None) -> dict[str, Any]:
    """config.json of the remote-code model: every ModelConfig field, the trained depth R, and
    the inference settings (depth, kv_cache) that from_pretrained(..., depth=k) overrides."""
    r = cfg.max_loops
    return {
        "architectures": ["GRTForCausalLM"],
        "model_type": "grt",
        "auto_map": AUTO_MAP,
        **cfg.to_dict(),
        "trained_depth": r,
        "depth": r,
        "kv_cache": "full",
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "bos_token_id": sep_id,
        "eos_token_id": sep_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


def save_remote(model: GPT, directory: Path, sep_id: int | None) -> None:
    """The remote-code directory of a looped model: config, code, weights (tied head stored once)."""
    from safetensors.torch import save_file

    from pretrain.model.weights import state_for_saving

    directory.mkdir(parents=True, exist_ok=True)
    for name, text in vendored_sources().items():
        (directory / name).write_text(text)
    for template in ("configuration_grt.py", "modeling_grt.py"):
        shutil.copyfile(REMOTE_TEMPLATES / template, directory / template)
    dtype = next(model.parameters()).dtype
    (directory / "config.json").write_text(json.dumps(remote_config(model.cfg, dtype, sep_id), indent=2) + "\n")
    weights = {f"grt.{k}": v for k, v in state_for_saving(model).items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def save_pretrained(model: GPT, directory: Path, sep_id: int | None = None) -> None:
    """<export>/hf/: GPT2LMHeadModel for a dense model, remote code for a looped one. `sep_id`: the
    document separator of the tokenizer written there first (pretrain/infer/hf_export.py), where
    generate() stops."""
    if get_variant(model.cfg.variant).hf_gpt2:
        hf = to_hf(model.float())
        if sep_id is not None:  # GPT-2's 50256 is not our separator: generate() stops at ours
            for config in (hf.config, hf.generation_config):
                config.bos_token_id = config.eos_token_id = sep_id
        hf.save_pretrained(str(directory))
    else:
        save_remote(model, directory, sep_id)
