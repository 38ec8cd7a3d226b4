"""The learning-rate schedules of a run (`train.schedule`), in one place (docs/training.md,
"Schedules: cosine and warmup-stable-decay").

Both count as DeepSpeed's schedulers do: `i` is the scheduler's `last_batch_iteration`, the
number of optimizer steps taken minus one. The learning rate after n steps (what `train/lr`
logs at step n, and what update n + 1 uses) is `lr_after(n)` = the value at i = n - 1; the first
update uses the value at i = -1 (0: both schedules start the warmup from 0).

- `cosine`: DeepSpeed's `WarmupCosineLR`, built from the merged DeepSpeed config
  (ds_config.py). Linear warmup over W = max(2, min(train.warmup_steps, H)) steps (DeepSpeed
  warms up over at least 2), then cosine from lr to min_lr, reaching it at i = H - 1, where the
  horizon H = train.schedule_steps or train.steps; past it, min_lr. `Schedule.ratio` repeats
  its formula (tests/training/test_schedule.py checks it against DeepSpeed's class).
- `wsd` (warmup-stable-decay; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
  Beyond Fixed Training Durations"): the same warmup, then lr constant, then over the last
  D = ceil(train.decay_tokens / tokens per step) steps of the horizon a decay to min_lr:
  linear, or `sqrt` (1 - sqrt: lr - (lr - min_lr) * sqrt(progress)). The decay's progress is
  (i - (H - 1 - D)) / D, clamped to [0, 1]: it is 0 (lr) at i = H - 1 - D and 1 (min_lr) at
  i = H - 1, the last logged step; past it, min_lr. train.decay_tokens = 0: no decay, lr to
  the end (a run to branch decays from). Where the decay would reach into the warmup the lower
  of the two applies. No DeepSpeed scheduler type implements it: `WarmupStableDecayLR` is given
  to `deepspeed.initialize` as its client `lr_scheduler` (engine/build.py), and DeepSpeed saves and
  restores its state (`last_batch_iteration`, the same state as WarmupCosineLR's) in every
  checkpoint, so a resume continues the same sequence. The schedule itself is a pure function
  of the run config and the tokens per step, never of the saved state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# one home: the settings rules (pretrain/runs/) check the same schedule
from pretrain.runs.settings_rules import decay_steps, horizon, warmup_num_steps
from pretrain.runs.train_config import TrainConfig

__all__ = ["Schedule", "WarmupStableDecayLR", "client_scheduler", "decay_steps", "horizon", "warmup_num_steps"]


@dataclass(frozen=True)
class Schedule:
    """One run's learning-rate schedule: `ratio(i)` times lr is the learning rate at DeepSpeed's
    scheduler step i (the module docstring)."""

    kind: str  # cosine | wsd
    lr: float
    min_lr: float
    warmup: int  # DeepSpeed's warmup_num_steps (the warmup is over max(2, warmup) steps)
    horizon: int  # the step count the schedule ends at (cosine's total_num_steps; where wsd's decay ends)
    decay_steps: int = 0  # wsd: the decay's length in steps (0: no decay)
    decay_shape: str = "linear"  # wsd: linear | sqrt

    @classmethod
    def of(cls, train: TrainConfig, tokens_per_step: int) -> Schedule:
        """The schedule of `train` for a run of `tokens_per_step` tokens per optimizer step
        (micro-batch x grad_accum x ranks x sequence length; only wsd's decay uses it)."""
        return cls(
            kind=train.schedule,
            lr=train.lr,
            min_lr=train.min_lr,
            warmup=warmup_num_steps(train),
            horizon=horizon(train),
            decay_steps=decay_steps(train.decay_tokens, tokens_per_step) if train.schedule == "wsd" else 0,
            decay_shape=train.decay_shape,
        )

    @property
    def min_ratio(self) -> float:
        return self.min_lr / self.lr

    @property
    def decay_start(self) -> int:
        """wsd: the scheduler step where the decay starts (its value there is still lr): H - 1 - D."""
        return self.horizon - 1 - self.decay_steps

    def ratio(self, i: int) -> float:
        """The learning rate at DeepSpeed's scheduler step `i` (last_batch_iteration), over lr."""
        if i < 0:
            return 0.0
        warmup = max(2, self.warmup)
        warm = i / warmup if i < warmup else 1.0  # DeepSpeed: warmup_min_ratio 0 + ratio * 1.0
        if self.kind == "cosine":
            if i < warmup:
                return warm
            progress = min(1.0, (i - warmup + 1) / max(1, self.horizon - warmup))
            cosine = (1 + math.cos(math.pi * progress)) / 2
            return max(0.0, self.min_ratio + (1.0 - self.min_ratio) * cosine)
        if self.decay_steps <= 0:
            return warm
        progress = min(1.0, max(0.0, (i - self.decay_start) / self.decay_steps))
        shape = math.sqrt(progress) if self.decay_shape == "sqrt" else progress
        return min(warm, 1.0 - (1.0 - self.min_ratio) * shape)  # exactly 1.0 until the decay starts

    def lr_at(self, i: int) -> float:
        """The learning rate at scheduler step `i` (DeepSpeed's: the per-group lr times the ratio)."""
        return self.lr * self.ratio(i)

    def lr_after(self, steps: int) -> float:
        """The learning rate after `steps` optimizer steps: `train/lr` at that step, update steps + 1's."""
        return self.lr_at(steps - 1)

    def describe(self, tokens_per_step: int | None = None) -> str:
        """One phrase saying the schedule, e.g. for a log line or a resume's note."""
        warm = f"linear warmup over {max(2, self.warmup)} steps"
        if self.kind == "cosine":
            return f"cosine: {warm}, cosine to min_lr {self.min_lr:g} at step {self.horizon}"
        if self.decay_steps <= 0:
            return f"wsd: {warm}, then lr {self.lr:g} to the end (no decay: train.decay_tokens=0)"
        tokens = f" ({self.decay_steps * tokens_per_step:,} tokens)" if tokens_per_step else ""
        start = max(0, self.decay_start + 1)
        return (
            f"wsd: {warm}, lr {self.lr:g} to step {start}, then a {self.decay_shape} decay over the last "
            f"{self.decay_steps} steps{tokens} to min_lr {self.min_lr:g} at step {self.horizon}"
        )


class WarmupStableDecayLR:
    """The wsd schedule as a DeepSpeed client scheduler: DeepSpeed's scheduler interface
    (`step`, `get_lr`, `get_last_lr`, `state_dict`, `load_state_dict`), as WarmupCosineLR
    does it: each param group's own lr (at construction) times `Schedule.ratio`. Its state is
    `last_batch_iteration` alone, saved in every checkpoint by DeepSpeed; the schedule comes
    from the run config."""

    def __init__(self, optimizer: Any, schedule: Schedule, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply() if last_batch_iteration == -1 else self.get_lr()

    def get_lr(self) -> list[float]:
        ratio = self.schedule.ratio(self.last_batch_iteration)
        return [lr * ratio for lr in self.org_lrs]

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._last_lr = self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]

    def __repr__(self) -> str:
        return f"WarmupStableDecayLR({self.schedule.describe()})"


def client_scheduler(train: TrainConfig, tokens_per_step: int) -> Callable[[Any], WarmupStableDecayLR] | None:
    """What `deepspeed.initialize(lr_scheduler=)` gets: for wsd, a callable DeepSpeed calls with its
    optimizer; for cosine None (DeepSpeed builds WarmupCosineLR from the merged config)."""
    if train.schedule != "wsd":
        return None
    schedule = Schedule.of(train, tokens_per_step)

    def build(optimizer: Any) -> WarmupStableDecayLR:
        return WarmupStableDecayLR(optimizer, schedule)

    return build
