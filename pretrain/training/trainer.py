"""The training loop on the DeepSpeed engine.

Design choices that keep a looped model correct under ZeRO (docs/zero3.md):
- the loop depth is a pure function of (seed, step): identical on every rank;
- activation checkpointing is torch's non-reentrant checkpoint (parallelize.py);
- every training depth is >= 1, so every parameter of the GRT takes part in every step;
- one all-reduce per micro-batch carries the loss, a non-finite flag and the stop
  signal, so that every rank skips, stops and saves together.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.training import checkpoint
from pretrain.training import zero3
from pretrain.config import ConfigError
from pretrain.training.depth import sample_depth
from pretrain.distributed import all_reduce, comm_device, discover, init_distributed
from pretrain.training.ds_config import build_ds_config, load_ds_json, save_ds_config, zero_stage
from pretrain.model.flops import count_params, flops_per_token
from pretrain.training.metrics import MetricsWriter, peak_flops, peak_memory_bytes
from pretrain.model import build_model
from pretrain.training.parallelize import apply_activation_checkpointing, apply_compile, compile_stats
from pretrain.training.resume import check_resume
from pretrain.training.run_config import RunConfig

log = logging.getLogger("grt.train")


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many bad steps); the last good checkpoint is intact."""


class RankFailure(TrainingStopped):
    """A rank died, hung or failed: every surviving rank stops with a message naming it."""


class Heartbeat:
    """Who failed, when a collective breaks (docs/reliability.md).

    A daemon thread on every rank bumps a counter and publishes this rank's step in the
    rendezvous TCP store (its own client connection, short timeout) every `interval` s.
    A rank that fails records its error there before exiting. When a collective raises
    (a peer's connection reset, or gloo/NCCL's dist_timeout_s passed), `diagnose()` reads
    the store twice, 3 intervals apart: a rank that recorded an error, or whose counter did
    not move (killed, crashed, frozen), is named; an unreachable store means rank 0's host
    (which serves it) is gone.
    """

    def __init__(self, rank: int, world: int, interval: float = 1.0):
        self.rank, self.world, self.interval = rank, world, interval
        self.prefix = f"grt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.step, self.beats = 0, 0
        self.store = None
        self._stop = threading.Event()
        if world < 2:
            return
        try:
            self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=max(2.0, 5 * interval)), wait_for_workers=False)
            self._beat()
        except Exception as err:  # no store to reach: fall back to the bare collective errors
            log.warning("heartbeat disabled (rendezvous store unreachable: %s)", err)
            self.store = None
            return
        threading.Thread(target=self._run, name="grt-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        self.beats += 1
        self.store.set(f"{self.prefix}hb/{self.rank}", f"{self.beats} {self.step}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:
                return

    def close(self) -> None:
        self._stop.set()

    def mark_failed(self, message: str, comm: bool = False) -> None:
        """Record this rank's error; comm=True: it is a failed collective (a symptom, not a cause)."""
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}failed/{self.rank}", ("comm|" if comm else "own|") + message[:2000])
            except Exception:
                pass

    def _read(self, what: str) -> dict[int, str]:
        keys = {r: f"{self.prefix}{what}/{r}" for r in range(self.world) if r != self.rank}
        return {r: self.store.get(k).decode() for r, k in keys.items() if self.store.check([k])}

    def diagnose(self) -> list[str]:
        """Descriptions of the other ranks that failed (empty: none found)."""
        if self.store is None:
            return []
        try:
            before = self._read("hb")
            time.sleep(3 * self.interval)
            after, failed = self._read("hb"), self._read("failed")
        except Exception:
            if self.rank == 0:
                return []
            return ["rank 0 is unreachable (it serves the rendezvous store: it exited, was killed or its host is down)"]
        notes, comm = [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            kind, _, text = failed.get(r, "|").partition("|")
            if kind == "own":
                notes.append(f"rank {r} failed: {text}")
            elif kind == "comm" and before.get(r) != after.get(r):
                comm.append(r)
            elif r not in after:
                notes.append(f"rank {r} never reported (it did not start or died at start-up)")
            elif before.get(r) == after[r]:
                notes.append(f"rank {r} stopped responding after step {after[r].split()[1]} "
                             "(killed, crashed or frozen: no heartbeat for "
                             f"{round(3 * self.interval, 1):g} s)")
        if not notes:
            lagging = [r for r, v in after.items() if int(v.split()[1]) < self.step and r not in comm]
            notes = [f"rank {r} is alive but stuck at step {after[r].split()[1]} (this rank reached step {self.step})"
                     for r in lagging]
        if not notes and comm:
            notes = [f"no rank died or reported an error of its own; rank(s) {', '.join(map(str, comm))} saw a "
                     "failed collective too (ranks waiting for each other: a hang or mismatched collectives; "
                     "see the traceback in each rank's log)"]
        return notes


_HEARTBEAT: Heartbeat | None = None


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's --signal) ask for a checkpoint and a clean exit."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name


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


def build_engine(cfg: RunConfig, world_size: int, device: torch.device):
    import deepspeed

    ds = build_ds_config(load_ds_json(cfg.ds_config), cfg.train, world_size, device.type == "cuda")
    with deepspeed.zero.Init(config_dict_or_path=ds, enabled=zero_stage(ds) == 3):
        model = build_model(cfg.model)
    if cfg.train.compile:
        apply_compile(model)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.train.weight_decay),
                                           config=ds)
    if zero_stage(ds) == 3:
        zero3.install_counters()
        if cfg.train.zero3_pin_core and model.loop is not None:
            zero3.pin_parameters(engine, model.loop)
    return engine, ds


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
    sums = torch.zeros(len(depths), dtype=torch.float64)
    count = 0
    for batch in batches:
        idx, targets, doc_ids = move(batch, device, doc_mask)
        for i, r in enumerate(depths):
            sums[i] += model(idx, targets, n_loops=r, doc_ids=doc_ids).loss.double().item()
        count += 1
    totals = all_reduce(torch.cat([sums, torch.tensor([float(count)], dtype=torch.float64)]).to(comm_device()))
    model.train(was_training)
    n = max(totals[-1].item(), 1.0)
    return {r: totals[i].item() / n for i, r in enumerate(depths)}


def val_batches(cfg: RunConfig, manifest, rank: int, world: int):
    from data_pipeline.loader import TokenBatchLoader

    if "val" not in manifest.splits or not manifest.splits["val"]:
        return None
    loader = TokenBatchLoader(cfg.data, split="val", micro_batch_size=cfg.train.micro_batch_size, rank=rank,
                              world_size=world, num_workers=0, seed=cfg.train.seed, shuffle_buffer=0,
                              skip_corrupt=cfg.train.skip_corrupt_shards, loop=False)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) >= cfg.train.eval_batches:
            break
    return batches


def resolve(cfg: RunConfig) -> RunConfig:
    """Checks that need the data: the model's vocabulary and context follow the tokenizer's."""
    from data_pipeline.manifest import Manifest

    if not Path(cfg.data).is_file():
        raise ConfigError(f"data={cfg.data!r}: no such manifest (write one with `grt data prepare`)")
    manifest = Manifest.load(cfg.data)
    if cfg.model.vocab_size != manifest.vocab_size:
        cfg.model.vocab_size = manifest.vocab_size
    if manifest.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"the shards' seq_len={manifest.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    cfg.validate()
    return cfg


def train(cfg: RunConfig, resume: bool = False) -> dict:
    """Run training (resume=True: continue from the newest complete checkpoint, if any).
    Returns a summary dict on rank 0 (others: {}).

    A failure on one rank (an exception, or a peer that died or hung) stops every rank
    with RankFailure naming the rank that failed (see Heartbeat)."""
    global _HEARTBEAT
    try:
        return _train(cfg, resume)
    except (ConfigError, TrainingStopped) as err:
        if _HEARTBEAT is not None and not isinstance(err, RankFailure):
            _HEARTBEAT.mark_failed(_one_line(err))
        raise
    except Exception as err:
        explained = _explain_failure(err)
        if explained is err:
            raise
        raise explained from err
    finally:
        if _HEARTBEAT is not None:
            _HEARTBEAT.close()
            _HEARTBEAT = None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:1000]


def _is_comm_error(err: BaseException) -> bool:
    """A failed collective (peer gone, timeout): a symptom of another rank's failure."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(k in text for k in (
        "gloo", "NCCL", "Connection reset", "Connection closed", "pair closure", "Timed out", "timed out"))


def _explain_failure(err: Exception) -> Exception:
    """The exception to raise for `err`: RankFailure naming the failed rank, when known."""
    from data_pipeline.shards import ShardError

    own = _one_line(err)
    if isinstance(err, ShardError):
        own += " (set train.skip_corrupt_shards=true to skip unreadable shards with a warning)"
    hb = _HEARTBEAT
    if hb is None or hb.store is None:
        return TrainingStopped(f"data error: {own}") if isinstance(err, ShardError) else err
    comm = _is_comm_error(err)
    hb.mark_failed(own, comm=comm)
    others = hb.diagnose()
    if comm and others:  # a collective failed here: the cause is elsewhere
        message = f"rank {hb.rank} stopping: " + "; ".join(others) + f" [this rank saw {own[:300]}]"
    else:
        message = f"rank {hb.rank} failed: {own}" + (f"; also: {'; '.join(others)}" if others else "")
    log.error("%s", message, exc_info=err)
    return RankFailure(message)


def _preflight(cfg: RunConfig, tag: str | None, ckpt_root: Path) -> None:
    """Checks that need no process group: the DeepSpeed batch sizes, and on resume the data."""
    from data_pipeline.manifest import Manifest

    build_ds_config(load_ds_json(cfg.ds_config), cfg.train, discover().world_size, torch.cuda.is_available())
    if tag is None:
        return
    state_path = ckpt_root / tag / "rank0_state.pt"
    if not state_path.is_file():
        return  # checkpoint.load explains it
    saved = torch.load(state_path, weights_only=False).get("loader", {}).get("fingerprint")
    now = Manifest.load(cfg.data).fingerprint("train")
    if saved is not None and saved != now and not _allow_data_change(cfg):
        raise ConfigError(
            f"data={cfg.data!r}: the train split's shard list changed since checkpoint {tag} (fingerprint {saved} "
            f"-> {now}: shards added, removed, reordered or rewritten), so resuming would not continue the same data "
            f"order; restore the original manifest, or resume anyway with {_ALLOW_DATA_CHANGE_HINT}")


_ALLOW_DATA_CHANGE_HINT = "--set train.allow_data_change=true (or GRT_ALLOW_DATA_CHANGE=1 in the environment)"


def _allow_data_change(cfg: RunConfig) -> bool:
    return cfg.train.allow_data_change or os.environ.get("GRT_ALLOW_DATA_CHANGE") == "1"


def _rss_mb() -> float:
    """This process's resident memory now (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _train(cfg: RunConfig, resume: bool = False) -> dict:
    global _HEARTBEAT
    from data_pipeline.loader import TokenBatchLoader
    from data_pipeline.manifest import Manifest

    cfg = resolve(cfg)
    t = cfg.train
    out = Path(cfg.out)
    ckpt_root = out / "checkpoints"
    tag = checkpoint.find_latest(ckpt_root)
    if tag is not None and not resume:
        raise ConfigError(f"{ckpt_root} already holds checkpoint {tag}: pass --resume to continue it, "
                          "or choose another --out")
    cfg = check_resume(cfg, ckpt_root, tag)  # before anything is written or compared by fingerprint
    _preflight(cfg, tag, ckpt_root)
    stop = StopSignal()  # before the slow start-up: a signal during it stops after the first step, with a checkpoint
    info = init_distributed(timeout_s=t.dist_timeout_s)
    rank, world = info.rank, info.world_size
    _HEARTBEAT = Heartbeat(rank, world)
    setup_logging(out, rank)
    device = torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(t.seed + rank)
    manifest = Manifest.load(cfg.data)
    manifest.check(expected_seq_len=manifest.seq_len)
    config_json = json.dumps(cfg.to_dict(), indent=2) + "\n"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(config_json)

    engine, ds = build_engine(cfg, world, device)
    if rank == 0:
        save_ds_config(ds, out)
    counts = count_params(engine.module) if zero_stage(ds) < 3 else _zero3_param_counts(cfg)
    seq_len = manifest.seq_len
    tokens_per_step = t.micro_batch_size * t.grad_accum * world * seq_len
    peak, peak_note = peak_flops(device, t.peak_tflops)
    log.info("model %s layout %s: %s params (%s non-embedding), ZeRO stage %d, %d rank(s), %s, %d tokens/step",
             cfg.model.name, cfg.model.layout, f"{counts['params']:,}", f"{counts['non_embedding_params']:,}",
             zero_stage(ds), world, "bf16" if ds["bf16"]["enabled"] else "fp32", tokens_per_step)
    log.info("MFU peak: %s", peak_note)
    log.info("optimizer: %s (fused: DeepSpeed's FusedAdam on CUDA, torch's fused AdamW on CPU); layer norm: "
             "torch.nn.LayerNorm; checkpointing: %s; compile: %s", _optimizer_name(engine),
             t.activation_checkpointing, t.compile)

    loader = TokenBatchLoader(cfg.data, split="train", micro_batch_size=t.micro_batch_size, rank=rank,
                              world_size=world, num_workers=t.num_workers, seed=t.seed,
                              shuffle_buffer=t.shuffle_buffer, skip_corrupt=t.skip_corrupt_shards,
                              expected_seq_len=seq_len, expected_tokenizer_sha256=manifest.tokenizer_sha256)
    step = 0
    if tag is not None:
        state = checkpoint.load(engine, ckpt_root, tag, rank)
        step = state["step"]
        loader.load_state_dict(state["loader"], strict=not _allow_data_change(cfg))
        log.info("resumed from %s at step %d", ckpt_root / tag, step)
    val = val_batches(cfg, manifest, rank, world) if t.eval_every else None
    writer = MetricsWriter(out, rank)
    writer.text("config", config_json)
    max_r = cfg.model.max_loops
    batches = iter(loader)
    bad_in_a_row, skipped_total = 0, 0
    window_tokens, window_start = 0, time.time()
    last_val = {}
    summary = {}
    loss_value, stop_requested = float("nan"), False  # a resume of a finished run trains no step

    def save_now(at_step):
        try:
            return checkpoint.save(engine, ckpt_root, at_step, config_json=config_json,
                                   tokenizer_path=manifest.tokenizer_path, loader_state=loader.state_dict(),
                                   keep=t.keep_checkpoints, rank=rank)
        except checkpoint.CheckpointError as err:  # every rank agreed on it: stop cleanly, nothing half-written is used
            writer.close()
            raise TrainingStopped(str(err)) from err

    skipped_shards = loader.skipped_shards

    engine.train()
    while step < t.steps:
        r = sample_depth(t.depth_sampling, max_r, t.seed, step, t.poisson_mean, t.poisson_sigma)
        log_now = (step + 1) % t.log_every == 0 or step + 1 == t.steps
        losses, gate_means, good = [], None, 0
        stop_requested = False
        while good < t.grad_accum:
            _HEARTBEAT.step = step
            idx, targets, doc_ids = move(next(batches), device, t.doc_mask)
            if loader.skipped_shards != skipped_shards:
                log.warning("rank %d skipped %d unreadable shard(s) so far (train.skip_corrupt_shards): %s", rank,
                            loader.skipped_shards, ", ".join(loader.bad_shards))
                skipped_shards = loader.skipped_shards
            out_ = engine(idx, targets, n_loops=r, doc_ids=doc_ids, return_gates=log_now)
            loss = out_.loss
            if _fault_injected(step):
                loss = loss * float("nan")
            # one collective per micro-batch: [loss sum, non-finite flag, stop flag]
            agree = torch.tensor([loss.detach().float().item(), 0.0 if torch.isfinite(loss).item() else 1.0,
                                  1.0 if stop.received else 0.0], dtype=torch.float64, device=comm_device())
            agree = all_reduce(agree)
            stop_requested = stop_requested or agree[2].item() > 0
            if agree[1].item() > 0:  # some rank saw a non-finite loss: every rank skips this micro-batch
                skipped_total += 1
                bad_in_a_row += 1
                log.warning("non-finite loss at step %d (depth %d): micro-batch skipped on every rank "
                            "(%d in a row, limit %d)", step + 1, r, bad_in_a_row, t.max_bad_steps)
                if bad_in_a_row >= t.max_bad_steps:
                    writer.close()
                    raise TrainingStopped(
                        f"{bad_in_a_row} consecutive non-finite losses at step {step + 1}; stopping. The last good "
                        f"checkpoint is {checkpoint.find_latest(ckpt_root) or 'none (no checkpoint yet)'} in {ckpt_root}")
                continue
            bad_in_a_row = 0
            engine.backward(loss)
            engine.step()
            losses.append(agree[0].item() / world)
            if log_now and out_.gates:
                gate_means = [g.detach().float().mean().item() for g in out_.gates]
            good += 1
            window_tokens += idx.numel() * world
        step += 1
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            writer.close()
            raise TrainingStopped(f"non-finite gradient norm at step {step} (finite loss); parameters may be corrupt, "
                                  f"stopping without saving. Resume from {checkpoint.find_latest(ckpt_root)}")
        loss_value = sum(losses) / len(losses)
        if log_now:
            elapsed = max(time.time() - window_start, 1e-9)
            tps = window_tokens / elapsed
            fpt = flops_per_token(cfg.model, seq_len, n_loops=r, executed=True)
            mfu = 3 * fpt * tps / (peak * world)
            lr = engine.get_lr()[0]
            scalars = {"train/loss": loss_value, "train/lr": lr, "train/grad_norm": float(grad_norm or 0.0),
                       "train/depth": r, "train/skipped_microbatches": skipped_total,
                       "perf/tokens_per_s": tps, "perf/mfu": mfu, "memory/peak_bytes": peak_memory_bytes(device),
                       "zero3/trace_invalidations": zero3.COUNTERS.trace_invalidations,
                       "zero3/param_gathers": zero3.COUNTERS.gathers}
            if t.compile:
                scalars["compile/unique_graphs"] = compile_stats()["unique_graphs"]
            for i, g in enumerate(gate_means or [], start=1):
                scalars[f"gate/mean_step_{i}"] = g
            writer.scalars(step, scalars)
            log.info("step %d/%d | loss %.4f | depth %d | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.2f%% | peak mem %.0f MB",
                     step, t.steps, loss_value, r, lr, float(grad_norm or 0.0), tps, 100 * mfu,
                     scalars["memory/peak_bytes"] / 2**20)
            window_tokens, window_start = 0, time.time()
        writer.step_record(step, {"loss": loss_value, "depth": r, "rss_mb": round(_rss_mb(), 1)})
        if val is not None and t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            last_val = evaluate_depths(engine, val, list(range(0, max_r + 1)) if max_r else [0], device, t.doc_mask)
            full = last_val[max_r] if max_r else last_val[0]
            writer.scalars(step, {"val/loss": full, **{f"val/loss_depth_{k}": v for k, v in last_val.items()}})
            log.info("validation at step %d: loss %.4f at full depth; by exit depth: %s", step, full,
                     " ".join(f"{k}:{v:.3f}" for k, v in last_val.items()))
            engine.train()
        if (t.save_every and step % t.save_every == 0) or step == t.steps or stop_requested:
            saved = save_now(step)
            log.info("saved checkpoint %s", ckpt_root / saved)
        if stop_requested:
            log.info("stop signal received: checkpoint saved at step %d, exiting cleanly", step)
            break
    writer.close()
    if rank == 0:
        summary = {"out": str(out), "steps": step, "final_loss": loss_value, "val_loss_by_depth": last_val,
                   "checkpoint": str(ckpt_root / (checkpoint.find_latest(ckpt_root) or "")),
                   "tensorboard": str(out / "tb"), "skipped_microbatches": skipped_total,
                   "stopped_by_signal": bool(stop_requested), "skipped_shards": loader.skipped_shards}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


_INJECTED: Counter = Counter()


def _fault_injected(step: int) -> bool:
    """Fault injection for the reliability tests: GRT_INJECT_NAN_STEPS=3,4 makes the loss of the
    first micro-batch tried at steps 3 and 4 NaN (the retry with the next micro-batch is clean);
    a step listed k times poisons its first k tries (5,5,5: three bad micro-batches in a row)."""
    steps = os.environ.get("GRT_INJECT_NAN_STEPS")
    if not steps:
        return False
    if _INJECTED[step] < [s.strip() for s in steps.split(",")].count(str(step + 1)):
        _INJECTED[step] += 1
        return True
    return False


def _optimizer_name(engine) -> str:
    """The optimizer doing the update, below DeepSpeed's ZeRO wrapper."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    fused = getattr(inner, "defaults", {}).get("fused")
    return f"{type(inner).__module__}.{type(inner).__name__}" + (" (fused=True)" if fused else "")


def _zero3_param_counts(cfg: RunConfig) -> dict:
    with torch.device("meta"):
        return count_params(build_model(cfg.model))
