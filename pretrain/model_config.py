"""The one typed model config, its layout string, and JSON round trip.

A layout says where the loop sits in the stack (`P` prelude blocks run once, a shared
core of `C` blocks looped `R` times, `K` coda blocks run once):

    placement  written                  canonical (saved in configs)
    dense      N                        N            N blocks run once, no loop
    whole      CxR  (or 0+CxR+0)        CxR          the whole stack looped: no prelude, no coda
    middle     P+CxR+K                  P+CxR+K      prelude, loop, coda (the GRT's)
    bottom     CxR+K  (or 0+CxR+K)      0+CxR+K      the loop first: no prelude
    top        P+CxR  (or P+CxR+0)      P+CxR+0      the loop last: no coda

C, R and N must be at least 1; P and K may be 0. `ModelConfig` stores the canonical
form (`str(parse_layout(text))`), so a config file, a checkpoint and `grt presets` show
one spelling per layout. Without a prelude the anchor `e` is the prelude's output all
the same: an empty prelude returns its input, so `e` is the embeddings (token plus
position) of a `CxR` or `0+CxR+K` model. Without a coda the exit norm, the final norm
and the head follow the loop's last state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from pretrain.variants import get_variant

ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn", "naive")
STATE_DTYPES = ("fp32", "weights")
CORE_KV = ("step", "anchor")  # where a GRT core block's keys and values come from (ModelConfig.core_kv)
ANCHOR_MODES = ("prelude", "zeros", "embeddings", "previous")
PROJ_INITS = ("random", "residual")  # how W_proj starts (ModelConfig.proj_init)
NOISE_SCALES = ("absolute", "relative")  # what eps_x's std is measured against (ModelConfig.state_noise_scale)
# where the vocabulary's padding is decided (ModelConfig.pad_vocab_multiple's default): every preset and
# built model pads to it; a config saved with another multiple (1: a checkpoint from before) keeps its own
VOCAB_PAD_MULTIPLE = 64


def padded_vocab(vocab: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """The head's rows for a vocabulary of `vocab` tokens: the next multiple of `multiple`."""
    return (vocab + multiple - 1) // multiple * multiple


PLACEMENTS = ("whole", "middle", "bottom", "top")  # where the loop sits (Layout.placement; "dense": no loop)


@dataclass(frozen=True)
class Layout:
    prelude: int
    core: int
    loops: int
    coda: int

    @property
    def looped(self) -> bool:
        return self.core > 0

    @property
    def placement(self) -> str:
        """Where the loop sits: whole (no prelude, no coda), middle, bottom (no prelude), top
        (no coda), or dense (no loop)."""
        if not self.looped:
            return "dense"
        if self.prelude and self.coda:
            return "middle"
        if self.coda:
            return "bottom"
        return "top" if self.prelude else "whole"

    @property
    def unique_blocks(self) -> int:
        return self.prelude + self.core + self.coda

    def effective_depth(self, loops: int | None = None) -> int:
        r = self.loops if loops is None else loops
        return self.prelude + self.core * r + self.coda

    def __str__(self) -> str:
        """The canonical form: `N`, `CxR`, or `P+CxR+K` with a missing prelude or coda written 0."""
        if not self.looped:
            return str(self.prelude)
        if self.prelude == 0 and self.coda == 0:
            return f"{self.core}x{self.loops}"
        return f"{self.prelude}+{self.core}x{self.loops}+{self.coda}"


_DENSE = re.compile(r"^(\d+)$")
_LOOPED = re.compile(r"^(?:(\d+)\+)?(\d+)x(\d+)(?:\+(\d+))?$")  # [P+]CxR[+K]
ACCEPTED_LAYOUTS = (
    "accepted forms: 'N' (dense), 'CxR' (whole stack looped), 'P+CxR+K' (middle: prelude + core x loops + coda), "
    "'CxR+K' or '0+CxR+K' (bottom: no prelude), 'P+CxR' or 'P+CxR+0' (top: no coda)"
)


def parse_layout(text: str) -> Layout:
    """Parse `N`, `CxR`, `P+CxR+K`, `CxR+K` (= `0+CxR+K`) or `P+CxR` (= `P+CxR+0`); errors are
    one line that quotes the string and says what is wrong. `str()` of the result is the
    canonical form."""
    if not isinstance(text, str):
        raise ConfigError(f"layout must be a string like '1+5x6+5', got {text!r}")
    s = text.strip().replace("×", "x").replace("X", "x").replace(" ", "")
    m = _DENSE.match(s)
    if m:
        if int(m[1]) == 0:
            raise ConfigError(f"layout {text!r}: a dense layout needs at least 1 block; {ACCEPTED_LAYOUTS}")
        return Layout(int(m[1]), 0, 0, 0)
    m = _LOOPED.match(s)
    if not m:
        raise ConfigError(f"layout {text!r} does not parse; {ACCEPTED_LAYOUTS}")
    prelude, core, loops, coda = (int(g) if g is not None else 0 for g in m.groups())
    zero = [name for name, v in (("core", core), ("loops", loops)) if v == 0]
    if zero:
        raise ConfigError(
            f"layout {text!r}: {' and '.join(zero)} must be at least 1 (only the prelude P and the coda K may be 0); "
            f"{ACCEPTED_LAYOUTS}"
        )
    return Layout(prelude, core, loops, coda)


def canonical_layout(text: str) -> str:
    """The one spelling of a layout that configs store: `N`, `CxR` or `P+CxR+K` (zeros written)."""
    return str(parse_layout(text))


@dataclass
class ModelConfig:
    """Everything that defines a model's function and parameter shapes."""

    name: str = "custom"
    variant: str = "grt"  # pretrain/variants/: dense, grt (loop only: grt with its switches off) or a baseline
    layout: str = "1+2x4+1"
    d_model: int = 128
    n_heads: int = 4
    vocab_size: int = 50257
    # the head's rows padded to a multiple of this (64: 50257 -> 50304, nanoGPT's), so that its matmuls run
    # at an aligned width; the padded logits are masked out of the loss and sliced off every output
    pad_vocab_multiple: int = VOCAB_PAD_MULTIPLE
    max_seq_len: int = 1024
    bias: bool = False  # biases in linears and LayerNorms (HF GPT-2: True)
    tie_embeddings: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    mlp_ratio: int = 4
    # GRT switches (the paper's ablation components)
    state_noise_std: float = 0.1  # eps_x added to the state before the projection (training only)
    # "absolute": eps_x ~ N(0, std^2), the paper's; "relative": std times each token's state RMS, so that the
    # noise does not drown a small-norm state (a fresh model's prelude output has RMS ~0.03: docs/model.md)
    state_noise_scale: str = "absolute"
    reinject_anchor: bool = True  # project [s + eps_x ; e] (False: the core reads s + eps_x)
    gate: bool = True  # False: s_r = o_r
    gate_noise_std: float = 0.1  # eps_g added to the gate logits (training only)
    gate_bias_init: float = 4.0  # sigmoid(4) ~ 0.982: the loop starts by barely writing
    gate_tau: float = 1.0
    # "random": W_proj ~ N(0, init_std^2), the paper's; "residual": its state half the identity and its anchor
    # half zero, so that a loop step starts as a gated residual update of the state (docs/model.md)
    proj_init: str = "random"
    exit_norm: bool = True  # LayerNorm on the loop's final state (the "one more d vector")
    state_dtype: str = "fp32"  # the GRT's loop state s: fp32 whatever the weights' dtype (under bf16 the gate's
    # ~2% writes would be rounded to bf16's 0.4% spacing), or the weights' (docs/model.md)
    # "step": each core block's keys and values come from its own input at every loop step; "anchor" (CART):
    # from the anchor e, the state every step is fed, once per forward (docs/model.md)
    core_kv: str = "step"
    attention: str = "auto"  # auto | sdpa | flash_attn | naive
    init_std: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)  # variant-specific settings (baselines)

    def __post_init__(self) -> None:
        self.validate()

    # -- derived -----------------------------------------------------------------
    @property
    def parsed_layout(self) -> Layout:
        return parse_layout(self.layout)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab(self.vocab_size, self.pad_vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def max_loops(self) -> int:
        return self.parsed_layout.loops

    # -- checks ------------------------------------------------------------------
    def validate(self) -> None:
        """Refuse a bad config with one line naming the setting; writes `layout` in its
        canonical form (`canonical_layout`: '2x4+2' is stored as '0+2x4+2')."""
        variant = get_variant(self.variant)
        # its own message before the variant's layout rule; stored in its canonical form
        self.layout = canonical_layout(self.layout)
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention={self.attention!r}: accepted values are {', '.join(ATTENTION_BACKENDS)}")
        if self.state_dtype not in STATE_DTYPES:
            raise ConfigError(f"state_dtype={self.state_dtype!r}: accepted values are {', '.join(STATE_DTYPES)}")
        if self.core_kv not in CORE_KV:
            raise ConfigError(f"core_kv={self.core_kv!r}: accepted values are {', '.join(CORE_KV)}")
        if self.proj_init not in PROJ_INITS:
            raise ConfigError(f"proj_init={self.proj_init!r}: accepted values are {', '.join(PROJ_INITS)}")
        if self.proj_init == "residual" and not self.reinject_anchor:
            raise ConfigError("proj_init='residual' starts W_proj, which reinject_anchor=false leaves out: set one")
        if self.state_noise_scale not in NOISE_SCALES:
            raise ConfigError(
                f"state_noise_scale={self.state_noise_scale!r}: accepted values are {', '.join(NOISE_SCALES)}"
            )
        for key in ("d_model", "n_heads", "vocab_size", "pad_vocab_multiple", "max_seq_len", "mlp_ratio"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key}={value!r}: must be a positive integer")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for key in (
            "state_noise_std",
            "gate_noise_std",
            "dropout",
            "gate_bias_init",
            "gate_tau",
            "layer_norm_eps",
            "init_std",
        ):
            if not math.isfinite(getattr(self, key)):
                raise ConfigError(f"{key}={getattr(self, key)!r}: must be a finite number")
        for key in ("state_noise_std", "gate_noise_std", "dropout"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)!r}: must be >= 0")
        if self.dropout >= 1:
            raise ConfigError(f"dropout={self.dropout!r}: must be < 1 (the share of activations dropped)")
        for key in ("layer_norm_eps", "init_std"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)!r}: must be > 0")
        if self.gate_tau <= 0:
            raise ConfigError(f"gate_tau={self.gate_tau!r}: must be > 0")
        variant.check(self)

    def train_recipe(self) -> dict[str, Any]:
        """The training settings the model's method trains with (its Variant's recipe: depth sampling
        and its parameters), for the model as configured (Huginn's Poisson mean follows its R)."""
        return get_variant(self.variant).train_recipe(self)

    def xget(self, key: str) -> Any:
        """A variant setting from `extra`, or its default (the variant's `extra`, pretrain/variants/)."""
        return get_variant(self.variant).setting(self, key)

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**check_keys(cls, data, "model config"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(load_json_object(path, f"model config {str(path)!r}"))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **check_keys(type(self), changes, "model config"))


def load_json_object(path: str | Path, what: str, missing_hint: str = "") -> dict[str, Any]:
    """Read a JSON object from `path`; a missing file, bad JSON or a non-object is a
    ConfigError that names `what` (e.g. "ds_config='x.json'")."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what}: no such file{missing_hint}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{what}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: must hold a JSON object")
    return data


def check_keys(cls: type, data: dict[str, Any], what: str, prefix: str = "") -> dict[str, Any]:
    """Refuse unknown keys and wrong types, naming the key (`prefix` first: "train.") and the accepted
    values."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {', '.join(unknown)}; accepted keys: {', '.join(fields)}")
    out = {}
    for key, value in data.items():
        out[key] = coerce(prefix + key, value, fields[key].type)
    return out


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def coerce(key: str, value: Any, type_name: Any) -> Any:
    """Check (and gently coerce: int -> float, '3' -> 3 from the command line) one value."""
    name = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
    target = _TYPES.get(name.split("|")[0].strip())
    if target is None:
        return tuple(value) if name.startswith("tuple") and isinstance(value, list) else value  # JSON's list
    if isinstance(value, str) and target is not str:
        text = value.strip()
        try:
            if target is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return text.lower() in ("true", "1", "yes", "on")
            return target(text)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected {name}") from None
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if target is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if target is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if target in (float, str) and not isinstance(value, target):
        raise ConfigError(f"{key}={value!r}: expected {name}")
    return value


class OnceParser(argparse.ArgumentParser):
    """An argument parser whose single-value flags (`--data PATH`) refuse to be given twice: argparse
    keeps the last one silently, so `--data a --data b` would score b alone (issue #40). Flags with
    their own action (append, store_true, ...) are as they were."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if args and str(args[0]).startswith("-") and kwargs.get("action") in (None, "store"):
            kwargs["action"] = _Once
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.__dict__.pop("_flags_given", None)
        return parsed, rest


class _Once(argparse.Action):
    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        seen: set[str] = namespace.__dict__.setdefault("_flags_given", set())
        if self.dest in seen:
            parser.error(
                f"argument {'/'.join(self.option_strings)}: given twice ({getattr(namespace, self.dest)!r}, then "
                f"{values!r}); give it once"
            )
        seen.add(self.dest)
        setattr(namespace, self.dest, values)
