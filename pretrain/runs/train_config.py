"""A run's training settings: `TrainConfig`, each field with what it needs to take effect and what a
resume may do with it (`option`); the checks of its values are train_checks.py. A training option is its field here
and the code that uses it (README, "Where does a change go"); the run config (`RunConfig`, overrides,
resolution) is run_config.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pretrain.runs.settings_rules import (
    ADAMW_GRAD_CLIP,
    given,
    global_batch,
    note,
    switch_rule,
)

DEPTH_SAMPLING = ("uniform", "fixed", "poisson", "loguniform")
# train.activation_checkpointing (pretrain/training/engine/parallelize.py): explicit modes, cheapest
# recompute first; `auto` picks one for the run
CHECKPOINT_MODES = ("off", "selective", "loop_step", "block")
AUTO = "auto"
PRECISIONS = ("auto", "bf16", "fp32")
AUTO_WORKERS, CUDA_WORKERS = -1, 2  # train.num_workers=-1: CUDA_WORKERS on CUDA, 0 on the CPU
OPTIMIZERS = ("adamw", "muon")  # TrainConfig.optimizer

# What a setting needs to take effect, and what a resume may do with it, live with its field: a
# training option is its field here and the code that uses it (README, "Where does a change go").
Switch = tuple[str, Callable[["TrainConfig"], bool]]  # (what it needs, in words; whether the run has it)
WSD: Switch = ("train.schedule=wsd", lambda t: t.schedule == "wsd")
MUON: Switch = ("train.optimizer=muon", lambda t: t.optimizer == "muon")
WANDB: Switch = ("train.wandb=true", lambda t: t.wandb)
TASKS: Switch = ("train.eval_tasks_every > 0", lambda t: t.eval_tasks_every > 0)
PROFILE: Switch = ("train.profile='wait,warmup,active'", lambda t: bool(t.profile))
SPIKES: Switch = ("train.loss_spike_threshold > 0", lambda t: t.loss_spike_threshold > 0)
GROW: Switch = ("train.depth_schedule=grow", lambda t: t.depth_schedule == "grow")
KEPT = "kept"  # resume: the checkpoint's value or a refusal (the state it restores was made with it)


def option(default: Any, needs: Switch | None = None, resume: str = "", saving: bool = False) -> Any:
    """A TrainConfig field whose value given on the command line needs `needs` to take effect (else
    refused, settings_rules.switch_rule), which a resume keeps (`resume=KEPT`, resume_check.py), and
    which says how often or where the run is saved, not what it trains (`saving`, `saving_keys`)."""
    return field(default=default, metadata={"needs": needs, "resume": resume, "saving": saving})


def _marked(mark: str, value: Any) -> tuple[str, ...]:
    """The TrainConfig fields whose `option` mark is `value`."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get(mark) == value)


def saving_keys() -> tuple[str, ...]:
    """The train keys that say how often and where a run is saved: two runs that differ only in them
    trained the same (grt compare reuses either)."""
    return _marked("saving", True)


def kept_on_resume() -> tuple[str, ...]:
    """The train keys a resume may not change (pretrain/training/start/resume_check.py)."""
    return _marked("resume", KEPT)


@dataclass
class TrainConfig:
    steps: int = 20000
    tokens: float = 0.0  # the run's length in training tokens (e.g. 3e9): steps = ceil(tokens / tokens per step);
    # 0 = train.steps
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = option(6e-4, resume=KEPT)
    min_lr: float = option(6e-5, resume=KEPT)
    warmup_steps: int = option(2000, resume=KEPT)
    # learning-rate schedule horizon; 0 = steps (a resume with new steps keeps the old)
    schedule_steps: int = option(0, resume=KEPT)
    schedule: str = "cosine"  # cosine: warmup then cosine to min_lr over the horizon; wsd: warmup-stable-decay
    decay_tokens: float = 0.0  # wsd: the decay phase, the run's last this many tokens (0: no decay, stable to the
    # end: a run to branch decays from, docs/training.md)
    decay_shape: str = option("linear", WSD)  # wsd: linear or sqrt (1 - sqrt) from lr to min_lr
    weight_decay: float = option(0.1, resume=KEPT)
    betas: tuple = option((0.9, 0.95), resume=KEPT)
    grad_clip: float = ADAMW_GRAD_CLIP  # 0 = no clipping; under train.optimizer=muon 0 unless given (`switch_defaults`)
    # adamw; muon: DeepSpeed's Muon for the hidden matrices, AdamW (lr, betas) for the rest
    optimizer: str = option("adamw", resume=KEPT)
    # muon: the matrices' peak learning rate (the schedule scales it as it scales lr)
    muon_lr: float = option(0.02, MUON, resume=KEPT)
    muon_momentum: float = option(0.95, MUON, resume=KEPT)
    # muon: the matrices' decoupled decay, times muon_lr per step (DeepSpeed's default)
    muon_weight_decay: float = option(0.0, MUON, resume=KEPT)
    async_save: bool = option(False, saving=True)  # checkpoint files written by a thread while training goes on
    seed: int = 1234
    depth_sampling: str = "uniform"  # uniform: r ~ U{1..R}; fixed: R; poisson: Huginn's heavy tail;
    # loguniform: floor(exp(U[0, log(R+1)))), depth extrapolation
    max_train_depth: int = 0  # the R of the sampling above (0 = the layout's R); e.g. 32 with
    # loguniform keeps the loss flat past R (docs/evaluation.md)
    # rbar of the heavy-tail Poisson, a mean depth rbar + 1; 0 = the deepest depth trained - 1 (it follows R).
    # Every draw is capped at that depth (pretrain/runs/depth_settings.py)
    poisson_mean: float = 0.0
    poisson_sigma: float = 0.5
    depth_schedule: str = "constant"  # grow: the deepest depth drawn rises from 1 to R over depth_warmup
    depth_warmup: float = option(0.25, GROW)  # grow: the share of the schedule's horizon over which it rises
    activation_checkpointing: str = AUTO  # auto: off, selective or loop_step by the device memory left;
    # or one of those, or block (pretrain/training/engine/parallelize.py)
    doc_mask: bool = False  # attend only within a packed document
    precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    num_workers: int = -1  # loader processes per rank; -1 (auto): `loader_workers`
    shuffle_buffer: int = 1000
    data_stages: str = ""  # a mixture's weights from a token count on: "2e9:web=0.2,books=0.8;3e9:web=0,books=1"
    max_repeats: float = 0.0  # a mixture source's train split is read at most this many times (0 = no cap)
    skip_corrupt_shards: bool = False
    log_every: int = 10
    eval_every: int = 500
    eval_batches: int = 20
    eval_tasks_every: int = 0  # score the zero-shot tasks every this many steps (0 = off), at eval_tasks_depths
    # comma-separated task names (pretrain/infer/evaluation/zero_shot.py), or all
    eval_tasks: str = option("all", TASKS)
    eval_tasks_depths: str = option("", TASKS)  # exit depths, comma-separated; "" = 1, R/2, R
    eval_tasks_limit: int = option(200, TASKS)  # items per task (0 = every item)
    eval_dir: str = option("", TASKS)  # the task files' directory ("" = grt eval's default)
    save_every: int = option(1000, saving=True)
    save_final: bool = True  # a checkpoint at the last step (false: benchmarks, whose runs are thrown away)
    keep_checkpoints: int = option(3, saving=True)
    # grt export's copy (with hf/) of every Nth step's checkpoint, in <checkpoint>/export, written by a
    # child process while training goes on, pruned with its checkpoint; a multiple of save_every (0 = off)
    export_every: int = option(0, saving=True)
    # s3://bucket/run (or gs://): each complete checkpoint uploaded there in the background, COMPLETE last,
    # pruned by keep_checkpoints; a --resume whose local copy is gone or older fetches from it ("" = off;
    # credentials from the environment only: pretrain/runs/checkpoint_mirror.py)
    checkpoint_mirror: str = option("", saving=True)
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    dist_timeout_s: float = 600.0
    peak_tflops: float = 0.0  # device peak for MFU; 0 = look up the device
    compile: bool = False
    zero3_pin_core: bool = True  # keep the looped core gathered under ZeRO-3 (training/engine/deepspeed_internals.py)
    allow_data_change: bool = False  # resume although the shard list changed since the checkpoint
    allow_batch_change: bool = False  # resume with another global batch (micro-batch x grad_accum x ranks)
    # watching a run (docs/training.md, "Watching a run")
    profile: str = ""  # torch profiler window "wait,warmup,active" steps (e.g. "10,2,3"), traced once; "" = off
    profile_ranks: str = option("0", PROFILE)  # the ranks that trace: comma-separated ranks, or "all"
    time_breakdown: bool = True  # on logging steps: the step's time per span (data, forward, backward, optimizer)
    memory_history: bool = False  # CUDA: record the allocator's history, for memory snapshots on demand and on OOM
    data_starved_share: float = 0.2  # warn when waiting for data takes more than this share of a logged step
    slow_rank_factor: float = 1.5  # a rank whose local step time exceeds the median's by this factor is slow...
    slow_rank_windows: int = 3  # ...on this many logging steps in a row: named in one warning line
    loss_spike_threshold: float = 6.0  # a step loss this many robust standard deviations above the running median
    # of the last 100 steps is a spike: logged (one line, train/loss_spike); 0 = off
    # log; skip: a micro-batch whose loss is above that limit is dropped on every rank and replaced by the next
    # (listed in <out>/spikes.jsonl); rollback: back to the last complete checkpoint, the data since it skipped
    # (recorded in <out>/data_skips.json, which a resume follows)
    loss_spike_action: str = option("log", SPIKES)
    wandb: bool = False  # also log to Weights & Biases (the [wandb] extra; WANDB_MODE=offline works without network)
    wandb_project: str = option("grt", WANDB)
    wandb_entity: str = option("", WANDB)  # "" = the W&B default entity


for _f in dataclasses.fields(TrainConfig):
    if _f.metadata.get("needs"):
        switch_rule(f"train.{_f.name}", *_f.metadata["needs"])


def loader_workers(num_workers: int, cuda: bool) -> int:
    """The loader processes of train.num_workers on this device: auto (-1) is 2 on CUDA, where the
    data's reading and its pinned copy then leave the step's critical path (docs/gpu.md), and 0 on
    the CPU, whose cores train; a count given is kept."""
    if num_workers != AUTO_WORKERS:
        return num_workers
    return CUDA_WORKERS if cuda else 0


def tokens_per_step(train: TrainConfig, world: int, seq_len: int) -> int:
    """The training tokens of one optimizer step: its global batch of `seq_len`-token samples."""
    return global_batch(train, world) * seq_len


def budget_steps(tokens: float, per_step: int) -> int:
    """The steps a budget of `tokens` training tokens gives at `per_step` tokens a step (at least one)."""
    return max(1, math.ceil(tokens / per_step))


@note
def _muon_clip(cfg: Any) -> list[str]:
    """The start says the clip Muon took in place of AdamW's default."""
    if cfg.train.optimizer != "muon" or cfg.train.grad_clip or given(cfg, "train.grad_clip"):
        return []
    return ["train.grad_clip: 0 under train.optimizer=muon (its own clip of each matrix's update; no gradient clip)"]
