"""`train.activation_checkpointing=auto` resolved against the device memory the built engine leaves.

The estimates and the choice are parallelize.py's (`activation_bytes`, `choose_checkpointing`);
this module adds what only a built engine knows: what DeepSpeed allocates later, in the first
step, and the free memory agreed over the ranks.
"""

from __future__ import annotations

import logging

import torch

from pretrain.distributed import all_reduce, comm_device
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import AUTO
from pretrain.training.depth import max_depth
from pretrain.training.engine.ds_config import zero_stage
from pretrain.training.engine.parallelize import (
    AUTO_MEMORY_SHARE,
    AUTO_MODES,
    activation_bytes,
    choose_checkpointing,
    modes_for_stage,
)

log = logging.getLogger("grt.train")


def allocated_later(ds: dict, numel: int, world_size: int, dtype_bytes: int) -> int:
    """Device memory the engine allocates only in the first step, after `auto` reads the free
    memory: the full gradients under ZeRO-0/1 (ZeRO-2 and 3 partition them), and under
    ZeRO-3 with more than one rank the parameters gathered at once (stage3_max_live_parameters,
    DeepSpeed's default 1e9) plus the prefetch bucket (default 5e7), each at most the model.
    torch.compile's workspaces are left to the headroom (AUTO_MEMORY_SHARE)."""
    zero = ds.get("zero_optimization", {})
    later = dtype_bytes * numel if zero_stage(ds) < 2 else 0
    if zero_stage(ds) == 3 and world_size > 1:
        live = min(numel, int(zero.get("stage3_max_live_parameters", 1e9)))
        later += dtype_bytes * (live + min(numel, int(zero.get("stage3_prefetch_bucket_size", 5e7))))
    return later


def least_free_memory(device: torch.device, later: int) -> int:
    """The device memory free for activations, less `later`, on the rank that has the least:
    every rank must recompute alike (ZeRO-3 gathers parameters again in a recompute)."""
    free_here = (
        torch.cuda.mem_get_info(device)[0]
        + torch.cuda.memory_reserved(device)
        - torch.cuda.memory_allocated(device)
        - later
    )
    return int(all_reduce(torch.tensor(float(free_here), device=comm_device()), op="min").item())


def checkpointing_mode(
    cfg: RunConfig, ds: dict, device: torch.device, seq_len: int, numel: int, world_size: int
) -> str:
    """train.activation_checkpointing, with `auto` resolved from the estimated activation
    memory of one micro-batch at the deepest sampled depth against the device memory left
    once what the first step allocates is taken (`allocated_later` of the model's `numel`
    parameters; the least free over the ranks: `least_free_memory`). On the CPU, auto is off.
    Logs one line."""
    t = cfg.train
    if t.activation_checkpointing != AUTO:
        return t.activation_checkpointing
    depth, dtype_bytes = max_depth(t, cfg.model.max_loops), 2 if ds["bf16"]["enabled"] else 4
    estimates = {
        mode: activation_bytes(cfg.model, t.micro_batch_size * seq_len, depth, mode, dtype_bytes)
        for mode in AUTO_MODES
        if mode in modes_for_stage(zero_stage(ds))
    }
    later = allocated_later(ds, numel, world_size, dtype_bytes)
    free = least_free_memory(device, later) if device.type == "cuda" else None
    mode = choose_checkpointing(estimates, free)
    log.info(
        "activation checkpointing auto -> %s: estimated activation memory per micro-batch (%d x %d tokens, "
        "depth up to %d): %s; %s",
        mode,
        t.micro_batch_size,
        seq_len,
        depth,
        ", ".join(f"{m} {b / 2**20:,.1f} MiB" for m, b in estimates.items()),
        f"free device memory {free / 2**20:,.0f} MiB (least over ranks, after {later / 2**20:,.0f} MiB that the "
        f"first step allocates), {AUTO_MEMORY_SHARE:.0%} of it usable"
        if free is not None
        else "on the CPU: no checkpointing unless set",
    )
    return mode
