"""What a run's depth settings mean for its model: the deepest loop depth a training step draws
(train.max_train_depth, else the layout's R), the heavy-tail Poisson's mean when none is given
(it follows that depth), the deepest depth of a step under train.depth_schedule=grow; the config
rule that refuses settings that cannot hold, and the start's line on a mean derived from R.

The draws themselves are pretrain/training/depth.py's. Like settings_rules.py, this module reads the
config by name and imports nothing of the run config (train_config.py imports it).
"""

from __future__ import annotations

import math
from typing import Any

from pretrain.runs.settings_rules import RunShape, given, horizon, note, rule

DEPTH_SCHEDULES = ("constant", "grow")  # TrainConfig.depth_schedule


def deepest_trained(t: Any, max_loops: int) -> int:
    """The deepest depth a training step may draw (`t`: the TrainConfig; `max_loops`: the layout's R,
    0 for a dense model, which has no loop)."""
    return (t.max_train_depth or max_loops) if max_loops >= 1 else 0


def poisson_rbar(mean: float, cap: int) -> float:
    """The Poisson's rbar: train.poisson_mean, or 0 (left out) for cap - 1, a mean depth rbar + 1 at the
    deepest depth drawn: the draws lean to the deep steps, the deepest taking what lies beyond it."""
    return mean or max(cap - 1.0, 0.5)


def scheduled_cap(t: Any, cap: int, step: int) -> int:
    """The deepest depth step `step` (0-based) may draw: `cap`, or under depth_schedule=grow 1 at the
    start, rising by one in equal stages to `cap` at depth_warmup of the schedule's horizon."""
    if t.depth_schedule != "grow" or cap <= 1:
        return cap
    ramp = t.depth_warmup * horizon(t)
    return cap if step >= ramp else 1 + math.floor(cap * step / ramp)


@rule("train.poisson_mean", "a mean depth poisson_mean + 1 no deeper than the deepest depth trained")
def _poisson_fits(cfg: Any, _: RunShape | None) -> str | None:
    """A mean given that cannot hold; a default (0: from R; a recipe's or a saved config's) is not refused."""
    t = cfg.train
    if not given(cfg, "train.poisson_mean"):
        return None
    if t.poisson_mean <= 0:
        return f"train.poisson_mean={t.poisson_mean:g}: must be > 0 (left out, it follows the model's R: R - 1)"
    cap = deepest_trained(t, cfg.model.max_loops)
    if t.depth_sampling == "poisson" and t.poisson_mean + 1 > cap:
        return (
            f"train.poisson_mean={t.poisson_mean:g}: the mean depth {t.poisson_mean + 1:g} is deeper than the "
            f"deepest this run trains at, {cap} (train.max_train_depth, else the model's R): give at most "
            f"{max(cap - 1, 0)}, raise train.max_train_depth, or leave it out ({poisson_rbar(0, cap):g}, from R)"
        )
    return None


@note
def _poisson_mean_from_r(cfg: Any) -> list[str]:
    """The start says the mean poisson sampling takes when none was given (or one that draws only the deepest)."""
    t = cfg.train
    cap = deepest_trained(t, cfg.model.max_loops)
    if t.depth_sampling != "poisson" or cap < 1:
        return []
    rbar = poisson_rbar(t.poisson_mean, cap)
    if not t.poisson_mean:
        return [
            f"train.poisson_mean: {rbar:g}, from the model's depth {cap} (mean depth {rbar + 1:g}, each draw capped "
            f"at {cap}); --set train.poisson_mean=N for another"
        ]
    if rbar + 1 > cap:
        return [f"train.poisson_mean={rbar:g} (not set here): mean depth {rbar + 1:g}, most draws capped at {cap}"]
    return []
