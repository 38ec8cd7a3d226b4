"""What each component of a training run is built from (`X.build(run, ...)`): the run config, this
rank and its devices, the engine, and the run's closing stack. `Trainer.build` makes it once the
engine exists and the checkpoint is loaded; a component reads what it needs of it, and takes as
arguments only the other components it works with."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pretrain.runs.run_config import RunConfig

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from pretrain.training.health import StopSignal


@dataclass(frozen=True)
class RunContext:
    cfg: RunConfig  # the plan's, from start to end
    rank: int
    world: int
    device: torch.device  # this rank's compute device
    comm: torch.device  # the device of every collective's tensors (distributed.comm_device)
    engine: DeepSpeedEngine
    ds: dict[str, Any]  # the merged DeepSpeed config
    seq_len: int  # the data's
    tokens_per_step: int
    root: Path  # the run's checkpoints (StartPlan.root)
    start_step: int  # the steps trained when this process started (a resume's checkpoint's; 0 fresh)
    stop: StopSignal
    closing: ExitStack  # what the run opened, closed last first by Trainer.close (after a failure too)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)
