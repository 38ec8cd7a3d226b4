"""Whether a looped model's loop steps do work: the one verdict that training's validation,
`grt analyze` and `grt compare` all state.

The verdict is built from the depths the model is trained at. Depth 0 (prelude straight to
coda) is never trained: every depth sampler draws n >= 1, so its loss says how bad an untrained
path is, not what the loop adds; it stays in the tables as information. From depth 1 on, each
loop step's drop L(r-1) - L(r), the gain of the steps after the first, L(1) - L(R), and the step
after which the loss stops falling (a drop below MIN_STEP_DROP). A loop whose steps after the
first add less than MIN_GAIN_AFTER_FIRST reaches a fixed point after one step: its R - 1 later
steps cost compute and add nothing (docs/comparison.md, "The loop study"). Whether the first step
pays is a question for the controls (`grt compare`'s dense model of equal parameters and the same
layout at R = 1, pretrain/tools/compare/controls.py), not for the losses of one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the first depth the samplers train at (uniform 1..R, Huginn's Poisson + 1): the verdict's start;
# under train.depth_sampling=fixed it is R, and the depths below are early exits never trained
FIRST_TRAINED = 1
# a step that lowers the validation loss by less than this (nats) leaves it where it was
MIN_STEP_DROP = 0.005
# below this (nats), the steps after the first add nothing: the paper's R = 6 model falls
# 0.46 nats from depth 1 to 6 (3.14 -> 2.68); the demo's steps 2..4 add 0.011
MIN_GAIN_AFTER_FIRST = 0.02

# what to try when the later steps add nothing: (setting, value, why), each named only when the
# run does not use it already (`LoopHealth.advice`)
REMEDIES: tuple[tuple[str, Any, str], ...] = (
    (
        "train.depth_sampling",
        "fixed",
        "every step trained at depth R; tiny-grt's drops then spread over the steps, 4.58 -> 4.43 -> 4.40 -> 4.39",
    ),
    ("model.gate_bias_init", 0.0, "the gate starts at 0.5: the tiny presets' start"),
    ("model.state_noise_scale", "relative", "the state noise relative to the state's RMS"),
)


def run_settings(model: Any, depth_sampling: str | None, max_train_depth: int = 0) -> dict[str, Any]:
    """The settings of a run that the verdict reads (the depths it trains at) and `REMEDIES` names,
    from its ModelConfig (or the dict of one) and train.depth_sampling / train.max_train_depth; a
    remedy that cannot apply counts as used (a loop without a gate has no gate bias to start;
    without state noise its scale does nothing)."""
    get = model.get if isinstance(model, dict) else lambda key, default=None: getattr(model, key, default)
    settings: dict[str, Any] = {
        "model.gate_bias_init": get("gate_bias_init", 4.0) if get("gate", True) else 0.0,
        "model.state_noise_scale": get("state_noise_scale") if get("state_noise_std", 0.1) else "relative",
    }
    if depth_sampling is not None:
        settings["train.depth_sampling"] = depth_sampling
    if max_train_depth:
        settings["train.max_train_depth"] = max_train_depth
    return settings


def trained_depths(loops: int, settings: dict[str, Any] | None) -> tuple[int, int]:
    """(first, last): the depths the verdict reads, those the run trains at, within 1..loops."""
    settings = settings or {}
    last = min(loops, settings.get("train.max_train_depth") or loops)
    return (last if settings.get("train.depth_sampling") == "fixed" else min(FIRST_TRAINED, last)), last


@dataclass
class LoopHealth:
    """What the loop's steps add, from the validation loss by exit depth."""

    by_depth: dict[int, float]  # 0..R (and beyond R where evaluated)
    loops: int  # R: the deepest depth the model is trained at
    first: int = FIRST_TRAINED  # the first depth it is trained at (R under depth_sampling=fixed)
    gate_means: list[float] = field(default_factory=list)  # mean gate at loop steps 1..R (no noise)
    core_grad_share: float | None = None  # the core's share of the squared gradient norm (last logged step)
    settings: dict[str, Any] | None = None  # run_settings: what the run uses (None: not known)

    @property
    def drops(self) -> dict[int, float]:
        """{r: L(r-1) - L(r)} for the steps after the first trained depth (r = 2..R)."""
        return {r: self.by_depth[r - 1] - self.by_depth[r] for r in range(self.first + 1, self.loops + 1)}

    @property
    def gain_after_first(self) -> float | None:
        """L(1) - L(R) (nats): what the steps after the first add; None where no two depths are
        trained (R = 1, or depth_sampling=fixed)."""
        if self.loops <= self.first:
            return None
        return self.by_depth[self.first] - self.by_depth[self.loops]

    @property
    def stops_after(self) -> int | None:
        """The step after which the loss stops falling: the first trained r whose next step drops it
        by less than MIN_STEP_DROP; None when it falls at every step up to R."""
        return next((r - 1 for r, d in self.drops.items() if d < MIN_STEP_DROP), None)

    @property
    def beyond(self) -> dict[int, float]:
        """{r: L(R) - L(r)} at the depths beyond R that were evaluated: what iterating on adds."""
        full = self.by_depth[self.loops]
        return {r: full - v for r, v in sorted(self.by_depth.items()) if r > self.loops}

    @property
    def used(self) -> bool | None:
        """Whether the steps after the first add at least MIN_GAIN_AFTER_FIRST (None at R = 1)."""
        gain = self.gain_after_first
        return None if gain is None else gain >= MIN_GAIN_AFTER_FIRST

    def line(self) -> str:
        """One line: the drops per step, the later steps' gain, where the loss stops falling, the gate
        per step, the core's gradient share, a verdict; L(0) as information."""
        parts = []
        if self.gain_after_first is None:
            parts.append(
                f"trained at depth {self.loops} only: the depths below are early exits never trained"
                if self.first > FIRST_TRAINED
                else f"R = {self.loops}: no loop steps after the first to judge"
            )
        else:
            drops = " ".join(f"{d:+.3f}" for d in self.drops.values())
            stop = self.stops_after
            falls = f"stops falling after step {stop}" if stop is not None else f"falls at every step to {self.loops}"
            parts.append(
                f"steps after the first add {self.gain_after_first:+.3f} nats (depth {self.first} -> {self.loops}; "
                f"drop by step {drops}); the loss {falls}"
            )
        if self.beyond:
            parts.append("beyond R " + " ".join(f"{r}:{g:+.3f}" for r, g in self.beyond.items()))
        if self.gate_means:
            parts.append("gate mean by step " + " ".join(f"{g:.3f}" for g in self.gate_means))
        if self.core_grad_share is not None:
            parts.append(f"core {100 * self.core_grad_share:.1f}% of the gradient norm^2")
        if 0 in self.by_depth and 1 in self.by_depth:  # information, out of the verdict: never trained
            parts.append(f"depth 0 (untrained) {self.by_depth[0] - self.by_depth[1]:+.3f} above depth 1")
        verdict = {
            None: "",
            True: ": later loop steps used",
            False: f": later loop steps ADD NOTHING (< {MIN_GAIN_AFTER_FIRST})",
        }[self.used]
        return "; ".join(parts) + verdict

    def advice(self) -> str:
        """What to try: the remedies the run does not use already (all, said so, when its settings
        are not known)."""
        known, uses = self.settings is not None, self.settings or {}
        todo = [(k, v, why) for k, v, why in REMEDIES if not known or uses.get(k) != v]
        tries = "; ".join(f"{k}={v} ({why})" for k, v, why in todo)
        more = "more training tokens (the loop study's later steps added 0.000 nats at 1e6 tokens, 0.017 at 5e6)"
        if not todo:
            return f"the run already uses {', '.join(f'{k}={v}' for k, v, _ in REMEDIES)}; try {more}"
        return f"try{' what the run does not use of' if not known else ''}: {tries}; or {more}"

    def warning(self) -> str:
        """The warning of a loop whose steps after the first add less than MIN_GAIN_AFTER_FIRST."""
        closed = self.gate_means and min(self.gate_means) > 0.95
        why = " and the gate has closed (the state passes through the loop unchanged)" if closed else ""
        return (
            f"the loop's steps after the first add nothing: the validation loss at depth {self.first} minus "
            f"at depth {self.loops} is {self.gain_after_first or 0.0:+.3f} nats (< {MIN_GAIN_AFTER_FIRST}){why}; "
            f"{self.advice()} (docs/comparison.md, 'The loop study')"
        )

    def scalars(self) -> dict[str, float]:
        """TensorBoard / W&B scalars (loop/...)."""
        values: dict[str, float] = {f"loop/drop_step_{r}": d for r, d in self.drops.items()}
        if self.gain_after_first is not None:
            values["loop/gain_after_first"] = self.gain_after_first
            values["loop/stops_after_step"] = float(self.stops_after or self.loops)
        values.update({f"loop/gate_mean_step_{i}": g for i, g in enumerate(self.gate_means, 1)})
        if self.core_grad_share is not None:
            values["loop/core_grad_share"] = self.core_grad_share
        return values

    def record(self) -> dict[str, Any]:
        """metrics.jsonl's (and summary.json's) "loop" record."""
        return {
            "loops": self.loops,
            "drop_by_step": {str(r): d for r, d in self.drops.items()},
            "gain_after_first": self.gain_after_first,
            "stops_after_step": self.stops_after,
            "gate_mean_by_step": self.gate_means,
            "core_grad_share": self.core_grad_share,
            "used": self.used,
        }


def loop_health(
    by_depth: dict[int, float],
    gate_means: list[float] | None = None,
    grad_norms: dict[str, float] | None = None,
    loops: int | None = None,
    settings: dict[str, Any] | None = None,
) -> LoopHealth | None:
    """The loop's health from the validation loss by depth (None for a model without a loop).
    grad_norms: a logging step's `grad_norm/<block>` scalars (pretrain.training.report.metrics.norms);
    loops: R (default: the deepest depth given; depths beyond R are reported, out of the verdict);
    settings: `run_settings` of the run, so that the advice names only what it does not use."""
    depths = {int(k): v for k, v in by_depth.items()}
    first, R = trained_depths(max(depths) if loops is None else loops, settings)
    if R < FIRST_TRAINED or any(r not in depths for r in range(first, R + 1)):
        return None
    share = None
    if grad_norms:
        squares = {k: v * v for k, v in grad_norms.items() if k.startswith("grad_norm/")}
        total = sum(squares.values())
        share = squares.get("grad_norm/core", 0.0) / total if total > 0 else None
    return LoopHealth(depths, R, first, list(gate_means or []), share, settings)
