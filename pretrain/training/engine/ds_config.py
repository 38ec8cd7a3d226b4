"""Merge a DeepSpeed JSON with the run config, once, before any process group exists.

The rule (docs/launching.md, "DeepSpeed configs"): the run config owns the batch sizes,
the optimizer, the learning-rate schedule, the precision and gradient clipping. In the
DeepSpeed file each of these may be absent, "auto" (filled from the run config, as the
Hugging Face trainer does), or equal to the run config's value; any other value is
refused with one line naming both values. Everything else (ZeRO, offload, communication,
logging) belongs to DeepSpeed and is used as written; "auto" there means DeepSpeed's own
default.

The schedule (pretrain/training/engine/lr_schedule.py): `cosine` is DeepSpeed's WarmupCosineLR, written
into the merged config's `scheduler` section; `wsd` has no DeepSpeed type, so the merged config
has no `scheduler` section (the engine is given the scheduler, engine/build.py) and the file's
`scheduler.type` must be absent or "auto", its params "auto" or agreeing.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from grt_common.files import atomic_write_text
from pretrain.model_config import load_json_object
from pretrain.runs.config_layers import SHIPPED_DIR, resolve_ds_path
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import TrainConfig
from pretrain.training.engine.lr_schedule import horizon, warmup_num_steps

AUTO = "auto"
# optimizer types that are AdamW in DeepSpeed ("Adam" is AdamW unless adam_w_mode is false)
ADAMW_TYPES = ("adamw", "adam")
SCHEDULER_TYPE = "WarmupCosineLR"


def load_ds_json(path: str | Path) -> dict[str, Any]:
    return load_json_object(
        resolve_ds_path(path),
        f"ds_config={str(path)!r}",
        f" (configs ship in {SHIPPED_DIR.name}/: zero1.json, zero2.json, zero3.json)",
    )


ZERO_STAGES = (0, 1, 2, 3)
# ZeRO sizes (numbers of elements) that DeepSpeed refuses only when it builds the engine, after
# the process group: checked here, at the merge. (key, smallest accepted value)
ZERO_SIZES = (
    ("reduce_bucket_size", 1),
    ("allgather_bucket_size", 0),
    ("sub_group_size", 0),
    ("stage3_prefetch_bucket_size", 0),
    ("stage3_param_persistence_threshold", 0),
    ("stage3_max_live_parameters", 0),
    ("stage3_max_reuse_distance", 0),
)


def zero_stage(ds: dict[str, Any]) -> int:
    """The ZeRO stage of a DeepSpeed config (checked by `check_ds_values`; "auto" and absent: 0)."""
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    return 0 if stage == AUTO else int(stage)


def _whole(value: Any) -> bool:
    """A whole number as JSON writes it (5e8 included), not a bool."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
    )


def check_ds_values(ds: dict[str, Any]) -> None:
    """Refuse, in one line naming the key, a DeepSpeed value this project reads or that DeepSpeed
    would refuse only after the process group exists: a section that is not an object, a ZeRO
    stage other than 0-3, a negative ZeRO size, a non-positive Adam eps or steps_per_print."""
    for key in ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler"):
        section = ds.get(key)
        if key in ds and not isinstance(section, dict) and not (key != "zero_optimization" and section is None):
            raise ConfigError(f"DeepSpeed config {key}={json.dumps(section)}: must be a JSON object")
        for sub in ("params",) if key in ("optimizer", "scheduler") else ():
            inner = (section or {}).get(sub)
            if inner is not None and not isinstance(inner, dict):
                raise ConfigError(f"DeepSpeed config {key}.{sub}={json.dumps(inner)}: must be a JSON object")
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage != AUTO and not (_whole(stage) and int(stage) in ZERO_STAGES):
        raise ConfigError(
            f"DeepSpeed config zero_optimization.stage={json.dumps(stage)}: accepted values are "
            f'{", ".join(map(str, ZERO_STAGES))} (or "auto": DeepSpeed\'s default, 0)'
        )
    for key, least in ZERO_SIZES:
        value = zero.get(key, AUTO)
        if value != AUTO and not (_whole(value) and value >= least):
            raise ConfigError(
                f"DeepSpeed config zero_optimization.{key}={json.dumps(value)}: must be a whole number >= {least} "
                '(or "auto")'
            )
    eps = ((ds.get("optimizer") or {}).get("params") or {}).get("eps", AUTO)
    if eps != AUTO and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < math.inf):
        raise ConfigError(f'DeepSpeed config optimizer.params.eps={json.dumps(eps)}: must be a number > 0 (or "auto")')
    steps = ds.get("steps_per_print", AUTO)
    if steps != AUTO and not (_whole(steps) and steps >= 1):
        raise ConfigError(f"DeepSpeed config steps_per_print={json.dumps(steps)}: must be a whole number >= 1")


def _precision(train: TrainConfig, use_cuda: bool) -> str:
    return train.precision if train.precision != "auto" else ("bf16" if use_cuda else "fp32")


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(ours, (list, tuple)):
        return (
            isinstance(theirs, (list, tuple))
            and len(theirs) == len(ours)
            and all(_same(a, b) for a, b in zip(theirs, ours))
        )
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return theirs is ours
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        return abs(theirs - ours) <= 1e-12 * max(abs(ours), 1.0)
    return theirs == ours


def _agree(key: str, theirs: Any, ours: Any, owner: str, fix: str | None = None) -> None:
    """Refuse a DeepSpeed value that is neither "auto" nor the run config's (one line, both values)."""
    if theirs != AUTO and not _same(theirs, ours):
        if fix is None:
            fix = f", or change {owner}" if owner.startswith("train.") else ""
        raise ConfigError(
            f"DeepSpeed config {key}={json.dumps(theirs)} disagrees with the run config "
            f"({owner} = {json.dumps(ours)}): remove it from the DeepSpeed file or set it to "
            f'"auto"{fix}'
        )


# Every parameter (of any size) stays gathered under ZeRO-3: above any parameter's numel.
ALL_PERSISTENT = 10**15


def _zero_defaults(zero: dict[str, Any], world_size: int) -> dict[str, Any]:
    """ZeRO settings filled where the DeepSpeed file leaves them out (a value in the file,
    "auto" included, is used as the rule above says):
    - `overlap_comm` on with more than one rank only: it overlaps the gradient reduction with
      the backward, and on one GPU, with nothing to reduce, it only costs DeepSpeed's
      `cuda.synchronize()` at the end of every backward (ZeRO-1 per bucket, ZeRO-3 on its
      reduce stream);
    - ZeRO-3 on one rank: every parameter persistent. A parameter's partition is the whole
      parameter, so partitioning saves no memory; it costs a gather (a second full copy) and a
      release per module call and per recompute, for every matrix above DeepSpeed's threshold
      of 1e5 elements.
    Deliberately not set: leaf modules (`set_z3_leaf_modules`,
    `stage3_module_granularity_threshold`) for the shared core, which fail with an
    AssertionError once the core runs more than once per step (docs/zero3.md); the core is
    pinned instead (`train.zero3_pin_core`)."""
    filled: dict[str, Any] = {"overlap_comm": world_size > 1}
    if int(zero.get("stage", 0)) == 3 and world_size == 1:
        filled["stage3_param_persistence_threshold"] = ALL_PERSISTENT
    return {**filled, **zero}


def _drop_auto(tree: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's own keys left "auto": removed, so that DeepSpeed's default applies."""
    return {k: _drop_auto(v) if isinstance(v, dict) else v for k, v in tree.items() if v != AUTO}


def build_ds_config(base: dict[str, Any], train: TrainConfig, world_size: int, use_cuda: bool) -> dict[str, Any]:
    """The DeepSpeed config the engine gets: `base` (a DeepSpeed file) merged with the run
    config by the rule of this module's docstring."""
    check_ds_values(base)
    ds = copy.deepcopy(base)
    if zero_stage(ds) >= 1:
        ds["zero_optimization"] = _zero_defaults(ds["zero_optimization"], world_size)
    mb, ga = train.micro_batch_size, train.grad_accum
    owned = {
        "train_micro_batch_size_per_gpu": (mb, "train.micro_batch_size", None),
        "gradient_accumulation_steps": (ga, "train.grad_accum", None),
        "train_batch_size": (
            mb * ga * world_size,
            f"micro_batch_size {mb} x grad_accum {ga} x ranks {world_size}",
            ", or change train.micro_batch_size, train.grad_accum or the number of ranks",
        ),
        "gradient_clipping": (train.grad_clip, "train.grad_clip", None),
    }
    for key, (ours, owner, fix) in owned.items():
        _agree(key, ds.get(key, AUTO), ours, owner, fix)
        ds[key] = ours

    precision = _precision(train, use_cuda)
    precision_owner = f"train.precision ({train.precision!r}: {precision} on {'CUDA' if use_cuda else 'CPU'})"
    for block, ours in (("bf16", precision == "bf16"), ("fp16", False)):
        section = dict(ds.get(block) or {})
        _agree(
            f"{block}.enabled",
            section.get("enabled", AUTO),
            ours,
            precision_owner if block == "bf16" else "train.precision (no fp16: bf16 or fp32)",
        )
        ds[block] = {**section, "enabled": ours}
    if precision == "bf16" and ds["bf16"].get("check_grad_overflow", AUTO) == AUTO:
        # DeepSpeed's overflow check reads the device every step (ZeRO-1/2: `.item()`, then `bool()` of
        # the norm); bf16 needs no loss scale, and the trainer's own check of the norm, read with the next
        # step's controls, stops a run whose gradient was not finite before anything is saved (docs/gpu.md)
        ds["bf16"]["check_grad_overflow"] = False

    # torch's fused AdamW on every device, through DeepSpeed's `torch_adam` switch: DeepSpeed's own
    # FusedAdam (CUDA) and CPUAdam compile an extension on first use, which the GPU machine may not
    # manage; the update is the same (tests/launch/test_optimizer.py)
    adam = {
        "lr": train.lr,
        "betas": list(train.betas),
        "eps": 1e-8,
        "weight_decay": train.weight_decay,
        "torch_adam": True,
        "fused": True,
    }
    optimizer = ds.get("optimizer") or {}
    kind = optimizer.get("type", AUTO)
    if train.optimizer == "muon":
        ds["optimizer"] = _muon_optimizer(ds, adam, train)
    elif kind != AUTO and str(kind).lower() not in ADAMW_TYPES:
        _agree("optimizer.type", kind, "AdamW", "the trainer's optimizer (train.optimizer)")
    params = dict(optimizer.get("params") or {})
    if params.get("adam_w_mode") is False:
        _agree("optimizer.params.adam_w_mode", False, True, "the trainer's optimizer (AdamW)")
    for key, owner in (("lr", "train.lr"), ("betas", "train.betas"), ("weight_decay", "train.weight_decay")):
        _agree(f"optimizer.params.{key}", params.get(key, AUTO), adam[key], owner)
    if train.optimizer != "muon":
        # eps and DeepSpeed's optimizer switches are not in the run config: the file's, else ours
        ds["optimizer"] = {"type": "AdamW", "params": {**adam, **{k: v for k, v in params.items() if v != AUTO}}}

    schedule = {  # a resumed run with more steps keeps its started horizon (train.schedule_steps)
        "total_num_steps": horizon(train),
        "warmup_num_steps": warmup_num_steps(train),
        "warmup_min_ratio": 0.0,
        "cos_min_ratio": train.min_lr / train.lr,
        "warmup_type": "linear",
    }
    schedule_owner = {
        "total_num_steps": "train.schedule_steps (else train.steps)",
        "warmup_num_steps": "train.warmup_steps",
        "warmup_min_ratio": "the trainer's warmup (from 0)",
        "cos_min_ratio": "train.min_lr / train.lr",
        "warmup_type": "the trainer's warmup (linear)",
    }
    scheduler = ds.get("scheduler") or {}
    kind = scheduler.get("type", AUTO)
    if train.schedule == "wsd":
        _check_wsd_scheduler(scheduler, schedule, schedule_owner)
        ds.pop("scheduler", None)  # engine/build.py gives DeepSpeed the wsd scheduler itself (engine/lr_schedule.py)
        return _drop_auto(ds)
    if kind != AUTO and kind != SCHEDULER_TYPE:
        _agree(
            "scheduler.type",
            kind,
            SCHEDULER_TYPE,
            "the run config's schedule: linear warmup over train.warmup_steps, cosine to train.min_lr",
        )
    for key, value in (scheduler.get("params") or {}).items():
        if key in schedule:
            _agree(f"scheduler.params.{key}", value, schedule[key], schedule_owner[key])
        elif value != AUTO:
            schedule[key] = value
    ds["scheduler"] = {"type": SCHEDULER_TYPE, "params": schedule}
    return _drop_auto(ds)


def _muon_optimizer(ds: dict[str, Any], adam: dict[str, Any], train: TrainConfig) -> dict[str, Any]:
    """The "optimizer" section of train.optimizer=muon: DeepSpeed's "Muon" (its auxiliary AdamW,
    torch's, at train.lr for the embeddings, norms, biases, gains; engine/build.py's groups give each its
    weight decay), or a refusal where the file or the run config has what DeepSpeed's Muon cannot do."""
    optimizer = ds.get("optimizer") or {}
    kind = optimizer.get("type", AUTO)
    if kind != AUTO and str(kind).lower() != "muon":
        _agree("optimizer.type", kind, "Muon", "train.optimizer (muon)")
    params = dict(optimizer.get("params") or {})
    muon = {"muon_lr": train.muon_lr, "adam_lr": train.lr, "momentum": train.muon_momentum}
    owners = {"muon_lr": "train.muon_lr", "adam_lr": "train.lr", "momentum": "train.muon_momentum"}
    for key, ours in muon.items():
        _agree(f"optimizer.params.{key}", params.get(key, AUTO), ours, owners[key])
    if train.grad_clip > 0:
        raise ConfigError(
            f"train.optimizer=muon with train.grad_clip={train.grad_clip}: DeepSpeed's Muon clips the "
            "orthogonalised update of every matrix, not the gradient, so a clip of the gradient's size scales "
            "Muon's step down by the whole model's update norm; set train.grad_clip=0"
        )
    zero = ds.get("zero_optimization") or {}
    if zero_stage(ds) == 3:  # ZeRO-3 gathers each whole matrix for Muon itself, in place of the reduce-scatter
        if zero.get("reduce_scatter", AUTO) not in (AUTO, False):
            raise ConfigError(
                f"DeepSpeed config zero_optimization.reduce_scatter={json.dumps(zero['reduce_scatter'])}: DeepSpeed's "
                "Muon under ZeRO-3 cannot reduce-scatter; remove it or set it to false, or train.optimizer=adamw"
            )
        ds["zero_optimization"] = {**zero, "reduce_scatter": False}
    merged = {**{k: v for k, v in adam.items() if k != "fused"}, **muon}
    return {"type": "Muon", "params": {**merged, **{k: v for k, v in params.items() if v != AUTO}}}


def _check_wsd_scheduler(scheduler: dict[str, Any], schedule: dict[str, Any], owner: dict[str, str]) -> None:
    """train.schedule=wsd: no DeepSpeed scheduler type implements it, so the DeepSpeed file's
    scheduler type must be absent or "auto"; a parameter must be "auto" or agree with the run
    config where it means the same (the warmup, the horizon, min_lr / lr), and is refused otherwise."""
    kind = scheduler.get("type", AUTO)
    if kind != AUTO:
        raise ConfigError(
            f"DeepSpeed config scheduler.type={json.dumps(kind)} disagrees with the run config "
            '(train.schedule = "wsd": warmup-stable-decay, the trainer\'s own scheduler, no DeepSpeed type): remove '
            'it from the DeepSpeed file or set it to "auto", or change train.schedule'
        )
    for key, value in (scheduler.get("params") or {}).items():
        if key in schedule:
            _agree(f"scheduler.params.{key}", value, schedule[key], owner[key])
        elif value != AUTO:
            raise ConfigError(
                f"DeepSpeed config scheduler.params.{key}={json.dumps(value)} is no setting of the run config's "
                'schedule (train.schedule = "wsd": train.lr, min_lr, warmup_steps, decay_tokens, decay_shape): '
                'remove it from the DeepSpeed file or set it to "auto"'
            )


def merged_ds_config(cfg: RunConfig, world_size: int, use_cuda: bool) -> dict[str, Any]:
    """The run's DeepSpeed config: its `ds_config` file merged with the run config."""
    return build_ds_config(load_ds_json(cfg.ds_config), cfg.train, world_size, use_cuda)


def ds_config_json(ds: dict[str, Any]) -> str:
    """The bytes of `<out>/ds_config.json` (and of what `grt train --print-ds-config` prints)."""
    return json.dumps(ds, indent=2) + "\n"


def save_ds_config(ds: dict[str, Any], out_dir: str | Path) -> Path:
    """Write the merged DeepSpeed config next to the run config (`<out>/ds_config.json`)."""
    path = Path(out_dir) / "ds_config.json"
    atomic_write_text(path, ds_config_json(ds))  # complete or absent, a failure naming it
    return path
