"""What a run says about its steps: the start's phases and lines (the model, the optimizer), and on
each logging step one dict of values that every sink is written from (TensorBoard, against steps
and tokens, W&B, the step's JSON line: `MetricsWriter.scalars`) and the log line, with the checks
that watch the step's time (data-starved, slow ranks: docs/training.md, "Watching a run")."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pretrain.model.flops import count_params
from pretrain.runs.run_config import RunConfig
from pretrain.training.engine import deepspeed_internals
from pretrain.training.engine.ds_config import zero_stage
from pretrain.training.engine.parallelize import compile_stats
from pretrain.training.report.metrics import MetricsWriter, Throughput, human_count, human_duration, memory_scalars
from pretrain.training.report.profiling import RunProfiler
from pretrain.training.report.step_timing import BREAKDOWN, SlowRanks, breakdown_scalars

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger("grt.train")


SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "waiting": "wait", "other": "other"}


def time_shares(values: dict[str, float]) -> str:
    """' | time data/fwd/bwd/opt/wait/other 2/38/45/10/0/5%' of a timed step's values (its time/*_share
    scalars), '' of an untimed one."""
    if "time/step_s" not in values:
        return ""
    shares = "/".join(f"{100 * values[f'time/{k}_share']:.0f}" for k in BREAKDOWN)
    return f" | time {'/'.join(SHORT[k] for k in BREAKDOWN)} {shares}%"


def step_line(step: int, steps: int, values: dict[str, float]) -> str:
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
    up (`to_log`) the lines go to stderr as the start's other lines do (`grt train: ...`)."""

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
            print(f"grt train: {message}", file=sys.stderr, flush=True)

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


class StepLog:
    """A logging step's TensorBoard scalars, metrics and log line (rank 0 writes TensorBoard)."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: DeepSpeedEngine,
        *,
        rank: int,
        device: torch.device,
        writer: MetricsWriter,
        throughput: Throughput,
        profiler: RunProfiler,
        slow_ranks: SlowRanks,
        zero3: bool,
    ) -> None:
        self.cfg, self.engine, self.rank, self.device = cfg, engine, rank, device
        self.writer, self.throughput, self.profiler, self.slow_ranks = writer, throughput, profiler, slow_ranks
        self.zero3 = zero3  # the zero3/* series: only where they mean something
        self.data_starved_said = False

    def step(
        self,
        step: int,
        loss: float,
        depth: int,
        scalars: dict,
        seconds: dict[str, float],
        grad_norm: float,
        skipped: int,
        tokens_seen: int,
        data_scalars: dict[str, float],
    ) -> None:
        """Step `step` (just trained); `seconds`: its time per span (StepTimer, {} with
        train.time_breakdown off), gathered over the ranks (a collective); `tokens_seen`: the run's one
        count of tokens trained (a batch change, a skip, a rollback), `data_scalars` the mixture's draw."""
        t = self.cfg.train
        self.profiler.snapshot_if_asked(step)
        if seconds:
            seconds, ranks = self.check_timing(step, seconds)
            scalars = {**scalars, **breakdown_scalars(seconds), **ranks}
        values = {
            "train/loss": loss,
            "train/lr": self.engine.get_lr()[0],
            "train/grad_norm": grad_norm,
            "train/depth": depth,
            "train/skipped_microbatches": skipped,
            "train/tokens_seen": tokens_seen,
            **self.throughput.read(),
            **memory_scalars(self.device),
            **data_scalars,
            **scalars,
        }
        if self.zero3:
            values["zero3/trace_invalidations"] = deepspeed_internals.COUNTERS.trace_invalidations
            values["zero3/param_gathers"] = deepspeed_internals.COUNTERS.gathers
        if t.compile:
            values["compile/unique_graphs"] = compile_stats()["unique_graphs"]
        self.writer.scalars(step, values, tokens=tokens_seen)
        log.info("%s", step_line(step, t.steps, values))

    def check_timing(self, step: int, seconds: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """The slow-rank check on this logged step (every rank: a collective): the step's breakdown
        with its waiting, and the ranks' scalars; and one line the first time this rank waits for
        data more than train.data_starved_share of a step."""
        t = self.cfg.train
        share = seconds["data"] / seconds["step"] if seconds["step"] > 0 else 0.0
        if share > t.data_starved_share and not self.data_starved_said:
            self.data_starved_said = True
            log.warning(
                "data-starved: rank %d waited for data %.0f%% of step %d (%.3f of %.3f s; train.data_starved_share="
                "%g): more loader workers (train.num_workers=%d) or faster storage",
                self.rank,
                100 * share,
                step,
                seconds["data"],
                seconds["step"],
                t.data_starved_share,
                t.num_workers,
            )
        return self.slow_ranks.observe(seconds, step)
