"""The fault injections of the tests (NaN losses, loss spikes, delays), read from the environment
once at start-up and installed from outside the step."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from pretrain.model.gpt import ModelOutput

log = logging.getLogger("grt.train")


class NanInjection:
    """Fault injection for the reliability tests, read from the environment once at start-up:
    GRT_INJECT_NAN_STEPS=3,4 makes the loss of the first micro-batch tried at steps 3 and 4
    NaN (the retry with the next micro-batch is clean); a step listed k times poisons its
    first k tries (5,5,5: three bad micro-batches in a row). GRT_INJECT_LOSS_FACTOR=20 multiplies
    those losses by 20 instead (a finite loss spike, its gradients scaled with it)."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get("GRT_INJECT_NAN_STEPS", "") if spec is None else spec
        self.remaining = Counter(int(s) - 1 for s in spec.split(",") if s.strip())  # 0-based steps
        self.factor = float(os.environ.get("GRT_INJECT_LOSS_FACTOR", "nan"))

    def poisons(self, step: int) -> bool:
        if self.remaining[step] > 0:
            self.remaining[step] -= 1
            return True
        return False


class NanFaults:
    """`NanInjection` (GRT_INJECT_NAN_STEPS) applied from outside the step: a forward hook
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
