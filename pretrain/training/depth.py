"""How many loop steps each training step runs. A pure function of (seed, step), so every
rank draws the same depth without communicating (ranks that disagree hang ZeRO)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pretrain.runs.train_config import TrainConfig


def sample_depth(
    mode: str, max_loops: int, seed: int, step: int, poisson_mean: float = 32.0, poisson_sigma: float = 0.5
) -> int:
    if max_loops < 1:
        return 0
    rng = np.random.default_rng([seed, step, 0x6A7E])
    if mode == "fixed":
        return max_loops
    if mode == "uniform":
        return int(rng.integers(1, max_loops + 1))
    if mode == "loguniform":  # r = floor(exp(U[0, log(max + 1)))): every depth up to max seen, short ones most
        return int(min(math.exp(rng.uniform(0.0, math.log(max_loops + 1))), max_loops))
    if mode == "poisson":  # Huginn: r ~ Poisson(exp(tau)) + 1, tau ~ N(log rbar - sigma^2/2, sigma)
        tau = rng.normal(math.log(poisson_mean) - poisson_sigma**2 / 2, poisson_sigma)
        return int(min(rng.poisson(math.exp(tau)) + 1, 4 * poisson_mean))
    raise ValueError(f"depth_sampling={mode!r}: accepted values are uniform, fixed, poisson, loguniform")


def depth_for_step(train: TrainConfig, max_loops: int, step: int) -> int:
    """The loop depth of training step `step` under a run's settings (`train`: the TrainConfig;
    `max_loops`: the layout's R, 0 for a dense model)."""
    if max_loops < 1:
        return 0
    return sample_depth(
        train.depth_sampling,
        train.max_train_depth or max_loops,
        train.seed,
        step,
        train.poisson_mean,
        train.poisson_sigma,
    )


def max_depth(train: TrainConfig, max_loops: int) -> int:
    """The deepest loop depth `depth_for_step` can draw under a run's settings."""
    if max_loops < 1:
        return 0
    if train.depth_sampling == "poisson":
        return int(4 * train.poisson_mean)
    return train.max_train_depth or max_loops
