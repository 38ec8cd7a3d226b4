"""Bad micro-batches: a non-finite loss on any rank, or a loss above the spike limit
(train.loss_spike_action=skip), is dropped on every rank and replaced by the next; too many in a
row stop the run; under train.loss_spike_action=rollback a spike sends the run back to its last
complete checkpoint (`SpikeRollback`, which the fit loop catches). Every rank decides alike: the
losses it judges are all-reduced (step/controls.py). docs/reliability.md, "Bad runs"."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pretrain.runs.checkpoint_files import find_latest
from pretrain.runs.train_config import TrainConfig
from pretrain.training.health import TrainingStopped
from pretrain.training.report.metrics import trim_records

log = logging.getLogger("grt.train")


class SpikeRollback(Exception):
    """Raised on every rank (the same all-reduced loss, the same limit) by a loss spike under
    train.loss_spike_action=rollback; the fit loop rolls back (`Trainer.roll_back`)."""


class BadBatches:
    """The count of dropped micro-batches (in all, and in a row) and the record of the spikes
    skipped (<out>/spikes.jsonl, one line per step; a resume from `start_step` rewrites those after
    it). The run's newest complete checkpoint is named when it stops."""

    def __init__(self, t: TrainConfig, rank: int, world: int, out: Path, start_step: int) -> None:
        self.t, self.rank, self.world = t, rank, world
        self.root = out / "checkpoints"
        self.skipped_total, self.in_a_row = 0, 0
        self.records = out / "spikes.jsonl"
        self.step_spikes: list[dict[str, Any]] = []  # the spikes skipped in the current step
        if rank == 0:
            trim_records(self.records, start_step)

    def latest(self) -> str | None:
        return find_latest(self.root)

    def good(self) -> None:
        self.in_a_row = 0

    def non_finite(self, step: int, depth: int) -> None:
        """A micro-batch of `step` (the step being trained) with a non-finite loss on some rank."""
        self.skipped_total += 1
        self.in_a_row += 1
        log.warning(
            "non-finite loss at step %d (depth %d): micro-batch skipped on every rank (%d in a row, limit %d)",
            step,
            depth,
            self.in_a_row,
            self.t.max_bad_steps,
        )
        if self.in_a_row >= self.t.max_bad_steps:
            raise TrainingStopped(
                f"{self.in_a_row} consecutive non-finite losses at step {step}; stopping. The last good checkpoint "
                f"is {self.latest() or 'none (no checkpoint yet)'} in {self.root}"
            )

    def spike(self, step: int, loss: float, limit: float, epoch: int, batch_in_epoch: int) -> None:
        """A micro-batch of `step` whose loss (the mean over the ranks) is above `limit`: a rollback
        (SpikeRollback) where train.loss_spike_action=rollback and there is a checkpoint, else dropped
        on every rank: one line, and its samples (global positions in the epoch's order, rank r's
        share the r-th micro-batch of them) in <out>/spikes.jsonl."""
        t = self.t
        if t.loss_spike_action == "rollback":
            if self.latest():
                raise SpikeRollback()
            if self.rank == 0:
                log.warning("loss spike at step %d: no checkpoint yet to roll back to", step)
        self.skipped_total += 1
        self.in_a_row += 1
        width = self.world * t.micro_batch_size
        positions = [(batch_in_epoch - 1) * width, batch_in_epoch * width]
        if self.rank == 0:
            log.warning(
                "loss spike at step %d: a micro-batch's loss %.4f is above the limit %.4f (train.loss_spike_threshold"
                "=%g): skipped on every rank and replaced by the next (samples %d-%d of epoch %d, in %s)",
                step,
                loss,
                limit,
                t.loss_spike_threshold,
                positions[0],
                positions[1] - 1,
                epoch,
                self.records,
            )
        self.step_spikes.append({"loss": loss, "limit": limit, "epoch": epoch, "positions": positions})
        if self.in_a_row >= t.max_bad_steps:
            raise TrainingStopped(
                f"{self.in_a_row} micro-batches in a row dropped (loss spikes or non-finite losses) at step "
                f"{step}: the loss level may have moved; train.loss_spike_action=log or a higher "
                f"train.loss_spike_threshold. The last good checkpoint is {self.latest() or 'none (no checkpoint yet)'}"
            )

    def end_step(self, step: int) -> None:
        """The step is trained: its skipped spikes in one record (trim_records keeps one per step)."""
        if self.step_spikes and self.rank == 0:
            with open(self.records, "a") as f:
                f.write(json.dumps({"step": step, "skipped": self.step_spikes}) + "\n")
        self.step_spikes = []

    def forget_step(self) -> None:
        """A rollback: the step is not trained, its spikes are not recorded."""
        self.step_spikes = []
