"""The run config: one typed object (model + training), resolved once on the launching
host, saved as JSON in the run directory and in every checkpoint.

Overrides use dotted keys: `--set train.lr=3e-4 --set model.d_model=256`. Every key and
type is checked before any process group is created.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.config import ConfigError, ModelConfig, check_keys, coerce, load_json_object
from pretrain.presets import get_preset
from pretrain.runs.data_spec import DataSpec, data_stages, parse_data
from pretrain.runs.eval_tasks import task_depths, task_names
from pretrain.runs.settings_rules import check_settings, given_keys, profile_refusal, profile_window
from pretrain.variants import get_variant

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture

DEPTH_SAMPLING = ("uniform", "fixed", "poisson", "loguniform")
# train.activation_checkpointing (pretrain/training/engine/parallelize.py): explicit modes, cheapest
# recompute first; `auto` picks one for the run
CHECKPOINT_MODES = ("off", "selective", "loop_step", "block")
AUTO = "auto"
PRECISIONS = ("auto", "bf16", "fp32")
OPTIMIZERS = ("adamw", "muon")  # TrainConfig.optimizer


@dataclass
class TrainConfig:
    steps: int = 20000
    tokens: float = 0.0  # the run's length in training tokens (e.g. 3e9): steps = ceil(tokens / tokens per step);
    # 0 = train.steps
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 2000
    schedule_steps: int = 0  # learning-rate schedule horizon; 0 = steps (a resume with new steps keeps the old)
    schedule: str = "cosine"  # cosine: warmup then cosine to min_lr over the horizon; wsd: warmup-stable-decay
    decay_tokens: float = 0.0  # wsd: the decay phase, the run's last this many tokens (0: no decay, stable to the
    # end: a run to branch decays from, docs/training.md)
    decay_shape: str = "linear"  # wsd: linear or sqrt (1 - sqrt) from lr to min_lr
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    optimizer: str = "adamw"  # adamw; muon: DeepSpeed's Muon for the hidden matrices, AdamW (lr, betas) for the rest
    muon_lr: float = 0.02  # muon: the matrices' peak learning rate (the schedule scales it as it scales lr)
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0  # muon: the matrices' decoupled decay, times muon_lr per step (DeepSpeed's default)
    async_save: bool = False  # checkpoint files written by a background thread while training goes on
    seed: int = 1234
    depth_sampling: str = "uniform"  # uniform: r ~ U{1..R}; fixed: R; poisson: Huginn's heavy tail;
    # loguniform: floor(exp(U[0, log(R+1)))), depth extrapolation
    max_train_depth: int = 0  # the R of the sampling above (0 = the layout's R); e.g. 32 with
    # loguniform keeps the loss flat past R (docs/evaluation.md)
    poisson_mean: float = 32.0  # rbar of the heavy-tail Poisson (capped at the layout's R x 4)
    poisson_sigma: float = 0.5
    activation_checkpointing: str = AUTO  # auto: off, selective or loop_step by the device memory left;
    # or one of those, or block (pretrain/training/engine/parallelize.py)
    doc_mask: bool = False  # attend only within a packed document
    precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    num_workers: int = 0
    shuffle_buffer: int = 1000
    data_stages: str = ""  # a mixture's weights from a token count on: "2e9:web=0.2,books=0.8;3e9:web=0,books=1"
    max_repeats: float = 0.0  # a mixture source's train split is read at most this many times (0 = no cap)
    skip_corrupt_shards: bool = False
    log_every: int = 10
    eval_every: int = 500
    eval_batches: int = 20
    eval_tasks_every: int = 0  # score the zero-shot tasks every this many steps (0 = off), at eval_tasks_depths
    eval_tasks: str = "all"  # comma-separated task names (pretrain/infer/evaluation/zero_shot.py), or all
    eval_tasks_depths: str = ""  # exit depths, comma-separated; "" = 1, R/2, R
    eval_tasks_limit: int = 200  # items per task (0 = every item)
    eval_dir: str = ""  # the task files' directory ("" = grt eval's default)
    save_every: int = 1000
    save_final: bool = True  # a checkpoint at the last step (false: benchmarks, whose runs are thrown away)
    keep_checkpoints: int = 3
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    dist_timeout_s: float = 600.0
    peak_tflops: float = 0.0  # device peak for MFU; 0 = look up the device
    compile: bool = False
    zero3_pin_core: bool = True  # keep the looped core gathered under ZeRO-3 (training/engine/deepspeed_internals.py)
    allow_data_change: bool = False  # resume although the shard list changed since the checkpoint
    allow_batch_change: bool = False  # resume with another global batch (micro-batch x grad_accum x ranks)
    # watching a run (docs/training.md, "Watching a run")
    profile: str = ""  # torch profiler window "wait,warmup,active" steps (e.g. "10,2,3"), traced once; "" = off
    profile_ranks: str = "0"  # the ranks that trace: comma-separated ranks, or "all"
    time_breakdown: bool = True  # on logging steps: the step's time per span (data, forward, backward, optimizer)
    memory_history: bool = False  # CUDA: record the allocator's history, for memory snapshots on demand and on OOM
    data_starved_share: float = 0.2  # warn when waiting for data takes more than this share of a logged step
    slow_rank_factor: float = 1.5  # a rank whose local step time exceeds the median's by this factor is slow...
    slow_rank_windows: int = 3  # ...on this many logging steps in a row: named in one warning line
    loss_spike_threshold: float = 6.0  # a step loss this many robust standard deviations above the running median
    # of the last 100 steps is a spike: logged (one line, train/loss_spike); 0 = off
    loss_spike_action: str = "log"  # log; skip: a micro-batch whose loss is above that limit is dropped on every
    # rank and replaced by the next (listed in <out>/spikes.jsonl); rollback: back to the last complete checkpoint,
    # the data since it skipped (recorded in <out>/data_skips.json, which a resume follows)
    wandb: bool = False  # also log to Weights & Biases (the [wandb] extra; WANDB_MODE=offline works without network)
    wandb_project: str = "grt"
    wandb_entity: str = ""  # "" = the W&B default entity


SPIKE_ACTIONS = ("log", "skip", "rollback")  # what a loss spike does (TrainConfig.loss_spike_action)
SCHEDULES = ("cosine", "wsd")  # TrainConfig.schedule
DECAY_SHAPES = ("linear", "sqrt")  # TrainConfig.decay_shape


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny-grt"))
    train: TrainConfig = field(default_factory=TrainConfig)
    data: str = ""  # manifest.json from `grt data prepare`
    ds_config: str = "ds_configs/zero3.json"
    out: str = "runs/default"
    branch_from: str = ""  # a decay branch: the checkpoint (tag directory) it starts from (--branch-from,
    # pretrain/training/start/branch.py); "" = none

    def validate(self) -> None:
        """Every value checked once, before anything starts: the first meaningless one is a
        ConfigError of one line naming the key, its value and what is accepted; then the rules of
        settings_rules.py (what each setting needs to take effect)."""
        self.model.validate()
        for ok, message in (*train_checks(self.train), *self._top_checks()):
            if not ok:
                raise ConfigError(message)
        sources = self.data_spec.sources  # a mixture that does not parse: one line now
        if sources is not None:
            data_stages(self.train.data_stages, [s.name for s in sources])  # stages that do not parse, too
        task_names(self.train.eval_tasks)
        task_depths(self.train.eval_tasks_depths, self.model)  # against the model's layout
        check_settings(self)

    @property
    def data_spec(self) -> DataSpec:
        """`data` parsed, once per value (parse_data): what every reader of the run's data uses."""
        return parse_data(self.data)

    def _top_checks(self) -> list[tuple[bool, str]]:
        return [
            (bool(self.data), "data: the manifest.json written by `grt data prepare` is required (--data)"),
            (bool(self.out), f"out={self.out!r}: the run directory is required (--out)"),
            (bool(self.ds_config), f"ds_config={self.ds_config!r}: a DeepSpeed JSON is required (--ds-config)"),
        ]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The bytes of the run's `config.json` (and of what `--print-config` and `--dry-run` print)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data)
        model = data.pop("model", None)
        train = data.pop("train", {})
        top = check_keys(cls, data, "run config")
        if isinstance(model, str):
            model_cfg = get_preset(model)
        elif model is None:
            model_cfg = get_preset("tiny-grt")
        else:
            model_cfg = ModelConfig.from_dict(model)
        # what the train section leaves out follows the model's recipe, then TrainConfig's defaults
        train = {**train_recipe(model_cfg), **train}
        train_cfg = TrainConfig(**check_keys(TrainConfig, _tuples(train), "train config"))
        return cls(model=model_cfg, train=train_cfg, **top)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(load_json_object(path, str(path)))


def _finite(x: Any) -> bool:
    """A real number (not a bool, not NaN or infinite)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _betas_ok(betas: Any) -> bool:
    return isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas)


def train_checks(t: TrainConfig) -> list[tuple[bool, str]]:
    """(ok, the one line that refuses it) for every `train.*` value that can be meaningless
    (docs/reliability.md, "Values checked at the door"). Types are checked before, on parse."""
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
        (0 <= t.seed < 2**63, f"train.seed={t.seed}: must be in [0, 2**63)"),
        (
            _finite(t.poisson_mean) and t.poisson_mean > 0,
            f"train.poisson_mean={t.poisson_mean}: must be > 0 (the mean depth of poisson sampling)",
        ),
        (_finite(t.poisson_sigma) and t.poisson_sigma >= 0, f"train.poisson_sigma={t.poisson_sigma}: must be >= 0"),
        (t.num_workers >= 0, f"train.num_workers={t.num_workers}: must be >= 0 (0 = load in the training process)"),
        (t.shuffle_buffer >= 0, f"train.shuffle_buffer={t.shuffle_buffer}: must be >= 0 (0 = no shuffle buffer)"),
        (t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1"),
        (t.eval_every >= 0, f"train.eval_every={t.eval_every}: must be >= 0 (0 = off)"),
        (
            t.eval_batches >= 1,
            f"train.eval_batches={t.eval_batches}: must be >= 1 (turn evaluation off with eval_every=0)",
        ),
        (t.save_every >= 0, f"train.save_every={t.save_every}: must be >= 0 (0 = off)"),
        (t.keep_checkpoints >= 1, f"train.keep_checkpoints={t.keep_checkpoints}: must be >= 1"),
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


def train_recipe(model: ModelConfig) -> dict[str, Any]:
    """The training settings the model's method trains with (its Variant's recipe: depth sampling
    and its parameters), for the model as configured (Huginn's Poisson mean follows its R)."""
    return get_variant(model.variant).train_recipe(model)


def is_model_override(item: str) -> bool:
    return item.startswith("model.")


def choose_model(cfg: RunConfig, model: ModelConfig, overrides: list[str]) -> RunConfig:
    """Give the run `model`, in the one order every command follows: the model, its `model.*`
    overrides, the training recipe of the model so overridden, then (by the caller, last) the
    user's training settings, which win over the recipe."""
    cfg.model = model
    apply_overrides(cfg, [item for item in overrides if is_model_override(item)])
    return apply_recipe(cfg)


def apply_recipe(cfg: RunConfig) -> RunConfig:
    recipe = train_recipe(cfg.model)
    cfg.train = dataclasses.replace(cfg.train, **recipe)
    return cfg


def global_batch(train: TrainConfig, world: int) -> int:
    """The sequences of one optimizer step: every rank's micro-batches of it."""
    return train.micro_batch_size * train.grad_accum * world


def tokens_per_step(train: TrainConfig, world: int, seq_len: int) -> int:
    """The training tokens of one optimizer step: its global batch of `seq_len`-token samples."""
    return global_batch(train, world) * seq_len


def budget_steps(tokens: float, per_step: int) -> int:
    """The steps a budget of `tokens` training tokens gives at `per_step` tokens a step (at least one)."""
    return max(1, math.ceil(tokens / per_step))


def apply_token_budget(cfg: RunConfig, world: int, seq_len: int, trained: tuple[int, int] = (0, 0)) -> str:
    """train.tokens sets train.steps: the `trained` (steps, tokens) of a resume's checkpoint, then the
    rest at the global batch on `world` ranks of `seq_len`-token samples (`budget_steps`), so that a
    changed global batch trains the budget. Returns the line that says so (empty without a budget)."""
    t = cfg.train
    if not t.tokens:
        return ""
    per_step = tokens_per_step(t, world, seq_len)
    done_steps, done = trained
    rest = budget_steps(t.tokens - done, per_step) if t.tokens > done else 0
    t.steps = done_steps + rest
    total = done + rest * per_step
    if done == done_steps * per_step:  # every step at this global batch
        return f"train.tokens={t.tokens:.4g}: {t.steps} steps of {per_step} tokens ({total:.4g} tokens)"
    return (
        f"train.tokens={t.tokens:.4g}: {t.steps} steps ({done_steps} trained, {done} tokens; then {rest} of "
        f"{per_step} tokens) ({total:.4g} tokens)"
    )


def resolve(
    cfg: RunConfig, manifest: Manifest | DataMixture | None = None, notes: list[str] | None = None
) -> RunConfig:
    """Checks that need the data: the model's vocabulary and context follow the tokenizer's.
    (The splits' sizes against the batch are the trainer's, which knows the ranks.) A vocabulary
    changed is said in one line, into `notes`; one the command line set itself is refused."""
    manifest = manifest or cfg.data_spec.load()
    old, new = cfg.model.vocab_size, manifest.vocab_size
    if old != new:
        if "model.vocab_size" in given_keys(cfg):
            raise ConfigError(
                f"model.vocab_size={old} (--set) is not the vocabulary of the data's tokenizer, {new} "
                f"(data={cfg.data!r}): the model's vocabulary follows the tokenizer; drop the --set, or "
                "prepare the data with a tokenizer of that size"
            )
        cfg.model.vocab_size = new
        if notes is not None:
            notes.append(f"model.vocab_size {old} -> {new}: the vocabulary of the data's tokenizer")
    if manifest.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"the shards' seq_len={manifest.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    cfg.validate()
    return cfg


def _tuples(train: dict) -> dict:
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in train.items()}


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.key=value` strings (sections: model, train; or a top-level key)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=3e-4")
        key, value = item.split("=", 1)
        section, _, name = key.rpartition(".")
        target: Any = {"": cfg, "model": cfg.model, "train": cfg.train}.get(section)
        if target is None:
            raise ConfigError(
                f"override {item!r}: unknown section {section!r}; accepted: model, train, or a top-level key"
            )
        fields = {f.name: f for f in dataclasses.fields(target)}
        if name not in fields or name in ("model", "train"):
            accepted = ", ".join(f for f in fields if f not in ("model", "train"))
            raise ConfigError(f"override {item!r}: unknown key {key!r}; accepted keys: {accepted}")
        parsed: Any
        if name == "betas":
            try:
                parsed = tuple(float(x) for x in value.strip("()[] ").split(","))
            except ValueError:
                raise ConfigError(f"{key}={value!r}: expected two numbers, e.g. {key}=0.9,0.95") from None
        elif name == "extra":
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{key}={value!r}: expected a JSON object ({err})") from None
        else:
            parsed = coerce(key, value, fields[name].type)
        setattr(target, name, parsed)
    cfg.model.validate()
    return cfg
