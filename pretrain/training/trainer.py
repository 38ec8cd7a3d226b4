"""The training loop on the DeepSpeed engine: `Trainer.build` wires it, `fit` runs it.

Design choices that keep a looped model correct under ZeRO (docs/zero3.md):
- the loop depth is a pure function of (seed, step): identical on every rank;
- activation checkpointing is torch's non-reentrant checkpoint (parallelize.py);
- every training depth is >= 1, so every parameter of the GRT takes part in every step;
- one all-reduce per micro-batch carries the loss, a non-finite flag, the stop signal and
  the previous step's gradient-norm check, so that every rank skips, stops and saves
  together. The host reads them once per optimizer step outside logging steps, whatever
  grad_accum is (`Trainer.train_step`, docs/performance.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from pretrain.config import ConfigError
from pretrain.distributed import all_reduce, comm_device, discover, init_distributed
from pretrain.model import build_model
from pretrain.model.flops import count_params
from pretrain.training import checkpoint, deepspeed_internals
from pretrain.training.depth import depth_for_step, max_depth
from pretrain.training.ds_config import build_ds_config, load_ds_json, save_ds_config, zero_stage
from pretrain.training.health import (
    Heartbeat,
    NanInjection,
    RankFailure,
    StopSignal,
    TrainingStopped,
    explain_failure,
    one_line,
    rss_mb,
)
from pretrain.training.metrics import (
    MetricsWriter,
    Throughput,
    human_count,
    human_duration,
    memory_scalars,
    norms,
    peak_flops,
)
from pretrain.training.parallelize import (
    AUTO,
    AUTO_MEMORY_SHARE,
    AUTO_MODES,
    activation_bytes,
    check_checkpointing,
    checkpoint_and_compile,
    choose_checkpointing,
    compile_stats,
    modes_for_stage,
)
from pretrain.training.resume import check_resume
from pretrain.training.run_config import RunConfig, load_manifest, resolve

log = logging.getLogger("grt.train")

_ALLOW_DATA_CHANGE_HINT = "--set train.allow_data_change=true (or GRT_ALLOW_DATA_CHANGE=1 in the environment)"


def setup_logging(out: Path | None, rank: int) -> None:
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for h in list(root.handlers):
        root.removeHandler(h)
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(out / "train.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases, or the gate's biases)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_engine(
    cfg: RunConfig, world_size: int, device: torch.device, seq_len: int | None = None, ds: dict | None = None
):
    """The DeepSpeed engine and its merged config (`ds`, when the caller has merged it already).
    Activation checkpointing is applied after DeepSpeed has placed the weights and optimizer
    state, so that `auto` sees what is left; compilation with it (`checkpoint_and_compile`)."""
    import deepspeed

    ds = ds or build_ds_config(load_ds_json(cfg.ds_config), cfg.train, world_size, device.type == "cuda")
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=zero_stage(ds) == 3):
        model = build_model(cfg.model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg.train.weight_decay), config=ds
    )
    mode = checkpointing_mode(
        cfg, ds, device, seq_len or cfg.model.max_seq_len, count_params(model)["params"], world_size
    )
    checkpoint_and_compile(model, mode, cfg.train.compile)
    deepspeed_internals.check_engine(engine)
    if zero_stage(ds) == 3:
        deepspeed_internals.install_counters()
        # the whole model where no parameter is ever partitioned (one rank: ds_config.ALL_PERSISTENT,
        # or a threshold above every matrix), so that ZeRO-3's module hooks have nothing to do
        pinned = model if all(p.ds_persist for p in model.parameters()) else model.loop
        if cfg.train.zero3_pin_core and pinned is not None:
            deepspeed_internals.pin_parameters(engine, pinned)
    return engine, ds


def allocated_later(ds: dict, numel: int, world_size: int, dtype_bytes: int) -> int:
    """Device memory the engine allocates only in the first step, after `auto` reads the free
    memory: the full gradients under ZeRO-0/1 (ZeRO-2 and 3 partition them), and under
    ZeRO-3 with more than one rank the parameters gathered at once (stage3_max_live_parameters,
    DeepSpeed's default 1e9) plus the prefetch bucket (default 5e7), each at most the model.
    torch.compile's workspaces are left to the headroom (AUTO_MEMORY_SHARE)."""
    zero = ds.get("zero_optimization", {})
    later = dtype_bytes * numel if zero_stage(ds) < 2 else 0
    if zero_stage(ds) == 3 and world_size > 1:
        live = min(numel, int(zero.get("stage3_max_live_parameters", 1e9)))
        later += dtype_bytes * (live + min(numel, int(zero.get("stage3_prefetch_bucket_size", 5e7))))
    return later


def checkpointing_mode(
    cfg: RunConfig, ds: dict, device: torch.device, seq_len: int, numel: int, world_size: int
) -> str:
    """train.activation_checkpointing, with `auto` resolved from the estimated activation
    memory of one micro-batch at the deepest sampled depth against the device memory left
    once what the first step allocates is taken (`allocated_later` of the model's `numel`
    parameters; the least free over the ranks, so that every rank recomputes alike: ZeRO-3
    gathers parameters again in a recompute). On the CPU, auto is off. Logs one line."""
    t = cfg.train
    if t.activation_checkpointing != AUTO:
        return t.activation_checkpointing
    depth, dtype_bytes = max_depth(t, cfg.model.max_loops), 2 if ds["bf16"]["enabled"] else 4
    estimates = {
        mode: activation_bytes(cfg.model, t.micro_batch_size * seq_len, depth, mode, dtype_bytes)
        for mode in AUTO_MODES
        if mode in modes_for_stage(zero_stage(ds))
    }
    free, later = None, allocated_later(ds, numel, world_size, dtype_bytes)
    if device.type == "cuda":
        free_here = (
            torch.cuda.mem_get_info(device)[0]
            + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device)
            - later
        )
        free = int(all_reduce(torch.tensor(float(free_here), device=comm_device()), op="min").item())
    mode = choose_checkpointing(estimates, free)
    log.info(
        "activation checkpointing auto -> %s: estimated activation memory per micro-batch (%d x %d tokens, "
        "depth up to %d): %s; %s",
        mode,
        t.micro_batch_size,
        seq_len,
        depth,
        ", ".join(f"{m} {b / 2**20:,.1f} MiB" for m, b in estimates.items()),
        f"free device memory {free / 2**20:,.0f} MiB (least over ranks, after {later / 2**20:,.0f} MiB that the "
        f"first step allocates), {AUTO_MEMORY_SHARE:.0%} of it usable"
        if free is not None
        else "on the CPU: no checkpointing unless set",
    )
    return mode


def move(batch: dict, device: torch.device, doc_mask: bool):
    idx = batch["input_ids"].to(device, non_blocking=True)
    targets = batch["targets"].to(device, non_blocking=True)
    doc_ids = batch["doc_ids"].to(device, non_blocking=True) if doc_mask else None
    return idx, targets, doc_ids


@torch.no_grad()
def evaluate_depths(model, batches, depths, device, doc_mask=False) -> dict[int, float]:
    """Mean loss at each depth over the given batches, averaged over ranks (sum / count)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(depths) + 1, dtype=torch.float64, device=device)  # loss sums, then the count
    for batch in batches:
        idx, targets, doc_ids = move(batch, device, doc_mask)
        for i, r in enumerate(depths):
            totals[i] += model(idx, targets, n_loops=r, doc_ids=doc_ids, return_logits=False).loss.double()
        totals[-1] += 1
    values = all_reduce(totals.to(comm_device())).tolist()
    model.train(was_training)
    n = max(values[-1], 1.0)
    return {r: values[i] / n for i, r in enumerate(depths)}


def allow_data_change(cfg: RunConfig) -> bool:
    return cfg.train.allow_data_change or os.environ.get("GRT_ALLOW_DATA_CHANGE") == "1"


class GradientMask:
    """Zeroes a backward's gradients on the device when a device flag is false, before
    DeepSpeed accumulates or reduces them: a micro-batch whose non-finite check is not read
    yet runs its backward under `keep_if(flag)`, and adds nothing if it turns out bad (a
    non-finite gradient times zero would still be NaN, hence `where`). One hook per
    parameter, a no-op outside `keep_if`."""

    def __init__(self, module: torch.nn.Module):
        self.keep: torch.Tensor | None = None
        self.handles = [p.register_hook(self.mask) for p in module.parameters() if p.requires_grad]

    def mask(self, grad: torch.Tensor) -> torch.Tensor | None:
        return None if self.keep is None else torch.where(self.keep.to(grad.device), grad, 0.0)

    @contextmanager
    def keep_if(self, flag: torch.Tensor):
        self.keep = flag
        try:
            yield
        finally:
            self.keep = None


class StepResult(NamedTuple):
    loss: float  # mean over the step's good micro-batches and the ranks
    stop_requested: bool  # a rank received SIGTERM/SIGUSR1
    scalars: dict  # logging steps: norms and gate means


class Trainer:
    """One training run. `train()` below owns its life: build, fit, and close in `finally`."""

    def __init__(self, cfg: RunConfig, resume: bool = False):
        self.cfg, self.resume = cfg, resume
        self.out = Path(cfg.out)
        self.ckpt_root = self.out / "checkpoints"
        self.heartbeat: Heartbeat | None = None
        self.writer: MetricsWriter | None = None
        self.step, self.skipped_total, self.bad_in_a_row = 0, 0, 0

    # -- build ---------------------------------------------------------------------------
    def preflight(self) -> tuple[str | None, dict]:
        """Every check that needs no process group, before anything is written: the data, the
        checkpoint to resume (its tokenizer, model, schedule, batch size and data order), the
        merged DeepSpeed config and the checkpointing mode. Returns (the tag to resume or None,
        the merged DeepSpeed config). `grt train --dry-run` stops here."""
        self.manifest = load_manifest(self.cfg.data)  # loaded once; its loaders share it (tokenizer hashed once)
        resolve(self.cfg, self.manifest)
        tag = checkpoint.find_latest(self.ckpt_root)
        if tag is not None and not self.resume:
            raise ConfigError(
                f"{self.ckpt_root} already holds checkpoint {tag}: pass --resume to continue it, "
                "or choose another --out"
            )
        self.cfg = check_resume(self.cfg, self.ckpt_root, tag, manifest=self.manifest)
        t = self.cfg.train
        deepspeed_internals.check()
        ds = build_ds_config(load_ds_json(self.cfg.ds_config), t, discover().world_size, torch.cuda.is_available())
        check_checkpointing(t.activation_checkpointing, zero_stage(ds))
        self.check_data_order(tag)
        return tag, ds

    def build(self) -> None:
        """Checks first (`preflight`: no process group yet), then the group, engine, loaders and writer."""
        tag, ds = self.preflight()
        cfg, t = self.cfg, self.cfg.train
        self.stop = StopSignal()  # before the slow start-up: a signal during it stops after the first step
        self.faults = NanInjection()
        info = init_distributed(timeout_s=t.dist_timeout_s)
        self.rank, self.world = info.rank, info.world_size
        self.comm = comm_device()  # the device of every collective's tensors (distributed.comm_device)
        self.heartbeat = Heartbeat(self.rank, self.world)
        setup_logging(self.out, self.rank)
        deepspeed_internals.quiet_deprecated_collectives()
        self.device = torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(t.seed + self.rank)
        self.config_json = json.dumps(cfg.to_dict(), indent=2) + "\n"
        self.engine, self.ds = build_engine(cfg, self.world, self.device, self.manifest.seq_len, ds)
        self.write_run_config()
        self.seq_len = self.manifest.seq_len
        self.tokens_per_step = t.micro_batch_size * t.grad_accum * self.world * self.seq_len
        self.log_start()
        self.loader = self.data_loader("train")
        if tag is not None:
            state = checkpoint.load(self.engine, self.ckpt_root, tag, self.rank)
            self.step = state["step"]
            self.loader.load_state_dict(state["loader"], strict=not allow_data_change(cfg))
            log.info("resumed from %s at step %d", self.ckpt_root / tag, self.step)
        self.val = self.val_batches() if t.eval_every else None
        self.writer = MetricsWriter(self.out, self.rank)
        self.writer.text("config", self.config_json)
        self.writer.text("deepspeed_config", json.dumps(self.ds, indent=2))
        self.throughput = Throughput(cfg.model, self.seq_len, self.peak * self.world)
        # the control vector's device-side inputs: set without a sync, read with the step's one sync
        self.stop_flag = torch.zeros((), dtype=torch.float64, device=self.comm)
        self.grad_norm_bad = torch.zeros((), dtype=torch.float64, device=self.comm)
        self.grad_norm = None
        self.grad_mask = GradientMask(self.engine.module) if t.grad_accum > 1 else None

    def check_data_order(self, tag: str | None) -> None:
        """On resume, before any process group: the data must be the data the checkpoint saw."""
        if tag is None:
            return
        state_path = self.ckpt_root / tag / "rank0_state.pt"
        if not state_path.is_file():
            return  # checkpoint.load explains it
        saved = torch.load(state_path, weights_only=False).get("loader", {}).get("fingerprint")
        now = self.manifest.fingerprint("train")
        if saved is not None and saved != now and not allow_data_change(self.cfg):
            raise ConfigError(
                f"data={self.cfg.data!r}: the train split's shard list changed since checkpoint {tag} (fingerprint "
                f"{saved} -> {now}: shards added, removed, reordered or rewritten), so resuming would not continue "
                f"the same data order; restore the original manifest, or resume anyway with {_ALLOW_DATA_CHANGE_HINT}"
            )

    def write_run_config(self) -> None:
        """The run directory's config files (rank 0)."""
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(self.config_json)
            save_ds_config(self.ds, self.out)

    def log_start(self) -> None:
        cfg, t, engine = self.cfg, self.cfg.train, self.engine
        counts = count_params(engine.module)
        self.peak, peak_note = peak_flops(self.device, t.peak_tflops)
        log.info(
            "model %s layout %s: %s params (%s non-embedding), ZeRO stage %d, %d rank(s), %s, %d tokens/step",
            cfg.model.name,
            cfg.model.layout,
            f"{counts['params']:,}",
            f"{counts['non_embedding_params']:,}",
            zero_stage(self.ds),
            self.world,
            "bf16" if self.ds["bf16"]["enabled"] else "fp32",
            self.tokens_per_step,
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

    def data_loader(self, split: str, **overrides):
        from data_pipeline.loader import TokenBatchLoader

        t = self.cfg.train
        options = dict(
            micro_batch_size=t.micro_batch_size,
            rank=self.rank,
            world_size=self.world,
            num_workers=t.num_workers,
            seed=t.seed,
            shuffle_buffer=t.shuffle_buffer,
            skip_corrupt=t.skip_corrupt_shards,
            expected_seq_len=self.manifest.seq_len,
        )
        return TokenBatchLoader(self.manifest, split=split, **{**options, **overrides})

    def val_batches(self):
        if not self.manifest.splits.get("val"):
            return None
        batches = []
        for batch in self.data_loader("val", num_workers=0, shuffle_buffer=0, loop=False):
            batches.append(batch)
            if len(batches) >= self.cfg.train.eval_batches:
                break
        return batches

    # -- one optimizer step --------------------------------------------------------------
    def train_step(self, batches, depth: int, log_now: bool) -> StepResult:
        """grad_accum good micro-batches (one with a non-finite loss on any rank is dropped on
        every rank and replaced by the next), then DeepSpeed's optimizer step.

        Each micro-batch's control vector is all-reduced on the device; the host reads the
        vectors not read yet once, after the forward of the micro-batch that completes the
        step if they are all good, before its backward: one host sync per step outside
        logging steps, whatever grad_accum is. The micro-batches before it run their backward
        unread, under `GradientMask`: a dropped one's gradients are zeroed on the device, so
        it adds nothing. A step that dropped one reads again for its replacements."""
        t, engine = self.cfg.train, self.engine
        loss_sum, good, scalars = 0.0, 0, {}
        stop_requested = False
        unread = []  # the control vectors of the micro-batches run since the last read
        while good < t.grad_accum:
            idx, targets, doc_ids = move(next(batches), self.device, t.doc_mask)
            if self.loader.skipped_shards != self.skipped_shards:
                log.warning(
                    "rank %d skipped %d unreadable shard(s) so far (train.skip_corrupt_shards): %s",
                    self.rank,
                    self.loader.skipped_shards,
                    ", ".join(self.loader.bad_shards),
                )
                self.skipped_shards = self.loader.skipped_shards
            out = engine(idx, targets, n_loops=depth, doc_ids=doc_ids, return_gates=log_now, return_logits=False)
            loss = out.loss * float("nan") if self.faults.poisons(self.step) else out.loss
            if self.stop.received:
                self.stop_flag.fill_(1.0)
            detached = loss.detach().double().to(self.comm)
            unread.append(
                all_reduce(
                    torch.stack([detached, (~torch.isfinite(detached)).double(), self.stop_flag, self.grad_norm_bad])
                )
            )
            if good + len(unread) < t.grad_accum:  # not the last one yet: its flag is read later
                engine.set_gradient_accumulation_boundary(False)
                with self.grad_mask.keep_if(unread[-1][1] == 0):
                    engine.backward(loss)
                engine.step()
                continue
            controls = torch.stack(unread).tolist()  # the sync
            unread = []
            for loss_total, bad, stops, grad_norm_bad in controls:
                if grad_norm_bad > 0:
                    self.stop_on_bad_grad_norm()
                stop_requested = stop_requested or stops > 0
                if bad > 0:  # some rank saw a non-finite loss: every rank drops this micro-batch
                    self.skip_bad_micro_batch(depth)
                    continue
                self.bad_in_a_row = 0
                good += 1
                loss_sum += loss_total / self.world
            if controls[-1][1] > 0:  # this micro-batch is dropped before its backward
                continue
            engine.set_gradient_accumulation_boundary(good == t.grad_accum)
            engine.backward(loss)
            if log_now and good == t.grad_accum:  # the gradients are complete until engine.step() clears them
                scalars.update(norms(engine.module, self.world))
                scalars.update({f"gate/mean_step_{i}": g.detach().float().mean() for i, g in enumerate(out.gates, 1)})
            engine.step()
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None:  # checked inside the next step's control vector (or by check_grad_norm)
            self.grad_norm = torch.as_tensor(grad_norm, dtype=torch.float64).to(self.comm, non_blocking=True)
            self.grad_norm_bad = (~torch.isfinite(self.grad_norm)).double()
        return StepResult(loss_sum / t.grad_accum, stop_requested, {k: float(v) for k, v in scalars.items()})

    def skip_bad_micro_batch(self, depth: int) -> None:
        t = self.cfg.train
        self.skipped_total += 1
        self.bad_in_a_row += 1
        log.warning(
            "non-finite loss at step %d (depth %d): micro-batch skipped on every rank (%d in a row, limit %d)",
            self.step + 1,
            depth,
            self.bad_in_a_row,
            t.max_bad_steps,
        )
        if self.bad_in_a_row >= t.max_bad_steps:
            raise TrainingStopped(
                f"{self.bad_in_a_row} consecutive non-finite losses at step {self.step + 1}; stopping. The last "
                f"good checkpoint is {checkpoint.find_latest(self.ckpt_root) or 'none (no checkpoint yet)'} "
                f"in {self.ckpt_root}"
            )

    def check_grad_norm(self) -> float:
        """Stop now if the last step's gradient norm was not finite (a host sync: logging,
        saving and the end only). Returns the norm (0 when DeepSpeed does not compute it)."""
        if self.grad_norm is None:
            return 0.0
        value = float(self.grad_norm)
        if not math.isfinite(value):
            self.stop_on_bad_grad_norm()
        return value

    def stop_on_bad_grad_norm(self) -> None:
        raise TrainingStopped(
            f"non-finite gradient norm at step {self.step} (finite loss); parameters may be corrupt, "
            f"stopping without saving. Resume from {checkpoint.find_latest(self.ckpt_root)}"
        )

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, t, engine = self.cfg, self.cfg.train, self.engine
        max_r = cfg.model.max_loops
        batches = iter(self.loader)
        self.skipped_shards = self.loader.skipped_shards
        last_val, loss, stop_requested = {}, float("nan"), False  # a resume of a finished run trains no step
        engine.train()
        self.throughput.reset()
        while self.step < t.steps:
            depth = depth_for_step(t, max_r, self.step)
            log_now = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.steps
            self.heartbeat.step = self.step
            loss, stop_requested, scalars = self.train_step(batches, depth, log_now)
            self.step += 1
            self.throughput.add(self.tokens_per_step, depth)
            save_now = (
                (t.save_every and self.step % t.save_every == 0)
                or (t.save_final and self.step == t.steps)
                or stop_requested
            )
            if log_now:
                self.log_step(loss, depth, scalars)
            elif save_now:
                self.check_grad_norm()
            self.writer.step_record(self.step, {"loss": loss, "depth": depth, "rss_mb": round(rss_mb(), 1)})
            if self.val is not None and (self.step % t.eval_every == 0 or self.step == t.steps):
                last_val = self.validate()
            if save_now:
                saved = self.save()
                log.info("saved checkpoint %s", self.ckpt_root / saved)
            if stop_requested:
                log.info("stop signal received: checkpoint saved at step %d, exiting cleanly", self.step)
                break
        if self.rank != 0:
            return {}
        summary = {
            "out": str(self.out),
            "steps": self.step,
            "final_loss": loss,
            "val_loss_by_depth": last_val,
            "checkpoint": str(self.ckpt_root / (checkpoint.find_latest(self.ckpt_root) or "")),
            "tensorboard": str(self.out / "tb"),
            "skipped_microbatches": self.skipped_total,
            "stopped_by_signal": stop_requested,
            "skipped_shards": self.loader.skipped_shards,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def log_step(self, loss: float, depth: int, scalars: dict) -> None:
        t = self.cfg.train
        grad_norm = self.check_grad_norm()
        perf = self.throughput.read()
        tokens_seen = self.step * self.tokens_per_step
        lr = self.engine.get_lr()[0]
        values = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/depth": depth,
            "train/skipped_microbatches": self.skipped_total,
            "train/tokens_seen": tokens_seen,
            **perf,
            **memory_scalars(self.device),
            **scalars,
            "zero3/trace_invalidations": deepspeed_internals.COUNTERS.trace_invalidations,
            "zero3/param_gathers": deepspeed_internals.COUNTERS.gathers,
        }
        if t.compile:
            values["compile/unique_graphs"] = compile_stats()["unique_graphs"]
        self.writer.scalars(self.step, values)
        self.writer.scalars_by_tokens(tokens_seen, {"train/loss": loss})
        eta = (t.steps - self.step) * perf["perf/step_time_s"]
        log.info(
            "step %d/%d | loss %.4f | depth %d | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.2f%% | "
            "peak mem %.0f MB | tokens %s | ETA %s",
            self.step,
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
        )

    def validate(self) -> dict[int, float]:
        max_r = self.cfg.model.max_loops
        by_depth = evaluate_depths(self.engine, self.val, list(range(max_r + 1)), self.device, self.cfg.train.doc_mask)
        full = by_depth[max_r]
        self.writer.scalars(self.step, {"val/loss": full, **{f"val/loss_depth_{k}": v for k, v in by_depth.items()}})
        self.writer.scalars_by_tokens(self.step * self.tokens_per_step, {"val/loss": full})
        log.info(
            "validation at step %d: loss %.4f at full depth; by exit depth: %s",
            self.step,
            full,
            " ".join(f"{k}:{v:.3f}" for k, v in by_depth.items()),
        )
        self.engine.train()
        self.throughput.reset()  # evaluation time is not training throughput
        return by_depth

    def save(self) -> str:
        try:
            return checkpoint.save(
                self.engine,
                self.ckpt_root,
                self.step,
                config_json=self.config_json,
                tokenizer_path=self.manifest.tokenizer_path,
                loader_state=self.loader.state_dict(),
                keep=self.cfg.train.keep_checkpoints,
                rank=self.rank,
            )
        except checkpoint.CheckpointError as err:  # every rank agreed on it: stop cleanly, nothing half-written is used
            raise TrainingStopped(str(err)) from err

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.heartbeat is not None:
            self.heartbeat.close()


def dry_run(cfg: RunConfig, resume: bool = False) -> str:
    """`grt train --dry-run`: the run's checks (`Trainer.preflight`) and nothing else; one line
    saying what would train."""
    trainer = Trainer(cfg, resume)
    tag, ds = trainer.preflight()
    c, m = trainer.cfg, trainer.manifest
    return (
        f"would train {c.model.name} ({c.model.variant} {c.model.layout}, d {c.model.d_model}, vocab "
        f"{c.model.vocab_size}) on {c.data} (seq_len {m.seq_len}) for {c.train.steps} steps, ZeRO stage "
        f"{zero_stage(ds)}, {'bf16' if ds['bf16']['enabled'] else 'fp32'}, checkpointing "
        f"{c.train.activation_checkpointing}, compile {c.train.compile}, "
        f"{'resuming ' + tag if tag else 'from scratch'}"
    )


def train(cfg: RunConfig, resume: bool = False) -> dict:
    """Run training (resume=True: continue from the newest complete checkpoint, if any).
    Returns a summary dict on rank 0 (others: {}).

    A failure on one rank (an exception, or a peer that died or hung) stops every rank
    with RankFailure naming the rank that failed (see health.Heartbeat)."""
    trainer = Trainer(cfg, resume)
    try:
        trainer.build()
        return trainer.fit()
    except (ConfigError, TrainingStopped) as err:
        if trainer.heartbeat is not None and not isinstance(err, RankFailure):
            trainer.heartbeat.mark_failed(one_line(err))
        raise
    except Exception as err:
        explained = explain_failure(err, trainer.heartbeat)
        if explained is err:
            raise
        raise explained from err
    finally:
        trainer.close()
