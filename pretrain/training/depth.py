"""How many loop steps each training step runs. A pure function of (seed, step), so every
rank draws the same depth without communicating (ranks that disagree hang ZeRO). What the
settings mean for the model (the deepest depth, the Poisson's mean from R, the grow schedule) is
pretrain/runs/depth_settings.py's, which the config's checks share."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pretrain.runs.depth_settings import deepest_trained, poisson_rbar, scheduled_cap

if TYPE_CHECKING:
    from pretrain.runs.train_config import TrainConfig


def sample_depth(
    mode: str, max_loops: int, seed: int, step: int, poisson_mean: float = 0.0, poisson_sigma: float = 0.5
) -> int:
    """A depth in 1..max_loops. poisson_mean: the Poisson's rbar (0: max_loops - 1, `poisson_rbar`)."""
    if max_loops < 1:
        return 0
    rng = np.random.default_rng([seed, step, 0x6A7E])
    if mode == "fixed":
        return max_loops
    if mode == "uniform":
        return int(rng.integers(1, max_loops + 1))
    if mode == "loguniform":  # r = floor(exp(U[0, log(max + 1)))): every depth up to max seen, short ones most
        return int(min(math.exp(rng.uniform(0.0, math.log(max_loops + 1))), max_loops))
    if mode == "poisson":  # Huginn: r ~ Poisson(exp(tau)) + 1, tau ~ N(log rbar - sigma^2/2, sigma), capped
        rbar = poisson_rbar(poisson_mean, max_loops)
        tau = rng.normal(math.log(rbar) - poisson_sigma**2 / 2, poisson_sigma)
        return int(min(rng.poisson(math.exp(tau)) + 1, max_loops))
    raise ValueError(f"depth_sampling={mode!r}: accepted values are uniform, fixed, poisson, loguniform")


def depth_for_step(train: TrainConfig, max_loops: int, step: int) -> int:
    """The loop depth of training step `step` under a run's settings (`train`: the TrainConfig;
    `max_loops`: the layout's R, 0 for a dense model)."""
    if max_loops < 1:
        return 0
    cap = scheduled_cap(train, deepest_trained(train, max_loops), step)
    return sample_depth(train.depth_sampling, cap, train.seed, step, train.poisson_mean, train.poisson_sigma)


def max_depth(train: TrainConfig, max_loops: int) -> int:
    """The deepest loop depth `depth_for_step` can draw under a run's settings."""
    return deepest_trained(train, max_loops)
