"""What a run says about its steps: the start's lines (the model, the optimizer), and on each
logging step TensorBoard's scalars, the records and one log line, with the checks that watch the
step's time (data-starved, slow ranks: docs/training.md, "Watching a run")."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pretrain.model.flops import count_params
from pretrain.runs.run_config import RunConfig
from pretrain.training import deepspeed_internals
from pretrain.training.ds_config import zero_stage
from pretrain.training.metrics import MetricsWriter, Throughput, human_count, human_duration, memory_scalars
from pretrain.training.parallelize import compile_stats
from pretrain.training.profiling import RunProfiler
from pretrain.training.run_data import RunData
from pretrain.training.step_timer import SlowRanks, breakdown_scalars

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger("grt.train")


def time_shares(seconds: dict[str, float]) -> str:
    """' | time data/fwd/bwd/opt/other 2/38/45/10/5%' of a timed step, '' of an untimed one."""
    if not seconds:
        return ""
    step = seconds["step"] or 1e-12
    shares = "/".join(f"{100 * seconds[k] / step:.0f}" for k in ("data", "forward", "backward", "optimizer", "other"))
    return f" | time data/fwd/bwd/opt/other {shares}%"


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
        tokens_per_step: int,
        writer: MetricsWriter,
        throughput: Throughput,
        profiler: RunProfiler,
        slow_ranks: SlowRanks,
        data: RunData,
    ) -> None:
        self.cfg, self.engine, self.rank, self.device, self.tokens_per_step = cfg, engine, rank, device, tokens_per_step
        self.writer, self.throughput, self.profiler, self.slow_ranks, self.data = (
            writer,
            throughput,
            profiler,
            slow_ranks,
            data,
        )
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
    ) -> None:
        """Step `step` (just trained); `seconds`: its time per span (StepTimer, {} with
        train.time_breakdown off), gathered over the ranks (a collective)."""
        t = self.cfg.train
        self.profiler.snapshot_if_asked(step)
        if seconds:
            scalars = {**scalars, **breakdown_scalars(seconds), **self.check_timing(step, seconds)}
        perf = self.throughput.read()
        tokens_seen = step * self.tokens_per_step
        lr = self.engine.get_lr()[0]
        values = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/depth": depth,
            "train/skipped_microbatches": skipped,
            "train/tokens_seen": tokens_seen,
            **perf,
            **memory_scalars(self.device),
            **self.data.draw_scalars(),
            **scalars,
            "zero3/trace_invalidations": deepspeed_internals.COUNTERS.trace_invalidations,
            "zero3/param_gathers": deepspeed_internals.COUNTERS.gathers,
        }
        if t.compile:
            values["compile/unique_graphs"] = compile_stats()["unique_graphs"]
        self.writer.scalars(step, values)
        self.writer.scalars_by_tokens(tokens_seen, {"train/loss": loss})
        eta = (t.steps - step) * perf["perf/step_time_s"]
        log.info(
            "step %d/%d | loss %.4f | depth %d | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.2f%% | "
            "peak mem %.0f MB | tokens %s | ETA %s%s",
            step,
            t.steps,
            loss,
            depth,
            lr,
            grad_norm,
            perf["perf/tokens_per_s"],
            100 * perf["perf/mfu"],
            values["memory/peak_bytes"] / 2**20,
            human_count(tokens_seen),
            human_duration(eta),
            time_shares(seconds),
        )

    def check_timing(self, step: int, seconds: dict[str, float]) -> dict[str, float]:
        """The slow-rank check on this logged step (every rank: a collective), and one line the first
        time this rank waits for data more than train.data_starved_share of a step."""
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
        return self.slow_ranks.observe(seconds["data"] + seconds["forward"], step)
