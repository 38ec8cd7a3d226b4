"""What the fit loop wraps around its steps without being part of them: warnings about skipped
shards on the batch stream, and the fault injections of the tests (NaN losses, delays)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from pretrain.training.health import NanInjection

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from data_pipeline.batches import TrainBatches
    from pretrain.model.gpt import ModelOutput

log = logging.getLogger("grt.train")


def warn_on_skipped_shards(loader: TrainBatches, rank: int) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches, with a warning whenever it has skipped another unreadable shard."""
    seen = loader.skipped_shards
    for batch in loader:
        if loader.skipped_shards != seen:
            log.warning(
                "rank %d skipped %d unreadable shard(s) so far (train.skip_corrupt_shards): %s",
                rank,
                loader.skipped_shards,
                ", ".join(loader.bad_shards),
            )
            seen = loader.skipped_shards
        yield batch


class NanFaults:
    """`health.NanInjection` (GRT_INJECT_NAN_STEPS) applied from outside the step: a forward hook
    on the engine, installed only when some step is listed, makes the loss NaN (or its factor
    times the loss) of each micro-batch it names while the fit loop has armed it for that step
    (`at_step`)."""

    def __init__(self, engine: DeepSpeedEngine, injection: NanInjection) -> None:
        self.injection = injection
        self.step: int | None = None
        if injection.remaining:
            engine.register_forward_hook(self.poison)

    @contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        self.step = step
        try:
            yield
        finally:
            self.step = None

    def poison(self, _module: torch.nn.Module, _args: tuple, out: ModelOutput) -> ModelOutput | None:
        if self.step is None or out.loss is None or not self.injection.poisons(self.step):
            return None
        return out._replace(loss=out.loss * self.injection.factor)


class DelayInjection:
    """Fault injection for the slow-rank and data-starved tests, read from the environment once:
    GRT_INJECT_DELAY=forward@1=0.3 sleeps 0.3 s before each forward of rank 1; data@0=0.2 before
    each batch rank 0 takes from the loader. Installed only when set."""

    def __init__(self, engine: DeepSpeedEngine, rank: int, spec: str | None = None) -> None:
        spec = os.environ.get("GRT_INJECT_DELAY", "") if spec is None else spec
        self.seconds = {"forward": 0.0, "data": 0.0}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            where, rest = item.split("@")
            ranks, seconds = rest.split("=")
            if int(ranks) == rank:
                self.seconds[where] = float(seconds)
        if self.seconds["forward"]:
            engine.register_forward_pre_hook(lambda *_: time.sleep(self.seconds["forward"]))

    def batches(self, batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        if not self.seconds["data"]:
            yield from batches
            return
        for batch in batches:
            time.sleep(self.seconds["data"])
            yield batch
