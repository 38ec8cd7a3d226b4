"""Hang forensics in the loop (forensics.py): the rank's dump watcher, started
with the run, and the loop's position a dump reports (`forensics.MARK`: the step, its loop depth and
the phase), kept by plain attribute writes from this callback's hooks and from hooks on the model
(forward, or eval outside training; backward, from a hook on the loss) and on the optimizer (its
update). ZeRO's gradient reduction before the update shows as backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pretrain.training.callbacks import Callback
from pretrain.training.depth import depth_for_step
from pretrain.training.report.forensics import MARK, Watcher
from pretrain.training.run_context import RunContext

if TYPE_CHECKING:
    from pretrain.training.health import Heartbeat

HANGS = "hangs"  # <out>/hangs/<time>/rank<R>.txt


def _at(phase: str) -> None:
    MARK.phase, MARK.moves = phase, MARK.moves + 1


def _phase(name: str) -> Any:
    def mark(*_: Any) -> None:
        _at(name)

    return mark


def _on_forward(module: torch.nn.Module, _args: Any) -> None:
    _at("forward" if module.training else "eval")


def _after_forward(module: torch.nn.Module, _args: Any, out: Any) -> None:
    loss = getattr(out, "loss", None)
    if module.training and isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.register_hook(_phase("backward"))  # its gradient is the backward's first


class HangWatch(Callback):
    def __init__(self, run: RunContext) -> None:
        self.train, self.max_loops = run.cfg.train, run.cfg.model.max_loops

    @classmethod
    def build(cls, run: RunContext, heartbeat: Heartbeat) -> HangWatch:
        # NCCL's watchdog aborts a rank whose collective timed out before Python sees it: the loop's stall asks
        stall_s = 0.9 * run.cfg.train.dist_timeout_s if run.device.type == "cuda" else 0.0
        watcher = Watcher(run.out / HANGS, run.rank, run.world, heartbeat.store, heartbeat.interval, stall_s)
        heartbeat.ask_dump = watcher.request  # a failed collective asks for one (failures.explain_failure)
        run.closing.callback(watcher.close)
        module = run.engine.module
        module.register_forward_pre_hook(_on_forward)
        module.register_forward_hook(_after_forward)
        opt = getattr(run.engine, "optimizer", None)
        while opt is not None and not isinstance(opt, torch.optim.Optimizer):  # DeepSpeed's wrappers
            opt = getattr(opt, "optimizer", None)
        if opt is not None:
            opt.register_step_pre_hook(_phase("optimizer"))
        return cls(run)

    def on_step_begin(self, step: int) -> None:
        MARK.step, MARK.depth = step + 1, depth_for_step(self.train, self.max_loops, step)
        _at("data")

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        MARK.step = step
        _at("after step (log, evaluation, save)")

    def on_save(self, step: int, files: dict[str, str]) -> None:
        _at("save")

    def on_validation(self, step: int) -> None:
        _at("after evaluation")
