"""Whether a looped model uses its loop: the one verdict that training's validation, `grt analyze`
and `grt compare` all state.

The loop's gain is the validation loss at depth 0 (prelude straight to coda) minus the loss at
the full depth R: what the R loop steps add. A GRT whose gate closes (g -> 1) learns to decode
s ~ e and its gain falls to ~0 while the run looks healthy: nothing else in the logs shows it
(docs/comparison.md, "A start in which a small GRT uses its loop").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# below this gain (nats) after warm-up the loop counts as unused; the paper's R = 6 model gains 2.6
MIN_LOOP_GAIN = 0.05
ADVICE = (
    "try the tiny presets' start, model.gate_bias_init=0 with model.state_noise_scale=relative, or "
    "train.depth_sampling=fixed (docs/comparison.md, 'A start in which a small GRT uses its loop')"
)


@dataclass
class LoopHealth:
    """What the loop adds, from the validation loss by exit depth."""

    by_depth: dict[int, float]
    gate_means: list[float] = field(default_factory=list)  # mean gate at loop steps 1..R (no noise)
    core_grad_share: float | None = None  # the core's share of the squared gradient norm (last logged step)

    @property
    def loops(self) -> int:
        return max(self.by_depth)

    @property
    def gain(self) -> float:
        """Loss at depth 0 minus loss at depth R (nats): what the whole loop adds."""
        return self.by_depth[0] - self.by_depth[self.loops]

    @property
    def gain_first(self) -> float:
        """Loss at depth 0 minus loss at depth 1: what the first loop step adds."""
        return self.by_depth[0] - self.by_depth[1]

    @property
    def used(self) -> bool:
        return self.gain >= MIN_LOOP_GAIN

    def line(self) -> str:
        """One line: the gain, at depth 1, the gate per step, the core's gradient share, a verdict."""
        parts = [f"loop gain {self.gain:+.3f} nats (depth 0 -> {self.loops}), {self.gain_first:+.3f} at depth 1"]
        if self.gate_means:
            parts.append("gate mean by step " + " ".join(f"{g:.3f}" for g in self.gate_means))
        if self.core_grad_share is not None:
            parts.append(f"core {100 * self.core_grad_share:.1f}% of the gradient norm^2")
        verdict = "used" if self.used else f"NOT USED (gain < {MIN_LOOP_GAIN})"
        return "; ".join(parts) + f": loop {verdict}"

    def warning(self) -> str:
        """The warning of a loop that adds less than MIN_LOOP_GAIN, with what to try."""
        closed = self.gate_means and min(self.gate_means) > 0.95
        why = " and the gate has closed (the state passes through the loop unchanged)" if closed else ""
        return (
            f"the loop is not being used: it lowers the validation loss by {self.gain:.3f} nats from depth 0 to "
            f"depth {self.loops} (< {MIN_LOOP_GAIN}){why}; {ADVICE}"
        )

    def scalars(self) -> dict[str, float]:
        """TensorBoard / W&B scalars (loop/...)."""
        values = {"loop/gain": self.gain, "loop/gain_depth_1": self.gain_first}
        values.update({f"loop/gate_mean_step_{i}": g for i, g in enumerate(self.gate_means, 1)})
        if self.core_grad_share is not None:
            values["loop/core_grad_share"] = self.core_grad_share
        return values

    def record(self) -> dict[str, Any]:
        """metrics.jsonl's "loop" record."""
        return {
            "gain": self.gain,
            "gain_depth_1": self.gain_first,
            "gate_mean_by_step": self.gate_means,
            "core_grad_share": self.core_grad_share,
            "used": self.used,
        }


def loop_health(
    by_depth: dict[int, float], gate_means: list[float] | None = None, grad_norms: dict[str, float] | None = None
) -> LoopHealth | None:
    """The loop's health from the validation loss by depth (None for a model without a loop);
    grad_norms: a logging step's `grad_norm/<block>` scalars (pretrain.training.report.metrics.norms)."""
    if len(by_depth) < 2 or 0 not in by_depth:
        return None
    share = None
    if grad_norms:
        squares = {k: v * v for k, v in grad_norms.items() if k.startswith("grad_norm/")}
        total = sum(squares.values())
        share = squares.get("grad_norm/core", 0.0) / total if total > 0 else None
    return LoopHealth({int(k): v for k, v in by_depth.items()}, list(gate_means or []), share)
