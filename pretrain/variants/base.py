"""`Variant`: what the system knows about one model variant beyond its torch code.

A variant's object answers, torch-free, every question that other modules used to answer by
testing the variant's name: which settings its config takes and how they are checked, how it
is named in tables, its training recipe, how its random perturbations are switched off, its
forward FLOPs per token and the activations it keeps for the backward (the terms; the sums
are done once in pretrain/model/flops.py and pretrain/training/engine/parallelize.py), and whether
per-token adaptive exit applies to it. Its torch module is the class decorated with
`@builds(name)` (pretrain/model/gpt.py), which pretrain.model.build_model builds.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from grt_common.errors import ConfigError
from pretrain.variants.model_spec import ModelSpec

M = TypeVar("M", bound=ModelSpec)  # noise_off returns the config type it is given


def block_flops(cfg: ModelSpec, seq_len: int, share: float = 1.0) -> float:
    """One transformer block per token: the matmuls (qkv 6 d^2, attention out 2 d^2, MLP
    2 * 2 * mlp_ratio d^2) plus the attention scores and values over the keys it sees,
    4 S d at full (unmasked) length; `share` of the sequence for tokens gathered from it."""
    d = cfg.d_model
    return (8 + 4 * cfg.mlp_ratio) * d * d + 4 * share * seq_len * d


def projection_and_gate_flops(cfg: ModelSpec) -> float:
    """Per token and loop step: the projection W_proj [s; e] (4 d^2) and the gate MLP (6 d^2:
    2d -> d -> d), those of the two the config has."""
    d = cfg.d_model
    return (4 * d * d if cfg.reinject_anchor else 0) + (6 * d * d if cfg.gate else 0)


class Variant:
    """The default answers, those of a plain looped model: every loop step runs the whole core
    on every token, differentiated, and the state is decoded once."""

    name: ClassVar[str]
    label: ClassVar[str]  # the method's name in `grt compare`'s table
    looped: ClassVar[bool] = True  # a layout with a loop ('P+CxR+K' or 'CxR'), or a dense one ('N')
    extra: ClassVar[dict[str, Any]] = {}  # the settings it reads from ModelConfig.extra, with their defaults
    noise_extra: ClassVar[dict[str, Any]] = {}  # the extra settings that switch its own noise off
    adaptive_exit_refusal: ClassVar[str | None] = None  # why per-token adaptive exit does not apply, or None
    learned_exit: ClassVar[bool] = False  # it learns where each token exits (grt compare scores that exit)
    decodes_every_step: ClassVar[bool] = False  # training decodes (coda, head, logits) after every loop step
    anchored_kv: ClassVar[bool] = False  # it builds core_kv='anchor' (keys and values of the anchor)
    hf_gpt2: ClassVar[bool] = False  # GPT-2's function: `grt export` writes transformers' GPT2LMHeadModel
    preset_extra: ClassVar[dict[str, Any]] = {}  # the extra settings of its micro and tiny presets

    # -- the config ----------------------------------------------------------------------------
    def check(self, cfg: ModelSpec) -> None:
        """Refuse a config this variant cannot build, with one line that names the setting."""
        layout = cfg.parsed_layout
        if self.looped and not layout.looped:
            raise ConfigError(f"variant={self.name!r} needs a looped layout like '1+5x6+5', got layout={cfg.layout!r}")
        if not self.looped and layout.looped:
            raise ConfigError(f"variant={self.name!r} needs a dense layout like '12', got layout={cfg.layout!r}")
        if cfg.core_kv != "step" and not self.anchored_kv:
            takers = [name for name, v in REGISTRY.items() if v.anchored_kv]
            raise ConfigError(
                f"core_kv={cfg.core_kv!r}: variant={self.name!r} computes each loop step's keys and values "
                f"(core_kv='anchor' is for the variants {', '.join(takers)})"
            )
        if not self.extra:
            if cfg.extra:
                takers = [name for name, v in REGISTRY.items() if v.extra]
                raise ConfigError(
                    f"extra={cfg.extra!r}: variant={self.name!r} takes no extra settings "
                    f"(they are for the variants {', '.join(takers)})"
                )
            return
        unknown = sorted(set(cfg.extra) - set(self.extra))
        if unknown:
            accepted = ", ".join(f"{k} (default {v})" for k, v in self.extra.items())
            raise ConfigError(f"extra key(s) {', '.join(unknown)} for variant={self.name!r}; accepted keys: {accepted}")
        for key, value in cfg.extra.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"extra.{key}={value!r}: must be a number >= 0")
        self.check_extra(cfg)

    def check_extra(self, cfg: ModelSpec) -> None:
        """The variant's own rules for its extra settings (their keys and signs are checked)."""

    def setting(self, cfg: ModelSpec, key: str) -> Any:
        """An extra setting of cfg, or its default."""
        return cfg.extra.get(key, self.extra.get(key))

    def switches(self) -> dict[str, Any]:
        """The ModelConfig settings its presets need (those its check requires)."""
        return {}

    def describe(self, cfg: ModelSpec) -> str:
        """The method's name for cfg in tables."""
        return self.label

    def train_recipe(self, cfg: ModelSpec) -> dict[str, Any]:
        """The training settings (TrainConfig keys) this method trains with, for the model cfg:
        applied when a run picks the model, before the user's own settings."""
        return {}

    def noise_off(self, cfg: M) -> M:
        """The same model with every random perturbation of training off (gradient checks)."""
        return cfg.replace(state_noise_std=0.0, gate_noise_std=0.0, extra={**cfg.extra, **self.noise_extra})

    # -- the work of a training step (sums: pretrain/model/flops.py, pretrain/training/engine/parallelize.py)
    def step_shares(self, cfg: ModelSpec, steps: int) -> list[float]:
        """The share of the tokens each of `steps` loop steps runs the core on."""
        return [1.0] * steps

    def block_extra_flops(self, cfg: ModelSpec) -> float:
        """FLOPs per token a core block adds to its transformer block, per loop step."""
        return 0.0

    def step_extra_flops(self, cfg: ModelSpec) -> float:
        """FLOPs per token a loop step adds to its core blocks, over every token."""
        return 0.0

    def loop_flops(self, cfg: ModelSpec, seq_len: int, steps: int, executed: bool) -> float:
        """Forward FLOPs per token of `steps` loop steps. executed: what the implementation runs
        (less than the formula where it computes a term once per forward)."""
        core = cfg.parsed_layout.core
        return sum(
            share * core * (block_flops(cfg, seq_len, share) + self.block_extra_flops(cfg)) + self.step_extra_flops(cfg)
            for share in self.step_shares(cfg, steps)
        )

    def no_grad_steps(self, cfg: ModelSpec, depth: int) -> int:
        """Loop steps of a training forward at `depth` that run without autograd (kept nothing): truncated
        backprop, all but the last k = extra.backprop_steps, for the variants that take it (0: none)."""
        k = int(self.setting(cfg, "backprop_steps")) if "backprop_steps" in self.extra else 0
        return max(0, depth - k) if k else 0

    def training_decodes(self, steps: int) -> int:
        """Decodes (exit norm, coda, final norm, head) of a training forward of `steps` loop steps."""
        return max(steps, 1) if self.decodes_every_step else 1

    def block_extra_bytes(self, cfg: ModelSpec, dtype_bytes: int) -> tuple[int, int]:
        """Bytes per token a core block keeps beyond a transformer block's: (everything, under
        selective checkpointing)."""
        return 0, 0

    def outside_loop_bytes(self, cfg: ModelSpec, shares: list[float], dtype_bytes: int) -> float:
        """Bytes per token kept around the loop steps, outside what checkpointing recomputes."""
        return 0.0


class Baseline(Variant):
    """A comparison baseline (pretrain/model/baselines.py): no GRT gate, no state noise, the
    anchor re-injected only where the method's loop step reads [s; e]."""

    reinjects_anchor: ClassVar[bool] = False

    def check(self, cfg: ModelSpec) -> None:
        super().check(cfg)
        if cfg.gate or cfg.state_noise_std:
            raise ConfigError(
                f"variant={self.name!r} has no GRT gate and no state noise: set gate=false and "
                f"state_noise_std=0 (the presets micro-{self.name} and tiny-{self.name} do)"
            )
        if cfg.reinject_anchor != self.reinjects_anchor:
            raise ConfigError(
                f"variant={self.name!r}: reinject_anchor must be {self.reinjects_anchor} "
                "(only Huginn's adapter reads [s; e])"
            )

    def switches(self) -> dict[str, Any]:
        return {"gate": False, "state_noise_std": 0.0, "reinject_anchor": self.reinjects_anchor}


REGISTRY: dict[str, Variant] = {}

V = TypeVar("V", bound=type[Variant])


def register(cls: V) -> V:
    """Class decorator: make the variant `cls.name` known to every command."""
    REGISTRY[cls.name] = cls()
    return cls


def get_variant(name: str) -> Variant:
    if name not in REGISTRY:
        raise ConfigError(f"variant={name!r}: accepted values are {', '.join(REGISTRY)}")
    return REGISTRY[name]
