"""The DeepSpeed engine of a run: the model built under ZeRO-3's `zero.Init`, its optimizer
groups, activation checkpointing and compilation applied from outside it (after DeepSpeed has
placed the weights, so that `auto` sees the memory left), the learning-rate scheduler
(engine/lr_schedule.py: cosine from the merged config, wsd given to DeepSpeed), and ZeRO-3's core pinning. The
trainer, `grt compare`'s step timing and the gradient checks build it the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pretrain.kernels.probe import probe_fused_paths
from pretrain.model import build_model
from pretrain.model.flops import count_params
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import TrainConfig, tokens_per_step
from pretrain.training.engine import deepspeed_internals
from pretrain.training.engine.activation_checkpointing import checkpointing_mode
from pretrain.training.engine.ds_config import build_ds_config, load_ds_json, zero_stage
from pretrain.training.engine.lr_schedule import client_scheduler
from pretrain.training.engine.muon import muon_names, tagged
from pretrain.training.engine.parallelize import checkpoint_and_compile

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def param_groups(model: torch.nn.Module, train: TrainConfig) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases, or the gate's biases). Under ZeRO-3's
    `zero.Init` a parameter is its flat partition (`p.dim()` 1): its shape is `ds_shape`.
    train.optimizer=muon: Muon's matrices (muon.py) in a third group of their own, with
    train.muon_weight_decay (DeepSpeed's Muon gives each group its half's lr: muon_lr or lr)."""
    muon = muon_names(model) if train.optimizer == "muon" else set()
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    matrices: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        (matrices if name in muon else decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if muon:
        groups = [{**g, "name": name} for g, name in zip(groups, ("decay", "no_decay")) if g["params"]]
        groups.append({"params": matrices, "weight_decay": train.muon_weight_decay, "name": "matrices"})
    return groups


def build_engine(
    cfg: RunConfig,
    world_size: int,
    device: torch.device,
    seq_len: int | None = None,
    ds: dict | None = None,
    phase: Callable[[str], None] = lambda _name: None,
) -> tuple[DeepSpeedEngine, dict]:
    """The DeepSpeed engine and its merged config (`ds`, when the caller has merged it already).
    Activation checkpointing is applied after DeepSpeed has placed the weights and optimizer
    state, so that `auto` sees what is left; compilation with it (`checkpoint_and_compile`).
    `phase` is told as the model and then the engine begin (the start's progress, step_log.py)."""
    import deepspeed

    ds = ds or build_ds_config(load_ds_json(cfg.ds_config), cfg.train, world_size, device.type == "cuda")
    phase("model")
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=zero_stage(ds) == 3):
        model = build_model(cfg.model)
    t, seq_len = cfg.train, seq_len or cfg.model.max_seq_len
    phase("engine")
    with tagged(model, enabled=t.optimizer == "muon"):
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, t),
            config=ds,
            # wsd's; cosine: None, DeepSpeed's from `ds`
            lr_scheduler=client_scheduler(t, tokens_per_step(t, world_size, seq_len)),
        )
    mode = checkpointing_mode(cfg, ds, device, seq_len, count_params(model)["params"], world_size)
    checkpoint_and_compile(model, mode, cfg.train.compile)
    probe_fused_paths(device)  # each fused path tried once here, before the first step (kernels/probe.py)
    deepspeed_internals.check_engine(engine)
    if zero_stage(ds) == 3:
        deepspeed_internals.install_counters()
        # the whole model where no parameter is ever partitioned (one rank: ds_config.ALL_PERSISTENT,
        # or a threshold above every matrix), so that ZeRO-3's module hooks have nothing to do
        persistent = all(p.ds_persist for p in model.parameters())  # type: ignore[attr-defined]  # set by zero.Init
        pinned = model if persistent else model.loop
        if cfg.train.zero3_pin_core and pinned is not None:
            deepspeed_internals.pin_parameters(engine, pinned)
    return engine, ds
