"""The checks of a run's training settings (`train_checks`): for every `train.*` value that can be
meaningless, the one line that refuses it, by concern (docs/reliability.md, "Values checked at the
door"). The settings themselves, and what each needs to take effect, are train_config.py.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from pretrain.runs.checkpoint_mirror import url_problem
from pretrain.runs.depth_settings import DEPTH_SCHEDULES
from pretrain.runs.settings_rules import profile_refusal, profile_window
from pretrain.runs.train_config import (
    AUTO,
    AUTO_WORKERS,
    CHECKPOINT_MODES,
    DEPTH_SAMPLING,
    OPTIMIZERS,
    PRECISIONS,
    TrainConfig,
)

SPIKE_ACTIONS = ("log", "skip", "rollback")  # what a loss spike does (TrainConfig.loss_spike_action)
SCHEDULES = ("cosine", "wsd")  # TrainConfig.schedule
DECAY_SHAPES = ("linear", "sqrt")  # TrainConfig.decay_shape


def _finite(x: Any) -> bool:
    """A real number (not a bool, not NaN or infinite)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _betas_ok(betas: Any) -> bool:
    return isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas)


def _mirror_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """The checkpoints' mirror: a URL that can be used, and a checkpoint to mirror."""
    mirror = url_problem(t.checkpoint_mirror) if t.checkpoint_mirror else None
    return [
        (mirror is None, mirror or ""),
        (
            not t.checkpoint_mirror or t.save_every > 0 or t.save_final,
            f"train.checkpoint_mirror={t.checkpoint_mirror!r}: no checkpoint to mirror (train.save_every=0 and "
            "train.save_final=false)",
        ),
    ]


def _mode_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """The settings that name a mode."""
    return [
        (
            t.depth_sampling in DEPTH_SAMPLING,
            f"train.depth_sampling={t.depth_sampling!r}: accepted values are {', '.join(DEPTH_SAMPLING)}",
        ),
        (
            t.precision in PRECISIONS,
            f"train.precision={t.precision!r}: accepted values are {', '.join(PRECISIONS)}",
        ),
        (
            t.activation_checkpointing in (AUTO, *CHECKPOINT_MODES),
            f"train.activation_checkpointing={t.activation_checkpointing!r}: accepted values are "
            f"{', '.join((AUTO, *CHECKPOINT_MODES))}",
        ),
    ]


def _length_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """The run's length, its batches and its learning-rate schedule."""
    return [
        (t.steps >= 1, f"train.steps={t.steps}: must be >= 1"),
        (
            _finite(t.tokens) and t.tokens >= 0,
            f"train.tokens={t.tokens}: must be >= 0 (training tokens, e.g. 3e9; 0 = train.steps)",
        ),
        (t.schedule in SCHEDULES, f"train.schedule={t.schedule!r}: accepted values are {', '.join(SCHEDULES)}"),
        (
            t.decay_shape in DECAY_SHAPES,
            f"train.decay_shape={t.decay_shape!r}: accepted values are {', '.join(DECAY_SHAPES)}",
        ),
        (
            _finite(t.decay_tokens) and t.decay_tokens >= 0,
            f"train.decay_tokens={t.decay_tokens}: must be >= 0 (tokens of the wsd decay phase; 0 = no decay)",
        ),
        (
            _finite(t.max_repeats) and t.max_repeats >= 0,
            f"train.max_repeats={t.max_repeats}: must be >= 0 (passes over a source's train split; 0 = no cap)",
        ),
        (t.eval_tasks_every >= 0, f"train.eval_tasks_every={t.eval_tasks_every}: must be >= 0 (0 = off)"),
        (t.eval_tasks_limit >= 0, f"train.eval_tasks_limit={t.eval_tasks_limit}: must be >= 0 (0 = every item)"),
        (t.max_train_depth >= 0, f"train.max_train_depth={t.max_train_depth}: must be >= 0 (0 = the layout's R)"),
        (t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size}: must be >= 1"),
        (t.grad_accum >= 1, f"train.grad_accum={t.grad_accum}: must be >= 1"),
        (0 <= t.warmup_steps, f"train.warmup_steps={t.warmup_steps}: must be >= 0"),
        (0 <= t.schedule_steps, f"train.schedule_steps={t.schedule_steps}: must be >= 0 (0 = train.steps)"),
    ]


def _optimizer_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """The optimizer's numbers (AdamW's and Muon's)."""
    return [
        (
            _finite(t.lr) and _finite(t.min_lr) and t.lr > 0 and 0 <= t.min_lr <= t.lr,
            f"train.lr={t.lr}, train.min_lr={t.min_lr}: need 0 <= min_lr <= lr, lr > 0 (finite numbers)",
        ),
        (_finite(t.weight_decay) and t.weight_decay >= 0, f"train.weight_decay={t.weight_decay}: must be >= 0"),
        (
            _betas_ok(t.betas),
            f"train.betas={t.betas!r}: two numbers in [0, 1), e.g. train.betas=0.9,0.95",
        ),
        (
            _finite(t.grad_clip) and t.grad_clip >= 0,
            f"train.grad_clip={t.grad_clip}: must be >= 0 (the largest gradient norm; 0 = no clipping)",
        ),
        (t.optimizer in OPTIMIZERS, f"train.optimizer={t.optimizer!r}: accepted values are {', '.join(OPTIMIZERS)}"),
        (_finite(t.muon_lr) and t.muon_lr > 0, f"train.muon_lr={t.muon_lr}: must be > 0"),
        (
            _finite(t.muon_momentum) and 0 <= t.muon_momentum < 1,
            f"train.muon_momentum={t.muon_momentum}: must be in [0, 1)",
        ),
        (
            _finite(t.muon_weight_decay) and t.muon_weight_decay >= 0,
            f"train.muon_weight_decay={t.muon_weight_decay}: must be >= 0",
        ),
    ]


def _depth_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """The seed and the loop depths drawn in training."""
    return [
        (0 <= t.seed < 2**63, f"train.seed={t.seed}: must be in [0, 2**63)"),
        (
            _finite(t.poisson_mean) and t.poisson_mean >= 0,
            f"train.poisson_mean={t.poisson_mean}: must be > 0 (the Poisson's mean; 0 = from the model's R)",
        ),
        (
            t.depth_schedule in DEPTH_SCHEDULES,
            f"train.depth_schedule={t.depth_schedule!r}: accepted values are {', '.join(DEPTH_SCHEDULES)}",
        ),
        (
            _finite(t.depth_warmup) and 0 < t.depth_warmup <= 1,
            f"train.depth_warmup={t.depth_warmup}: must be in (0, 1] (a share of the schedule's horizon)",
        ),
        (_finite(t.poisson_sigma) and t.poisson_sigma >= 0, f"train.poisson_sigma={t.poisson_sigma}: must be >= 0"),
    ]


def _data_and_log_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """The loader, the logging and the validation."""
    return [
        (
            t.num_workers >= AUTO_WORKERS,
            f"train.num_workers={t.num_workers}: must be >= 0 (0 = load in the training process), or -1 (auto)",
        ),
        (t.shuffle_buffer >= 0, f"train.shuffle_buffer={t.shuffle_buffer}: must be >= 0 (0 = no shuffle buffer)"),
        (t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1"),
        (t.eval_every >= 0, f"train.eval_every={t.eval_every}: must be >= 0 (0 = off)"),
        (
            t.eval_batches >= 1,
            f"train.eval_batches={t.eval_batches}: must be >= 1 (turn evaluation off with eval_every=0)",
        ),
    ]


def _checkpoint_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """Checkpoints and the exports written from them."""
    return [
        (t.save_every >= 0, f"train.save_every={t.save_every}: must be >= 0 (0 = off)"),
        (t.keep_checkpoints >= 1, f"train.keep_checkpoints={t.keep_checkpoints}: must be >= 1"),
        (
            t.export_every == 0 or (t.export_every > 0 and t.save_every > 0 and t.export_every % t.save_every == 0),
            f"train.export_every={t.export_every}: must be 0 (off) or a multiple of train.save_every={t.save_every} "
            "(an export is written from a checkpoint)",
        ),
        (  # the start's check, so that --dry-run makes it too (it was the trainer's, after the engine)
            t.export_every == 0 or importlib.util.find_spec("transformers") is not None,
            f"train.export_every={t.export_every}: the Hugging Face copy needs transformers: "
            "pip install 'grt-pretrain[hf]'",
        ),
    ]


def _watch_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """What watches a run: bad steps, collectives' timeout, throughput, the profiler, slow ranks, loss spikes."""
    return [
        (
            t.max_bad_steps >= 1,
            f"train.max_bad_steps={t.max_bad_steps}: must be >= 1 (consecutive non-finite micro-batches "
            "before the run stops)",
        ),
        (
            _finite(t.dist_timeout_s) and t.dist_timeout_s > 0,
            f"train.dist_timeout_s={t.dist_timeout_s}: must be > 0 (seconds a collective may wait)",
        ),
        (
            _finite(t.peak_tflops) and t.peak_tflops >= 0,
            f"train.peak_tflops={t.peak_tflops}: must be >= 0 (0 = look the device up)",
        ),
        (profile_window(t.profile) is not None or t.profile == "", profile_refusal(t.profile)),
        (
            t.profile_ranks == "all" or all(r.strip().isdigit() for r in t.profile_ranks.split(",")),
            f"train.profile_ranks={t.profile_ranks!r}: comma-separated ranks (e.g. 0,8) or 'all'",
        ),
        (
            _finite(t.data_starved_share) and 0 < t.data_starved_share <= 1,
            f"train.data_starved_share={t.data_starved_share}: must be in (0, 1] (a share of the step's time)",
        ),
        (
            _finite(t.slow_rank_factor) and t.slow_rank_factor > 1,
            f"train.slow_rank_factor={t.slow_rank_factor}: must be > 1 (times the median rank's step time)",
        ),
        (t.slow_rank_windows >= 1, f"train.slow_rank_windows={t.slow_rank_windows}: must be >= 1 (logging steps)"),
        (
            t.loss_spike_action in SPIKE_ACTIONS,
            f"train.loss_spike_action={t.loss_spike_action!r}: accepted values are {', '.join(SPIKE_ACTIONS)}",
        ),
        (
            _finite(t.loss_spike_threshold) and t.loss_spike_threshold >= 0,
            f"train.loss_spike_threshold={t.loss_spike_threshold}: must be >= 0 (robust standard deviations; 0 = off)",
        ),
    ]


TRAIN_CHECKS = (
    _mirror_checks,
    _mode_checks,
    _length_checks,
    _optimizer_checks,
    _depth_checks,
    _data_and_log_checks,
    _checkpoint_checks,
    _watch_checks,
)


def train_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """(ok, the one line that refuses it) for every `train.*` value that can be meaningless
    (docs/reliability.md, "Values checked at the door"), by concern, in the order they are
    refused. Types are checked before, on parse."""
    return [check for concern in TRAIN_CHECKS for check in concern(t)]
