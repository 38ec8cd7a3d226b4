"""Merge a DeepSpeed JSON from ds_configs/ with the run config, once, before any process
group exists. The run config is the source of truth for batch sizes, optimizer,
schedule, precision and clipping; a DeepSpeed file that disagrees is refused."""
from __future__ import annotations

import copy
from pathlib import Path

from pretrain.config import ConfigError, load_json_object
from pretrain.training.run_config import TrainConfig


def load_ds_json(path: str | Path) -> dict:
    return load_json_object(path, f"ds_config={str(path)!r}",
                            " (configs ship in ds_configs/: zero1.json, zero2.json, zero3.json)")


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def build_ds_config(base: dict, train: TrainConfig, world_size: int, use_cuda: bool) -> dict:
    ds = copy.deepcopy(base)
    mb, ga = train.micro_batch_size, train.grad_accum
    for key, ours in (("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", ga)):
        if key in ds and ds[key] != ours:
            raise ConfigError(f"DeepSpeed {key}={ds[key]} disagrees with the run config ({ours}); "
                              f"remove it from the DeepSpeed file or set train.{'micro_batch_size' if 'micro' in key else 'grad_accum'}")
    if "train_batch_size" in ds and ds["train_batch_size"] != mb * ga * world_size:
        raise ConfigError(f"DeepSpeed train_batch_size={ds['train_batch_size']} != micro_batch_size {mb} x grad_accum {ga} "
                          f"x ranks {world_size} = {mb * ga * world_size}; fix one of train.micro_batch_size, "
                          "train.grad_accum, the number of ranks, or train_batch_size")
    ds.update(train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga, train_batch_size=mb * ga * world_size,
              gradient_clipping=train.grad_clip)
    adam = {"lr": train.lr, "betas": list(train.betas), "eps": 1e-8, "weight_decay": train.weight_decay}
    if not use_cuda:
        # DeepSpeed's FusedAdam/CPUAdam JIT-compile on first use; torch's fused AdamW needs no build
        adam.update(torch_adam=True, fused=True)
    ds.setdefault("optimizer", {"type": "AdamW", "params": adam})
    horizon = train.schedule_steps or train.steps
    ds.setdefault("scheduler", {"type": "WarmupCosineLR", "params": {
        "total_num_steps": horizon, "warmup_num_steps": max(1, min(train.warmup_steps, horizon)),
        "warmup_min_ratio": 0.0, "cos_min_ratio": train.min_lr / train.lr, "warmup_type": "linear"}})
    precision = train.precision if train.precision != "auto" else ("bf16" if use_cuda else "fp32")
    ds["bf16"] = {"enabled": precision == "bf16"}
    ds.setdefault("fp16", {"enabled": False})
    return ds
