"""What a run says about its steps: the start's phases and lines (the model, the optimizer), and on
each logging step one dict of values that every sink is written from (TensorBoard, against steps
and tokens, W&B, the step's JSON line: `MetricsWriter.scalars`) and the log line (`StepLog`, a
callback: the values are the step's own, the slow ranks' and every callback's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from pretrain.model.flops import count_params
from pretrain.runs.run_config import RunConfig
from pretrain.say import say
from pretrain.training.callbacks import Callback
from pretrain.training.engine import deepspeed_internals
from pretrain.training.engine.ds_config import zero_stage
from pretrain.training.engine.parallelize import compile_stats
from pretrain.training.report.metrics import MetricsWriter, memory_scalars
from pretrain.training.report.step_timing import BREAKDOWN

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def human_duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "waiting": "wait", "other": "other"}


def time_shares(values: Mapping[str, float]) -> str:
    """' | time data/fwd/bwd/opt/wait/other 2/38/45/10/0/5%' of a timed step's values (its time/*_share
    scalars), '' of an untimed one."""
    if "time/step_s" not in values:
        return ""
    shares = "/".join(f"{100 * values[f'time/{k}_share']:.0f}" for k in BREAKDOWN)
    return f" | time {'/'.join(SHORT[k] for k in BREAKDOWN)} {shares}%"


def step_line(step: int, steps: int, values: Mapping[str, float]) -> str:
    """A logging step's log line, from the values every sink gets."""
    eta = (steps - step) * values["perf/step_time_s"]
    return (
        f"step {step}/{steps} | loss {values['train/loss']:.4f} | depth {values['train/depth']:.0f} | "
        f"lr {values['train/lr']:.2e} | grad norm {values['train/grad_norm']:.3f} | "
        f"{values['perf/tokens_per_s']:.0f} tok/s | MFU {100 * values['perf/mfu']:.2f}% | "
        f"peak mem {values['memory/peak_bytes'] / 2**20:.0f} MB | tokens {human_count(values['train/tokens_seen'])} | "
        f"ETA {human_duration(eta)}{time_shares(values)}"
    )


class StartPhases:
    """The start's progress on rank 0 (`say`): one line as each phase begins, one with its duration
    when it is done (`begin` ends the phase before it; `done` the last). Until the run's log is set
    up (`to_log`) the lines go to stderr as the start's other lines do (pretrain/say.py)."""

    def __init__(self, say: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        self.say, self.clock = say, clock
        self.logging = False
        self.current: tuple[str, float] | None = None

    def to_log(self) -> None:
        self.logging = True

    def _line(self, message: str) -> None:
        if not self.say:
            return
        if self.logging:
            log.info("%s", message)
        else:
            say(message)

    def begin(self, name: str, announce: bool = True) -> None:
        """`announce=False`: the phase is said only when done (the checks: a refusal in them stays one line)."""
        self.done()
        if announce:
            self._line(f"start: {name} ...")
        self.current = (name, self.clock())

    def done(self) -> None:
        if self.current is not None:
            name, started = self.current
            self._line(f"start: {name} done in {self.clock() - started:.2f} s")
        self.current = None


def log_start(
    cfg: RunConfig, engine: DeepSpeedEngine, ds: dict[str, Any], world: int, tokens_per_step: int, peak_note: str
) -> None:
    """The run's model, precision and optimizer in three lines."""
    t = cfg.train
    counts = count_params(engine.module)
    log.info(
        "model %s layout %s: %s params (%s non-embedding), ZeRO stage %d, %d rank(s), %s, %d tokens/step",
        cfg.model.name,
        cfg.model.layout,
        f"{counts['params']:,}",
        f"{counts['non_embedding_params']:,}",
        zero_stage(ds),
        world,
        "bf16" if ds["bf16"]["enabled"] else "fp32",
        tokens_per_step,
    )
    log.info("MFU peak: %s", peak_note)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # below DeepSpeed's ZeRO wrapper
    fused = " (fused=True)" if getattr(inner, "defaults", {}).get("fused") else ""
    log.info(
        "optimizer: %s.%s%s (fused: DeepSpeed's FusedAdam on CUDA, torch's fused AdamW on CPU); layer norm: "
        "torch.nn.LayerNorm; checkpointing: %s; compile: %s",
        type(inner).__module__,
        type(inner).__name__,
        fused,
        t.activation_checkpointing,
        t.compile,
    )


class StepLog(Callback):
    """A logging step's values into every sink (`MetricsWriter.scalars`; rank 0 writes TensorBoard),
    with the run's state it adds to them (memory, the ZeRO-3 counters, compile's graphs), and its
    log line."""

    def __init__(self, writer: MetricsWriter, device: torch.device, steps: int, zero3: bool, compiled: bool) -> None:
        self.writer, self.device, self.steps = writer, device, steps
        self.zero3, self.compiled = zero3, compiled  # their series: only where they mean something

    @classmethod
    def build(cls, run: RunContext, writer: MetricsWriter) -> StepLog:
        t = run.cfg.train
        return cls(writer, run.device, t.steps, zero3=zero_stage(run.ds) == 3, compiled=t.compile)

    def log_values(self, step: int) -> dict[str, float]:
        values: dict[str, float] = {**memory_scalars(self.device)}
        if self.zero3:
            values["zero3/trace_invalidations"] = deepspeed_internals.COUNTERS.trace_invalidations
            values["zero3/param_gathers"] = deepspeed_internals.COUNTERS.gathers
        if self.compiled:
            values["compile/unique_graphs"] = compile_stats()["unique_graphs"]
        return values

    def on_log(self, step: int, values: Mapping[str, float]) -> None:
        self.writer.scalars(step, values, tokens=int(values["train/tokens_seen"]))
        log.info("%s", step_line(step, self.steps, values))
