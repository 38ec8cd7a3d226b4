"""Profiler windows and CUDA memory snapshots of a training run (docs/training.md, "Watching a run").

`train.profile = "wait,warmup,active"`: the ranks of `train.profile_ranks` run torch.profiler
with that schedule, once, counted in steps from the process's first step, and write one trace
per rank under `<out>/profile/` (`rank<R>.<time>.pt.trace.json`: TensorBoard's trace viewer and
Perfetto open it), with memory. While a rank traces, ranges label the model from outside it
(module hooks, installed only then): `prelude`, `loop_step_<k>`, `coda`, `head_and_loss`; the
fit loop adds `data`, `forward`, `backward` and `optimizer_step`. A loop step that activation
checkpointing recomputes runs inside `backward` (torch's checkpoint calls the step's forward
function, not the module, so no hook sees it). With train.profile off none of
this exists: no profiler, no hook, no range.

`train.memory_history` (CUDA): the caching allocator records its history from the start;
`touch <out>/profile/SNAPSHOT` makes every rank write
`<out>/profile/memory_snapshot_rank<R>_step<S>.pickle` at its next logging step (open them in
https://pytorch.org/memory_viz), and an out-of-memory error writes
`memory_snapshot_rank<R>_oom.pickle` before the run stops.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from pretrain.runs.settings_rules import profile_window
from pretrain.training.callbacks import Callback

if TYPE_CHECKING:
    from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")

SNAPSHOT_TRIGGER = "SNAPSHOT"  # touch <out>/profile/SNAPSHOT: a memory snapshot at the next logging step


def profiles(ranks: str, rank: int) -> bool:
    """Whether `rank` is one of train.profile_ranks ("all" or comma-separated ranks)."""
    return ranks == "all" or rank in {int(r) for r in ranks.split(",")}


class ModelLabels:
    """Profiler ranges around the model's parts, from forward hooks (removed by `remove`)."""

    def __init__(self, model: nn.Module) -> None:
        self.handles: list[Any] = []
        self.open: dict[str, Any] = {}
        self.loop_steps = 0
        self.handles.append(model.register_forward_pre_hook(self._model_starts))
        for name, blocks in (("prelude", getattr(model, "prelude", [])), ("coda", getattr(model, "coda", []))):
            if len(blocks):
                self._span(name, blocks[0], blocks[-1])
        loop = getattr(model, "loop", None)
        if loop is not None:
            self.handles.append(loop.register_forward_pre_hook(self._loop_starts))
            self.handles.append(loop.register_forward_hook(self._loop_ends))
        head = getattr(model, "lm_head", None)
        if head is not None:
            self._span("head_and_loss", head, head)

    def _span(self, name: str, first: nn.Module, last: nn.Module) -> None:
        self.handles.append(first.register_forward_pre_hook(lambda *_: self._enter(name)))
        self.handles.append(last.register_forward_hook(lambda *_: self._exit(name)))

    # compiled modules run their hooks inside the graph: a profiler range is host code, kept eager
    @torch.compiler.disable
    def _enter(self, name: str) -> None:
        self.open[name] = torch.profiler.record_function(name).__enter__()

    @torch.compiler.disable
    def _exit(self, name: str) -> None:
        rf = self.open.pop(name, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    @torch.compiler.disable
    def _model_starts(self, *_: Any) -> None:
        self.loop_steps = 0

    @torch.compiler.disable
    def _loop_starts(self, *_: Any) -> None:
        self.loop_steps += 1
        self._enter(f"loop_step_{self.loop_steps}")

    @torch.compiler.disable
    def _loop_ends(self, *_: Any) -> None:
        self._exit(f"loop_step_{self.loop_steps}")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class RunProfiler(Callback):
    """The profiler window of one rank (or nothing), and its memory snapshots: the window moves on
    with each step trained, a snapshot is taken on a logging step when asked."""

    def __init__(
        self, window: tuple[int, int, int] | None, out: Path, rank: int, model: nn.Module, memory_history: bool
    ) -> None:
        self.dir, self.rank = out / "profile", rank
        self.cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
        self.profiler: torch.profiler.profile | None = None
        self.labels: ModelLabels | None = None
        self.steps_left = 0
        if window is not None:
            wait, warmup, active = window
            self.dir.mkdir(parents=True, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{rank}"),
                profile_memory=True,
            )
            self.profiler.start()
            self.labels = ModelLabels(model)
            self.steps_left = wait + warmup + active
        self.memory_history = memory_history and self.cuda
        if memory_history and not self.cuda:
            log.info("train.memory_history: no CUDA device, no memory snapshots")
        if self.memory_history:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.trigger_seen = 0.0

    @classmethod
    def build(cls, run: RunContext) -> RunProfiler:
        t = run.cfg.train
        window = profile_window(t.profile) if profiles(t.profile_ranks, run.rank) else None
        profiler = cls(window, run.out, run.rank, run.engine.module, t.memory_history)
        run.closing.callback(profiler.stop)
        return profiler

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        self.step()

    def on_log(self, step: int, values: Mapping[str, float]) -> None:
        self.snapshot_if_asked(step)

    def range(self, name: str) -> Any:
        """A profiler range while the window is open, else nothing (a shared null context)."""
        return torch.profiler.record_function(name) if self.profiler is not None else nullcontext()

    def step(self) -> None:
        """After each training step: the schedule moves on; after the window, everything is removed."""
        if self.profiler is None:
            return
        self.profiler.step()
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.stop()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
            log.info("profiler trace written under %s", self.dir)
        if self.labels is not None:
            self.labels.remove()
            self.labels = None

    def snapshot_if_asked(self, step: int) -> None:
        """On logging steps: a memory snapshot when <out>/profile/SNAPSHOT is newer than the last one."""
        if not self.memory_history:
            return
        trigger = self.dir / SNAPSHOT_TRIGGER
        try:
            mtime = trigger.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime > self.trigger_seen:
            self.trigger_seen = mtime
            self.dump(f"step{step}")

    def dump(self, what: str) -> Path | None:
        if not self.memory_history:
            return None
        path = self.dir / f"memory_snapshot_rank{self.rank}_{what}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        log.warning("CUDA memory snapshot written to %s (open it in https://pytorch.org/memory_viz)", path)
        return path

    @contextmanager
    def on_out_of_memory(self) -> Iterator[None]:
        """Around the fit loop: an out-of-memory error writes a snapshot (or says how to get one)."""
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            if self.dump("oom") is None:
                log.error("out of memory: set train.memory_history=true to get a CUDA memory snapshot of it")
            raise
