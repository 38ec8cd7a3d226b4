"""Whether the model can be held at all, checked in the start plan (and `--dry-run`) before the
engine is built: a model whose weights, gradients and optimizer state on one rank exceed the whole
memory of the device it trains on is refused in one line (before: `model.d_model=100000` passed the
dry run and the run died in an allocation traceback inside DeepSpeed's zero.Init).

Only what cannot fit is refused: the activations, the workspaces and what the first step
allocates are `train.activation_checkpointing=auto`'s concern (engine/activation_checkpointing.py).
Bytes per parameter as DeepSpeed's ZeRO holds them (the ZeRO paper): bf16 weights and gradients 2
each plus fp32 master weights and Adam's two moments 12; fp32 weights, gradients 4 each and the
moments 8; ZeRO-1 partitions the optimizer state over the ranks, ZeRO-2 the gradients too, ZeRO-3 the
weights as well; an optimizer or parameters offloaded to the CPU (or NVMe) leave the device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from grt_common.errors import ConfigError
from pretrain.model_config import ModelConfig
from pretrain.training.engine.ds_config import zero_stage

GIB = 1 << 30


def parameters(cfg: ModelConfig) -> int:
    """The model's parameter count, from its structure on the meta device (no memory)."""
    from pretrain.model import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def bytes_per_rank(n: int, ds: dict[str, Any], world: int) -> int:
    """What one rank's device holds of `n` parameters under `ds` (the merged DeepSpeed config)."""
    stage, half = zero_stage(ds), bool(ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled"))
    zero = ds.get("zero_optimization", {})
    weight = 2 if half else 4
    optimizer = 12 if half else 8
    if zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"):
        optimizer = 0
    if zero.get("offload_param", {}).get("device") in ("cpu", "nvme"):
        weight = 0
    held = weight * n / (world if stage >= 3 else 1)
    held += (2 if half else 4) * n / (world if stage >= 2 else 1)
    held += optimizer * n / (world if stage >= 1 else 1)
    return int(held)


def device_memory(cuda: bool) -> tuple[int, str] | None:
    """The whole memory of the device a rank trains on, and its name; None where a CUDA run is planned
    on a host without its GPU (a launcher's or login node's dry run: the ranks' device is not here)."""
    if cuda:
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"the GPU ({props.name})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory (training on the CPU)"


def check_fits(cfg: ModelConfig, ds: dict[str, Any], world: int, cuda: bool) -> None:
    """Refuse (ConfigError, one line) a model that one rank cannot hold (see the module docstring)."""
    n = parameters(cfg)
    need = bytes_per_rank(n, ds, world)
    memory = device_memory(cuda)
    if memory is None:
        return
    total, device = memory
    if need > total:
        stage = zero_stage(ds)
        remedies = "a smaller model, more ranks" + (", ZeRO-3" if stage < 3 else "") + " or an offload"
        raise ConfigError(
            f"the model (d_model {cfg.d_model}, layout {cfg.layout}, vocab {cfg.vocab_size}: {n:,} parameters) "
            f"needs {need / GIB:,.1f} GiB per rank for its weights, gradients and optimizer state (ZeRO-{stage} "
            f"over {world} rank(s)), more than the {total / GIB:,.1f} GiB of {device}: choose {remedies}"
        )
