"""Load a trained model without DeepSpeed's engine: from an exported directory
(`grt export`) or straight from a training checkpoint (consolidated in memory).

Shared by `grt export`, `grt eval`, `grt generate`, `grt analyze` and the decode
benchmark, so every command accepts the same paths:

    <export dir>                         config.json (ModelConfig) + model.safetensors
    <out>                                a run directory (uses <out>/checkpoints/latest)
    <out>/checkpoints                    the newest COMPLETE checkpoint
    <out>/checkpoints/stepNNNNNNNN       that checkpoint
    s3://bucket/run[/checkpoints/stepN]  a run's checkpoint mirror (train.checkpoint_mirror), downloaded once

Tied embeddings are stored once (`wte.weight`); `lm_head.weight` is re-tied on load.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grt_common.errors import ConfigError
from pretrain.model import GPT, build_model
from pretrain.model.weights import TIED_KEY
from pretrain.model_config import ModelConfig
from pretrain.runs.checkpoint_files import named_checkpoint, newest_checkpoint, read_config
from pretrain.runs.checkpoint_mirror import is_mirror_url, local_copy
from pretrain.runs.trusted_files import read_through_all, weights_only_loads

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture
    from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


@dataclass
class LoadedModel:
    model: GPT
    cfg: ModelConfig
    tokenizer_path: str | None  # the tokenizer to encode text with: --tokenizer, else the model's own
    run_config: dict[str, Any] = field(default_factory=dict)  # the training run config, if known
    source: str = ""  # "export" or "checkpoint"
    path: str = ""  # the directory the weights came from
    own_tokenizer_path: str | None = None  # tokenizer.model next to the weights: the one it was trained with
    warned_unchecked: bool = False  # the warning of `_trusted_tokenizer` was printed

    def tokenizer_sha256(self) -> str | None:
        """The model's tokenizer identity: its own tokenizer.model, else the one given (see
        `_trusted_tokenizer`: said once, in one line)."""
        from data_pipeline.tokenizer import file_sha256

        path = self.own_tokenizer_path or self.tokenizer_path
        return file_sha256(path) if path and Path(path).is_file() else None

    def _trusted_tokenizer(self) -> None:
        """A model without its tokenizer.model, given --tokenizer: nothing can show that the
        given one is the model's, so it is taken on trust, and said so once (one line, rank 0)."""
        from pretrain.distributed import is_main

        if self.own_tokenizer_path is None and self.tokenizer_path and not self.warned_unchecked:
            self.warned_unchecked = True
            if is_main():
                print(
                    f"grt: warning: the model {self.path!r} has no tokenizer.model, so nothing shows that "
                    f"--tokenizer {self.tokenizer_path!r} is the one it was trained with; it is taken on trust",
                    file=sys.stderr,
                    flush=True,
                )

    def tokenizer(self) -> Tokenizer:
        """The tokenizer to encode text with, refused unless it is the model's (tokenizer identity)."""
        from data_pipeline.tokenizer import Tokenizer
        from pretrain.runs.identity import check_same_tokenizer

        if not self.tokenizer_path:
            raise ConfigError(f"{self.path}: no tokenizer.model next to the model; pass --tokenizer")
        try:
            tok = Tokenizer(self.tokenizer_path)
        except RuntimeError as err:  # SentencePiece's word for a file it cannot read
            raise ConfigError(f"tokenizer {self.tokenizer_path!r} is not a SentencePiece model ({err})") from None
        self._trusted_tokenizer()
        check_same_tokenizer(
            tok.sha256,
            tok.vocab_size,
            f"--tokenizer {self.tokenizer_path!r}",
            self.tokenizer_sha256(),
            self.cfg.vocab_size,
            f"the model {self.path!r}",
        )
        return tok

    def check_data(self, manifest: str) -> Manifest | DataMixture:
        """The manifest, refused if its shards were made with another tokenizer than the model's
        or hold token ids beyond its vocabulary (before any tensor is built). A model without its
        tokenizer.model is refused unless --tokenizer names it: with the vocabulary size alone,
        data of another tokenizer of that size would give a plausible, meaningless loss."""
        from pretrain.runs.data_spec import load_manifest
        from pretrain.runs.identity import check_same_tokenizer

        m = load_manifest(manifest)
        if self.own_tokenizer_path is None and not self.tokenizer_path:
            raise ConfigError(
                f"the model {self.path!r} has no tokenizer.model, so data={manifest!r} cannot be checked against "
                "the tokenizer it was trained with; pass --tokenizer with that tokenizer.model (or copy it "
                "next to the model)"
            )
        self._trusted_tokenizer()
        check_same_tokenizer(
            m.tokenizer_sha256,
            m.vocab_size,
            f"data={manifest!r}",
            self.tokenizer_sha256(),
            self.cfg.vocab_size,
            f"the model {self.path!r}",
        )
        return m


def is_export_dir(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / "config.json").is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir, a checkpoints dir or a step dir -> the step dir of a COMPLETE checkpoint."""
    if is_mirror_url(str(path)):  # a run's checkpoint mirror: downloaded once, then read as a local one
        return local_copy(str(path))
    accepted = f"neither an exported model (config.json + {WEIGHTS}) nor a checkpoint"
    root, tag_dir = named_checkpoint(path, "", accepted)
    return tag_dir or newest_checkpoint(root, "")


def consolidate(step_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 state dict of a DeepSpeed checkpoint (ZeRO stage 0-3), on CPU, without a process group.
    Its files are read through first and loaded weights-only (nothing in them runs; one line
    refuses one that holds more), and the checkpoint read is said in one line."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from pretrain.distributed import is_main

    read_through_all(step_dir)
    if is_main():  # a progress line (": start: ", tests/commands.py), not the command's output or error
        print(f"grt: start: loading checkpoint {step_dir}", file=sys.stderr, flush=True)
    # its progress bars only where someone watches: in a log or a pipe they are lines of noise
    quiet = contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO())
    with quiet, contextlib.redirect_stdout(sys.stderr), weights_only_loads():  # its lines: not the output
        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def upgrade_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints written before the loop step split W_proj and the gate's first layer into
    state and anchor halves (W [s; e] = W_s s + W_e e) load into the current model."""
    state = dict(state)
    if "loop.proj.weight" in state:
        w = state.pop("loop.proj.weight")
        d = w.shape[1] // 2
        state["loop.proj_state.weight"], state["loop.anchor.proj.weight"] = w[:, :d].clone(), w[:, d:].clone()
    if "loop.gate_fc.weight" in state:
        w = state.pop("loop.gate_fc.weight")
        d = w.shape[1] // 2
        state["loop.gate_fc_state.weight"], state["loop.anchor.gate_fc.weight"] = w[:, :d].clone(), w[:, d:].clone()
        if "loop.gate_fc.bias" in state:
            state["loop.gate_fc_state.bias"] = state.pop("loop.gate_fc.bias")
    for suffix in ("weight", "bias"):
        if f"loop.gate_norm_anchor.{suffix}" in state:
            state[f"loop.anchor.gate_norm.{suffix}"] = state.pop(f"loop.gate_norm_anchor.{suffix}")
    return state


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> GPT:
    """Build the model and load weights; a tied lm_head may be absent (it is the embedding)."""
    model = build_model(cfg)
    state = upgrade_state_dict(state) if "loop.proj_state.weight" in model.state_dict() else dict(state)
    if cfg.tie_embeddings:
        state.pop(TIED_KEY, None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == TIED_KEY)]
    if missing or unexpected:
        raise ConfigError(f"the weights do not fit the model config: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.wte.weight
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def meta_model(cfg: ModelConfig) -> GPT:
    """The model of cfg on the meta device: its structure without memory or weights."""
    with torch.device("meta"):
        return build_model(cfg).eval()


def read_weights(path: Path, header_only: bool = False) -> dict[str, torch.Tensor]:
    """An export's weights (safetensors: data only, nothing in it runs); ConfigError (one line) for
    a file cut off or not in the format. header_only: its header and size checked, nothing read
    (what a command checks before it loads the weights)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        if header_only:
            with safe_open(str(path), framework="pt"):
                return {}
        return load_file(str(path))
    except SafetensorError as err:
        raise ConfigError(f"{path} is cut off or not a safetensors file ({err}): export the model again") from None


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    tokenizer: str | None = None,
    weights: bool = True,
) -> LoadedModel:
    """Load an exported directory or a checkpoint (see module doc), in eval mode. weights=False: the
    model built on the meta device, its weights not read (what a command checks before loading them)."""
    p = resolve_checkpoint(path) if is_mirror_url(str(path)) else Path(path)
    if not p.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if is_export_dir(p):
        cfg = ModelConfig.load(p / "config.json")
        state = read_weights(p / WEIGHTS, header_only=not weights)
        model = model_from_state(cfg, state, dtype) if weights else meta_model(cfg)
        run_cfg = json.loads((p / "run_config.json").read_text()) if (p / "run_config.json").is_file() else {}
        source, where = "export", p
    else:
        where = resolve_checkpoint(p)
        run_cfg = read_config(where)  # missing, cut off or corrupt: one line
        if "model" not in run_cfg:
            raise ConfigError(f"{where / 'config.json'} is not a run config (no 'model' key)")
        cfg = ModelConfig.from_dict(run_cfg["model"])
        model = model_from_state(cfg, consolidate(where), dtype) if weights else meta_model(cfg)
        source = "checkpoint"
    own = str(where / "tokenizer.model") if (where / "tokenizer.model").is_file() else None
    if weights:
        model.to(device)
    return LoadedModel(
        model=model,
        cfg=cfg,
        tokenizer_path=tokenizer or own,
        run_config=run_cfg,
        source=source,
        path=str(where),
        own_tokenizer_path=own,
    )


def pick_device(name: str = "auto") -> torch.device:
    """`--device` of every inference command: ConfigError (one line) for a name torch does not
    know, or CUDA where there is none."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device here (use --device cpu or auto)")
    return device


DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "", "auto"):
        return None
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r}: accepted values are auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype | None:
    """The dtype a command runs a loaded model in: `name` when given; for auto, bf16 on a GPU
    that has it (half the memory and bandwidth of fp32, and the tensor cores; the losses are
    computed in fp32 from its logits), else None: the stored dtype."""
    dtype = parse_dtype(name)
    if dtype is None and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return dtype
