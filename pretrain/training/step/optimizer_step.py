"""One optimizer step on the DeepSpeed engine: grad_accum good micro-batches, then the step.

Each micro-batch's control vector (step/controls.py: its loss, a non-finite flag, the stop
signal, the previous step's gradient-norm check) is all-reduced on the device, one all-reduce
per micro-batch on every rank; the host reads the vectors not read yet once, after the forward
of the micro-batch that completes the step if they are all good, before its backward: one host
sync per step outside logging steps, whatever grad_accum is (docs/performance.md). The
micro-batches before it run their backward unread, under `GradientMask`: a dropped one's
gradients are zeroed on the device, so it adds nothing. A step that dropped one (bad_batches.py)
reads again for its replacements. A logging step also returns the step's own values (loss, lr,
gradient norm, depth, skips, tokens, norms, gate means), and a timed one its seconds per span.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from data_pipeline.batches import round_tokens
from data_pipeline.loader import DIGEST_MOD, sample_digest
from pretrain.distributed import all_reduce
from pretrain.runs.checkpoint_files import find_latest
from pretrain.training.health import TrainingStopped
from pretrain.training.report.metrics import norms
from pretrain.training.report.step_timing import StepTimer
from pretrain.training.step.bad_batches import BadBatches
from pretrain.training.step.controls import GradientMask, MicroBatchControls, StepTally

if TYPE_CHECKING:
    from pretrain.training.data import RunData
    from pretrain.training.report.profiling import RunProfiler
    from pretrain.training.run_context import RunContext
    from pretrain.training.step.loss_spikes import LossSpikes

Batch = dict[str, torch.Tensor]


def move(batch: Batch, device: torch.device, doc_mask: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The micro-batch's tensors on `device`. On CUDA each is copied into pinned memory first (a host
    copy of a few hundred KiB, from torch's caching pinned allocator): a copy from pageable memory may
    wait for the stream's queued work before staging, one from pinned memory is queued and returns."""

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    idx, targets = to_device(batch["input_ids"]), to_device(batch["targets"])
    return idx, targets, to_device(batch["doc_ids"]) if doc_mask else None


class StepResult(NamedTuple):
    loss: float  # mean over the step's good micro-batches and the ranks
    stop_requested: bool  # a rank received SIGTERM/SIGUSR1
    values: dict[str, float]  # logging steps: the step's own values (`step_values`)
    seconds: dict[str, float]  # a timed logging step's seconds per span (StepTimer.finish), else {}


class StepRunner:
    """The step of a run: its engine, the data it reads (positions, the tokens trained), the timer
    and profiler spans around each part, the spike limit and the bad micro-batches' accounting."""

    def __init__(
        self,
        run: RunContext,
        data: RunData,
        spikes: LossSpikes,
        profiler: RunProfiler,
        bad: BadBatches,
        timer: StepTimer,
    ) -> None:
        self.engine, self.t, self.rank, self.world = run.engine, run.cfg.train, run.rank, run.world
        self.device, self.comm, self.root, self.seq_len = run.device, run.comm, run.root, run.seq_len
        self.loader, self.count = data.loader, data.trained  # the tokens trained: each kept micro-batch's round's
        self.stop, self.spikes, self.profiler, self.bad, self.timer = run.stop, spikes, profiler, bad, timer
        # the control vector's device-side inputs: set without a sync, read with the step's one sync
        self.stop_flag = torch.zeros((), dtype=torch.float64, device=run.comm)
        self.grad_norm_bad = torch.zeros((), dtype=torch.float64, device=run.comm)
        self.grad_norm: torch.Tensor | None = None
        self.grad_mask = GradientMask(run.engine.module) if self.t.grad_accum > 1 else None
        self.digest = 0  # of the samples this rank read since the last step record (loader.sample_digest)

    @classmethod
    def build(cls, run: RunContext, data: RunData, spikes: LossSpikes, profiler: RunProfiler) -> StepRunner:
        """With its bad micro-batches' record (from the start step on) and its timer (train.time_breakdown)."""
        t = run.cfg.train
        bad = BadBatches(t, run.rank, run.world, run.out, run.start_step)
        return cls(run, data, spikes, profiler, bad, StepTimer(run.device, t.time_breakdown))

    def run(self, batches: Iterator[Batch], depth: int, log_now: bool, step: int) -> StepResult:
        """Train step `step` + 1 (the steps before it done) at loop depth `depth`; timed when `log_now`."""
        grad_accum = self.t.grad_accum
        self.timer.start(log_now)
        tally, scalars = StepTally(), {}
        unread: list[torch.Tensor] = []  # the control vectors of the micro-batches run since the last read
        rounds: list[tuple[int, int, dict[str, int]]] = []  # the loader's (epoch, batch in epoch) after each; tokens
        # the largest loss sum over the ranks a micro-batch may have (a spike's, train.loss_spike_action=skip)
        max_loss_sum = self.spikes.limit() * self.world if self.t.loss_spike_action != "log" else math.inf
        while tally.good < grad_accum:
            with self.timer.span("data", on_device=False), self.profiler.range("data"):
                batch = next(batches)
            tokens = round_tokens(self.loader, self.world, self.t.micro_batch_size, self.seq_len)  # on the host
            rounds.append((self.loader.epoch, self.loader.batch_in_epoch, tokens))
            loss, gates = self.forward(batch, depth, log_now)
            unread.append(self.controls(loss))
            keep: torch.Tensor | None = None  # a micro-batch read before its backward needs no mask
            if tally.good + len(unread) < grad_accum:  # not the last one yet: its controls are read later
                keep = MicroBatchControls.kept(unread[-1], max_loss_sum)
            else:
                read, unread = MicroBatchControls.read(unread), []  # the step's host sync
                self.settle(read, step, depth, tally, max_loss_sum, rounds)
                rounds = []
                if read[-1].dropped or read[-1].loss_sum > max_loss_sum:  # this one too: dropped before its backward
                    continue
            self.backward(loss, keep, boundary=tally.good == grad_accum)
            if log_now and tally.good == grad_accum:  # the gradients are complete until engine.step() clears them
                scalars = self.gradient_scalars(gates)
            with self.timer.span("optimizer"), self.profiler.range("optimizer_step"):
                self.engine.step()
        self.record_grad_norm()
        self.bad.end_step(step + 1)
        seconds = self.timer.finish()
        mean_loss = tally.loss_sum / grad_accum
        values = self.step_values(step + 1, mean_loss, depth, scalars) if log_now else {}
        return StepResult(mean_loss, tally.stop_requested, values, seconds)

    def forward(self, batch: Batch, depth: int, log_now: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The micro-batch's loss, and its gates on logging steps."""
        self.digest = (self.digest + sample_digest(batch["input_ids"])) % DIGEST_MOD  # on the host
        idx, targets, doc_ids = move(batch, self.device, self.t.doc_mask)
        with self.timer.span("forward"), self.profiler.range("forward"):
            out = self.engine(idx, targets, n_loops=depth, doc_ids=doc_ids, return_gates=log_now, return_logits=False)
        return out.loss, out.gates

    def controls(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's control vector, summed over the ranks on the device."""
        if self.stop.received:
            self.stop_flag.fill_(1.0)
        return all_reduce(MicroBatchControls.pack(loss, self.stop_flag, self.grad_norm_bad, self.comm))

    def settle(
        self,
        read: list[MicroBatchControls],
        step: int,
        depth: int,
        tally: StepTally,
        max_loss_sum: float,
        rounds: list[tuple[int, int, dict[str, int]]],
    ) -> None:
        """Account for the micro-batches just read, in order (`rounds`: the loader's position after
        each, and its round's tokens, counted where it is kept); raises TrainingStopped on a bad
        gradient norm or too many dropped micro-batches in a row."""
        for controls, (epoch, batch_in_epoch, tokens) in zip(read, rounds):
            if controls.grad_norm_bad:
                self.stop_on_bad_grad_norm(step)
            tally.stop_requested = tally.stop_requested or controls.stop_requested
            if controls.dropped:
                self.bad.non_finite(step + 1, depth)
                continue
            if controls.loss_sum > max_loss_sum:
                self.bad.spike(
                    step + 1, controls.loss_sum / self.world, max_loss_sum / self.world, epoch, batch_in_epoch
                )
                continue
            self.bad.good()
            self.count.add(tokens)
            tally.good += 1
            tally.loss_sum += controls.loss_sum / self.world

    def backward(self, loss: torch.Tensor, keep: torch.Tensor | None, boundary: bool) -> None:
        """DeepSpeed's backward; `keep`: the device flag of a micro-batch not read yet, whose
        gradients count only if it is true."""
        self.engine.set_gradient_accumulation_boundary(boundary)
        with self.timer.span("backward"), self.profiler.range("backward"):
            if keep is None:
                self.engine.backward(loss)
                return
            assert self.grad_mask is not None  # built whenever grad_accum > 1, the only case with unread micro-batches
            with self.grad_mask.keep_if(keep):
                self.engine.backward(loss)

    def gradient_scalars(self, gates: list[torch.Tensor]) -> dict[str, float | torch.Tensor]:
        """Norms and gate means (those on the device), taken before engine.step() clears the gradients."""
        gate_means = {f"gate/mean_step_{i}": g.detach().float().mean() for i, g in enumerate(gates, 1)}
        return {**norms(self.engine.module, self.world), **gate_means}

    def step_values(
        self, step: int, loss: float, depth: int, scalars: dict[str, float | torch.Tensor]
    ) -> dict[str, float]:
        """Logging step `step`'s own values; reading the gradient norm stops the run on a bad one."""
        return {
            "train/loss": loss,
            "train/lr": self.engine.get_lr()[0],
            "train/grad_norm": self.check_grad_norm(step),
            "train/depth": depth,
            "train/skipped_microbatches": self.bad.skipped_total,
            "train/tokens_seen": self.count.total,
            **{k: float(v) for k, v in scalars.items()},
        }

    def record_grad_norm(self) -> None:
        """The step's gradient norm, kept on the device: the next step's control vector checks
        it (or `check_grad_norm`)."""
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            self.grad_norm = torch.as_tensor(grad_norm, dtype=torch.float64).to(self.comm, non_blocking=True)
            # DeepSpeed reports a non-finite norm as -1 (its group norms mask inf/NaN to -1)
            self.grad_norm_bad = (~torch.isfinite(self.grad_norm) | (self.grad_norm < 0)).double()

    def check_grad_norm(self, step: int) -> float:
        """Stop now if the gradient norm of `step` (the last trained) was not finite (a host sync:
        logging, saving and the end only). Returns the norm (0 when DeepSpeed does not compute it)."""
        if self.grad_norm is None:
            return 0.0
        value = float(self.grad_norm)
        if not math.isfinite(value) or value < 0:  # -1: DeepSpeed's mark of a non-finite norm
            self.stop_on_bad_grad_norm(step)
        return value

    def stop_on_bad_grad_norm(self, step: int) -> None:
        raise TrainingStopped(
            f"non-finite gradient norm at step {step} (finite loss); parameters may be corrupt, "
            f"stopping without saving. Resume from {find_latest(self.root)}"
        )

    def take_digest(self) -> int:
        """The digest of the samples read since the last call (the step record's), and start anew."""
        digest, self.digest = self.digest, 0
        return digest
