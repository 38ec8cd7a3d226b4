"""The training loop on the DeepSpeed engine: the Trainer is its wiring (`build`) and its loop (`fit`).

The start is planned first, once (start/plan.py: a frozen `StartPlan` of what to resume, the data,
the budget and every refusal), then `build` makes each component in plain sight, in the order
the start needs: the process group, the run directory's lock, the engine, the checkpoint loaded
on every rank, and only then anything written into --out (run_dir.py). Each concern is a
component in its own file, built one way: `X.build(run, ...)` from the `RunContext` (run_context.py)
and the components it works with: the data (data.py), the step (step/optimizer_step.py, with its bad
micro-batches in bad_batches.py), evaluation (evaluation/validation.py), checkpoint I/O and rollbacks
(run_checkpoints.py). The concerns that run no collective (throughput, the step log, loss spikes,
the profiler, W&B, the heartbeat) are callbacks (callbacks.py): `fit` calls their hooks, and a new
one is one entry in the list `build` makes. No component sets another's state, and the run config
is the plan's from start to end.

Design choices that keep a looped model correct under ZeRO (docs/zero3.md):
- the loop depth is a pure function of (seed, step): identical on every rank;
- activation checkpointing is torch's non-reentrant checkpoint (parallelize.py; `auto` is
  resolved in engine/activation_checkpointing.py);
- every training depth is >= 1, so every parameter of the GRT takes part in every step;
- one all-reduce per micro-batch carries the loss, a non-finite flag, the stop signal and
  the previous step's gradient-norm check (step/controls.py), so that every rank skips, stops
  and saves together; the host reads them once per optimizer step outside logging steps
  (step/optimizer_step.py, docs/performance.md).
`fit` calls the collectives in the same order on every rank: each step's micro-batch
all-reduces (and DeepSpeed's own), then on a logging step the slow-rank gather, on an
evaluation step validation's all-reduce and the tasks', on a saving step the save's.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from grt_common.errors import ConfigError, file_system_problem
from pretrain.distributed import comm_device, discover, init_distributed
from pretrain.runs.run_config import RunConfig
from pretrain.say import say
from pretrain.training.callbacks import Callback
from pretrain.training.checkpoint.export_during import ExportDuring
from pretrain.training.checkpoint.mirror import CheckpointMirror
from pretrain.training.data import RunData, warn_on_skipped_shards
from pretrain.training.depth import depth_for_step
from pretrain.training.engine import deepspeed_internals
from pretrain.training.engine.build import build_engine
from pretrain.training.engine.ds_config import ds_config_json, zero_stage
from pretrain.training.evaluation.tasks import TaskEval, eval_dir
from pretrain.training.evaluation.validation import Validation, score_tasks
from pretrain.training.fault_injection import Faults
from pretrain.training.health import (
    Heartbeat,
    RankFailure,
    StopSignal,
    TrainingStopped,
    explain_failure,
    one_line,
)
from pretrain.training.report.hang_watch import HangWatch
from pretrain.training.report.metrics import MetricsWriter, Throughput, peak_flops, rss_mb
from pretrain.training.report.profiling import RunProfiler
from pretrain.training.report.step_log import StartPhases, StepLog, log_start
from pretrain.training.report.step_timing import DataStarved, SlowRanks
from pretrain.training.report.wandb_sink import WandbRun
from pretrain.training.run_checkpoints import RunCheckpoints
from pretrain.training.run_context import RunContext
from pretrain.training.start import branch
from pretrain.training.start.entry import run_start
from pretrain.training.start.plan import StartPlan, check_files, check_shards
from pretrain.training.start.run_dir import RunDir
from pretrain.training.step.bad_batches import SpikeRollback
from pretrain.training.step.loss_spikes import LossSpikes
from pretrain.training.step.optimizer_step import StepRunner

log = logging.getLogger("grt.train")


class Trainer:
    """One training run of a plan. `train()` below owns its life: build, fit, and close in `finally`."""

    def __init__(self, plan: StartPlan) -> None:
        self.plan, self.cfg = plan, plan.cfg
        self.out = Path(self.cfg.out)
        self.closing = ExitStack()  # what build() opened, for close()
        self.heartbeat: Heartbeat | None = None  # None until build() starts it: train() reports failures through it
        self.step = 0  # the steps trained: the loop's, set by the load and a rollback

    def build(self) -> None:
        """The components, in the order the start needs (module doc), each built from the run
        (`RunContext`) and the components it works with; collectives: the process group, the
        heartbeat's store, the lock's agreement, the engine, the load, the hosts' gather."""
        plan, cfg, t, closing = self.plan, self.cfg, self.cfg.train, self.closing
        self.phases = phases = StartPhases(say=discover().rank == 0)  # the start's progress, on rank 0
        phases.begin("checks", announce=False)  # a refusal in them is one line
        self.tasks = TaskEval.build(cfg, plan.data.tokenizer_path)  # task files read once; None: off
        deepspeed_internals.check()
        deepspeed_internals.install_device_clip()  # ZeRO-1/2's clip without a host read
        stop = StopSignal()  # before the slow start-up: a signal during it stops after the first step
        phases.begin("process group")
        info = init_distributed(timeout_s=t.dist_timeout_s)
        self.rank, world = info.rank, info.world_size
        assert world == plan.world, (world, plan.world)  # the plan's launch is this one
        self.heartbeat = Heartbeat(self.rank, world)
        closing.callback(self.heartbeat.close)
        run_dir = RunDir(self.out, self.rank, closing)
        phases.to_log()  # the log is set up: the phases go to it (train.log on rank 0)
        run_dir.take_lock()
        deepspeed_internals.quiet_deprecated_collectives()
        device = torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(t.seed + self.rank)
        self.engine, ds = build_engine(cfg, world, device, plan.data.seq_len, plan.ds, phases.begin)
        log_start(cfg, self.engine, ds, world, plan.tokens_per_step, peak_flops(device, t.peak_tflops)[1])
        phases.begin("data")
        self.data = RunData(plan, self.rank, world, device)
        self.checkpoints = RunCheckpoints(plan, self.rank, world)
        if plan.resume is not None:  # written on another world size: DeepSpeed's universal conversion
            phases.begin("checkpoint conversion and load" if plan.resume.universal else "checkpoint load")
        loaded = self.checkpoints.load(self.engine) if plan.resume is not None else None
        if loaded is not None:
            self.step = loaded.step
            self.data.continue_from(loaded.loader)
            self.data.restore_count(loaded.tokens, loaded.step, loaded.loader)
        self.config_json = cfg.to_json()
        run_dir.commit(self.config_json, ds)
        if loaded is not None:
            log.info("resumed from %s at step %d", plan.root / loaded.tag, self.step)
        self.run = run = RunContext(
            cfg=cfg,
            rank=self.rank,
            world=world,
            device=device,
            comm=comm_device(),
            engine=self.engine,
            ds=ds,
            seq_len=plan.data.seq_len,
            tokens_per_step=plan.tokens_per_step,
            root=plan.root,
            start_step=self.step,
            stop=stop,
            closing=closing,
        )
        if t.eval_every:
            phases.begin("validation data")
        val = self.data.validation_batches() if t.eval_every else None
        phases.begin("logs (TensorBoard, W&B)")
        self.writer = MetricsWriter(self.out, self.rank, resume_step=self.step, world=world)
        closing.callback(self.writer.close)
        wandb = WandbRun.build(run, self.writer, plan.root / loaded.tag if loaded is not None else None)
        self.writer.text("config", self.config_json)
        self.writer.text("deepspeed_config", ds_config_json(ds))
        self.validation = Validation.build(run, val, self.data.weights, self.writer)
        self.spikes = LossSpikes.build(run, self.writer, self.data.trained)
        if loaded is not None:
            self.spikes.restore(loaded.loss_history)  # a resume judges as the run would have
        self.profiler = RunProfiler.build(run)
        self.stepper = StepRunner.build(run, self.data, self.spikes, self.profiler)
        self.slow_ranks = SlowRanks.build(run)  # a collective: every rank's host
        # the concerns that run no collective, their hooks called in this order (callbacks.py): a new one goes here
        self.callbacks: list[Callback] = [self.heartbeat, Throughput.build(run), self.spikes, self.profiler]
        self.callbacks += [DataStarved.build(run), StepLog.build(run, self.writer)]
        self.callbacks.append(HangWatch.build(run, self.heartbeat))  # hang forensics: <out>/hangs/
        exports = ExportDuring.build(run)  # rank 0, train.export_every
        if exports is not None:
            self.callbacks.append(exports)
        mirror = CheckpointMirror.build(run)  # rank 0, train.checkpoint_mirror
        if mirror is not None:
            self.callbacks.append(mirror)
        if wandb is not None:  # rank 0, train.wandb
            self.callbacks.append(wandb)
        phases.done()

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.cfg.train
        batches = warn_on_skipped_shards(self.data.loader, self.rank)
        last_val: dict[int, float] = {}
        grad_norms: dict[str, float] = {}  # the last logging step's, for the loop's health at validation
        loss, stop_requested = float("nan"), False  # (a finished run resumed never gets here: train())
        self.engine.train()
        for callback in self.callbacks:
            callback.on_fit_start(self.step)
        if t.compile:  # torch.compile compiles at the first step: the start's last phase
            self.phases.begin("compile (the first step)")
        while self.step < t.steps:
            depth = depth_for_step(t, self.cfg.model.max_loops, self.step)
            log_now = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.steps
            for callback in self.callbacks:
                callback.on_step_begin(self.step)
            try:  # collectives: one all-reduce per micro-batch, and DeepSpeed's
                with self.profiler.on_out_of_memory():
                    result = self.stepper.run(batches, depth, log_now, self.step)
            except SpikeRollback:
                self.roll_back()
                continue
            loss, stop_requested = result.loss, result.stop_requested
            self.step += 1
            self.phases.done()  # the first step's: nothing after it
            save_now = (
                (t.save_every and self.step % t.save_every == 0)
                or (t.save_final and self.step == t.steps)
                or stop_requested
            )
            record = {
                "loss": loss,
                "depth": depth,
                "rss_mb": round(rss_mb(), 1),
                "data_digest": self.stepper.take_digest(),
            }
            for callback in self.callbacks:
                callback.on_step_end(self.step, record)
            if log_now:  # the slow-rank gather: a collective (a timed step's), so here and not in a callback
                values = {
                    **result.values,
                    **self.data.draw_scalars(),
                    **self.slow_ranks.scalars(self.step, result.seconds),
                }
                for callback in self.callbacks:
                    values.update(callback.log_values(self.step))
                for callback in self.callbacks:
                    callback.on_log(self.step, values)
                grad_norms = {k: v for k, v in values.items() if k.startswith("grad_norm/")}
                self.checkpoints.settle(self.engine)  # a collective: a background save's writes ended?
            elif save_now:
                self.stepper.check_grad_norm(self.step)
            if self.validation is not None and self.validation.due(self.step, t.steps):  # a collective
                last_val = self.validation.run(self.engine, self.step, self.data.trained.total, record, grad_norms)
                self.back_to_training()
            if self.tasks is not None and self.tasks.due(self.step, t.steps):  # collectives
                score_tasks(self.tasks, self.run, self.step, self.data.trained.total, self.writer)
                self.back_to_training()
            self.writer.step_record(self.step, record)  # with every scalar written at the step
            if save_now:  # a collective; train.async_save: written in the background but at the end or a stop
                tag = self.save(wait=self.step == t.steps or stop_requested)
                done = self.checkpoints.pending is None
                log.info("%s checkpoint %s", "saved" if done else "writing", self.plan.root / tag)
            if stop_requested:
                log.info("stop signal received: checkpoint saved at step %d, exiting cleanly", self.step)
                break
        self.checkpoints.settle(self.engine, wait=True)
        return self.summary(loss, last_val, stop_requested)

    def back_to_training(self) -> None:
        self.engine.train()
        for callback in self.callbacks:
            callback.on_validation(self.step)

    def roll_back(self) -> None:
        """train.loss_spike_action=rollback, on every rank: back to the last complete checkpoint, the
        data going on where it is (run_checkpoints.py); the writer drops what the steps after it wrote."""
        self.stepper.bad.forget_step()
        loaded = self.checkpoints.roll_back(self.engine, self.step + 1, self.data.loader.state_dict())
        self.step = loaded.step
        self.data.restore_count(loaded.tokens, loaded.step, {})  # the checkpoint's: the window since is not trained
        self.spikes.restore(loaded.loss_history)
        self.writer.rewind(self.step)
        for callback in self.callbacks:
            callback.on_rollback(self.step)

    def save(self, wait: bool = True) -> str:
        run_files: dict[str, str] = {}  # rank 0 writes them into the checkpoint (W&B: the run a resume continues)
        for callback in self.callbacks:
            callback.on_save(self.step, run_files)
        return self.checkpoints.save(
            self.engine,
            self.step,
            config_json=self.config_json,
            loader_state=self.data.loader.state_dict(),
            fit_state={"loss_history": self.spikes.history, "tokens": self.data.trained.state()},
            run_files=run_files,
            wait=wait,
        )

    def summary(self, loss: float, last_val: dict[int, float], stop_requested: bool) -> dict[str, Any]:
        """Rank 0's summary.json (the others: {})."""
        if self.rank != 0:
            return {}
        health = self.validation.health if self.validation is not None else None
        summary = {
            "out": str(self.out),
            "steps": self.step,
            "final_loss": loss,
            "val_loss_by_depth": last_val,
            "loop": health.record() if health is not None else None,
            "checkpoint": str(self.plan.root / (self.checkpoints.latest() or "")),
            "tensorboard": str(self.out / "tb"),
            "skipped_microbatches": self.stepper.bad.skipped_total,
            "stopped_by_signal": stop_requested,
            **self.data.summary(),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self, after_failure: bool = False) -> None:
        """Close what build() opened. After a failure, what closing raises (TensorBoard's writer
        raising its thread's full disk again) is logged: the run's own error is the one reported."""
        try:
            self.closing.close()
        except Exception as err:
            if not after_failure:
                raise
            try:
                log.warning("while closing after the failure: %s", one_line(err))
            except OSError:  # train.log on the same full disk: the run's own error stays the one reported
                pass


def dry_run(cfg: RunConfig, resume: bool = False) -> tuple[str, RunConfig]:
    """`grt train --dry-run`: the run's checks (its plan, its task files, the installed DeepSpeed, the
    checkpoint's files read through) and nothing else. Returns one line saying what would train
    and the run config the run would write as its config.json."""
    plan = run_start(cfg, resume).planned
    for line in plan.start_lines():
        say(line)
    if plan.nothing_to_do:
        return plan.nothing_to_do, plan.cfg
    tasks = TaskEval.build(plan.cfg, plan.data.tokenizer_path)
    deepspeed_internals.check()
    check_shards(plan)  # every shard there (or answering) and the one its manifest lists
    tag = None
    if plan.resume is not None:
        tag, lines = check_files(plan)
        for line in lines:
            say(line)
    c, ds = plan.cfg, plan.ds
    start = (
        f"branching from {plan.branch_source}" if plan.branch_source else (f"resuming {tag}" if tag else "from scratch")
    )
    return (
        f"would train {c.model.name} ({c.model.variant} {c.model.layout}, d {c.model.d_model}, vocab "
        f"{c.model.vocab_size}) on {c.data} (seq_len {plan.data.seq_len}) for {c.train.steps} steps, ZeRO stage "
        f"{zero_stage(ds)}, {'bf16' if ds['bf16']['enabled'] else 'fp32'}, checkpointing "
        f"{c.train.activation_checkpointing}, compile {c.train.compile}, {start}, into {c.out}"
        + (f", the zero-shot tasks from {eval_dir(c.train)}" if tasks is not None else ""),
        c,
    )


def train(cfg: RunConfig, resume: bool = False) -> dict:
    """Run training (resume=True: continue from the newest complete checkpoint, if any; a decay
    branch's checkpoint is made in --out first, branch.py). Returns a summary dict on rank 0
    (others: {}; every rank {} when a resume has nothing to train, `StartPlan.nothing_to_do`).

    A failure on one rank (an exception, or a peer that died or hung) stops every rank
    with RankFailure naming the rank that failed (see health.Heartbeat)."""
    faults = Faults.from_environment()  # the tests' injections (fault_injection.py); a real run has none
    faults.install_at_start()
    plan = run_start(cfg, resume).planned  # a decay branch resumes its source checkpoint
    for line in plan.start_lines():
        say(line)
    if plan.nothing_to_do:  # a finished run resumed: said, and every file of the run left as it is
        say(plan.nothing_to_do)
        return {}
    with branch.prepared(plan.cfg):
        trainer = Trainer(plan)
        fitting = False
        try:
            trainer.build()
            faults.install_in(trainer)
            fitting = True
            summary = trainer.fit()
            trainer.close()  # its last writes (TensorBoard's flush) are the run's: their failure is mid-run too
            return summary
        except (ConfigError, TrainingStopped) as err:
            if trainer.heartbeat is not None and not isinstance(err, RankFailure):
                trainer.heartbeat.mark_failed(one_line(err))
            raise
        except Exception as err:
            problem = file_system_problem(err) if fitting else None
            if problem is not None:  # mid-run (a full disk at the run's files): stopped, not bad input (exit 3)
                latest = trainer.checkpoints.latest()
                kept = f"the last checkpoint ({latest}) is intact" if latest else "no checkpoint saved yet"
                stopped = TrainingStopped(f"{problem} at step {trainer.step}; {kept}")
                if trainer.heartbeat is not None:
                    trainer.heartbeat.mark_failed(one_line(stopped))
                raise stopped from err
            explained = explain_failure(err, trainer.heartbeat)
            if explained is err:
                raise
            raise explained from err
        finally:
            trainer.close(after_failure=True)  # (a no-op after the close above)
