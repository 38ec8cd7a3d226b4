"""The training loop on the DeepSpeed engine: `Trainer.build` wires it, `fit` runs it.

Design choices that keep a looped model correct under ZeRO (docs/zero3.md):
- the loop depth is a pure function of (seed, step): identical on every rank;
- activation checkpointing is torch's non-reentrant checkpoint (parallelize.py; `auto` is
  resolved in auto_checkpointing.py);
- every training depth is >= 1, so every parameter of the GRT takes part in every step;
- one all-reduce per micro-batch carries the loss, a non-finite flag, the stop signal and
  the previous step's gradient-norm check (step_controls.py), so that every rank skips, stops
  and saves together. The host reads them once per optimizer step outside logging steps,
  whatever grad_accum is (`Trainer.train_step`, docs/performance.md).

What a start writes, and when (docs/reliability.md, "Bad runs"): nothing before rank 0 holds
the run directory's lock (run_lock.py, agreed by every rank) and, on resume, before a
checkpoint is loaded on every rank (`checkpoint.load_agreed`); then `commit` writes the run's
config files and the log. A refused start leaves --out as it was.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import logging.handlers
import math
import os
import socket
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from data_pipeline.files import atomic_write_text
from data_pipeline.loader import DIGEST_MOD, sample_digest
from data_pipeline.mixture import DataMixture, MixtureError, MixtureLoader, SourceSpec, Stage, parse_stages
from pretrain.config import ConfigError
from pretrain.distributed import (
    RankFailed,
    all_reduce,
    check_ranks,
    comm_device,
    discover,
    gather_text,
    init_distributed,
)
from pretrain.errors import UnreadableCheckpoint
from pretrain.model.flops import count_params
from pretrain.training import checkpoint, deepspeed_internals, run_lock, universal
from pretrain.training.depth import depth_for_step
from pretrain.training.ds_config import build_ds_config, load_ds_json, save_ds_config, zero_stage
from pretrain.training.engine import build_engine
from pretrain.training.fit_hooks import DelayInjection, NanFaults, warn_on_skipped_shards
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
    trim_records,
)
from pretrain.training.parallelize import check_checkpointing, compile_stats
from pretrain.training.profiling import RunProfiler, profiles
from pretrain.training.resume import check_tag, none_readable
from pretrain.training.run_config import RunConfig, apply_token_budget, load_manifest, profile_window, resolve
from pretrain.training.step_controls import GradientMask, MicroBatchControls, StepTally
from pretrain.training.step_timer import LossSpikes, SlowRanks, StepTimer, breakdown_scalars
from pretrain.training.task_eval import TaskEval
from pretrain.training.wandb_run import WandbRun, check_available

if TYPE_CHECKING:
    from data_pipeline.loader import TokenBatchLoader
    from data_pipeline.manifest import Manifest

Batch = dict[str, torch.Tensor]

log = logging.getLogger("grt.train")

DATA_SKIPS = "data_skips.json"  # a rollback's record: a resume from that checkpoint skips the same data
_ALLOW_DATA_CHANGE_HINT = "--set train.allow_data_change=true (or GRT_ALLOW_DATA_CHANGE=1 in the environment)"


def setup_logging(rank: int) -> logging.handlers.MemoryHandler | None:
    """The log on stdout; on rank 0 also kept in memory until `log_to_file` names the file
    (nothing is written into the run directory before the start is known good)."""
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for h in list(root.handlers):
        root.removeHandler(h)
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if rank != 0:
        return None
    held = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    held.setFormatter(fmt)
    root.addHandler(held)
    return held


def log_to_file(held: logging.handlers.MemoryHandler, path: Path) -> None:
    """From now on the log also goes to `path` (appended), the lines held so far first."""
    fh = logging.FileHandler(path)
    fh.setFormatter(held.formatter)
    held.setTarget(fh)
    held.flush()
    root = logging.getLogger()
    root.removeHandler(held)
    held.close()
    root.addHandler(fh)


def move(batch: Batch, device: torch.device, doc_mask: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    idx = batch["input_ids"].to(device, non_blocking=True)
    targets = batch["targets"].to(device, non_blocking=True)
    doc_ids = batch["doc_ids"].to(device, non_blocking=True) if doc_mask else None
    return idx, targets, doc_ids


@torch.no_grad()
def evaluate_depths(
    model: torch.nn.Module, batches: Iterable[Batch], depths: list[int], device: torch.device, doc_mask: bool = False
) -> dict[int, float]:
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


def say(message: str) -> None:
    """One line on stderr, from rank 0 only: what a resume passes over."""
    if discover().rank == 0:
        print(f"grt train: {message}", file=sys.stderr, flush=True)


def _count(items: list[str], what: str) -> str:
    return f"{len(items)} {what}{'' if len(items) == 1 else 's'}"


def time_shares(seconds: dict[str, float]) -> str:
    """' | time data/fwd/bwd/opt/other 2/38/45/10/5%' of a timed step, '' of an untimed one."""
    if not seconds:
        return ""
    step = seconds["step"] or 1e-12
    shares = "/".join(f"{100 * seconds[k] / step:.0f}" for k in ("data", "forward", "backward", "optimizer", "other"))
    return f" | time data/fwd/bwd/opt/other {shares}%"


def restarted_by_agent() -> bool:
    """Whether torchrun's elastic agent runs this process and may restart it (the same answer on
    every node: TORCHELASTIC_MAX_RESTARTS is the job's)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def allow_data_change(cfg: RunConfig) -> bool:
    return cfg.train.allow_data_change or os.environ.get("GRT_ALLOW_DATA_CHANGE") == "1"


class SpikeRollback(Exception):
    """Raised on every rank (the same all-reduced loss, the same limit) by a loss spike under
    train.loss_spike_action=rollback; the fit loop rolls back (`Trainer.roll_back`)."""


class StepResult(NamedTuple):
    loss: float  # mean over the step's good micro-batches and the ranks
    stop_requested: bool  # a rank received SIGTERM/SIGUSR1
    scalars: dict[str, float]  # logging steps: norms and gate means


class Trainer:
    """One training run. `train()` below owns its life: build, fit, and close in `finally`."""

    def __init__(self, cfg: RunConfig, resume: bool = False) -> None:
        self.cfg, self.resume = cfg, resume
        self.out = Path(cfg.out)
        self.ckpt_root = self.out / "checkpoints"
        self.heartbeat: Heartbeat | None = None  # None until build() starts it: train() reports failures through it
        self.writer: MetricsWriter  # build() opens it
        self.wandb: WandbRun | None = None  # rank 0 with train.wandb: build() opens it
        self.closing = ExitStack()  # what build() opened, for close()
        self.step, self.skipped_total, self.bad_in_a_row = 0, 0, 0
        self.requested = copy.deepcopy(cfg)  # the config as given, before a checkpoint's started schedule is kept
        self.candidates: list[str] = []  # on resume: the chosen checkpoint, then the older complete ones
        self.held_log: logging.handlers.MemoryHandler | None = None
        self.lock: run_lock.RunLock | None = None  # rank 0's, from lock_run_dir()
        self.passed_over: list[str] = []  # on resume: why each newer complete checkpoint was passed over
        self.change_notes: dict[str, list[str]] = {}  # tag -> the line of settings a resume from it changes

    # -- build ---------------------------------------------------------------------------
    def preflight(self) -> tuple[str | None, dict]:
        """Every check that needs no process group, before anything is written: the data, that
        no live run holds --out, the checkpoint to resume (`choose_checkpoint`: its tokenizer,
        model, schedule, batch size and data order), the validation split, the merged DeepSpeed
        config and the checkpointing mode. Returns (the tag to resume or None, the merged
        DeepSpeed config). `grt train --dry-run` stops here (and checks the tag's files)."""
        self.manifest = load_manifest(self.cfg.data)  # loaded once; its loaders share it (tokenizer hashed once)
        resolve(self.cfg, self.manifest)
        check_available(self.cfg)  # train.wandb=true without the wandb package: refused before anything starts
        world = discover().world_size
        apply_token_budget(self.cfg, world, self.manifest.seq_len)  # the steps a resume is checked with
        self.requested = copy.deepcopy(self.cfg)
        run_lock.refuse_if_in_use(self.out)  # before any checkpoint is read: another run may be writing them
        tag = self.choose_checkpoint()
        budget = apply_token_budget(self.cfg, world, self.manifest.seq_len)  # on the global batch kept
        if budget:
            say(budget)
        t = self.cfg.train
        self.check_split_sizes()
        self.tasks = TaskEval.build(self.cfg, self.manifest.tokenizer_path)  # task files read once; None: off
        self.stages = self.check_data_plan()
        deepspeed_internals.check()
        ds = build_ds_config(load_ds_json(self.cfg.ds_config), t, world, torch.cuda.is_available())
        if tag is not None and universal.needs_universal(self.ckpt_root / tag, world):
            ds = universal.with_universal_load(ds)  # read when the engine is built
        check_checkpointing(t.activation_checkpointing, zero_stage(ds))
        return tag, ds

    def choose_checkpoint(self) -> str | None:
        """The checkpoint to resume (None: a fresh start), checked against the run config:
        the newest complete one that can be read (a newer unreadable one is passed over, in
        one line). Refused: a start without --resume over checkpoints, a --resume over
        checkpoints of which none is complete, or none that can be read."""
        root = self.ckpt_root
        candidates, dirs = checkpoint.resume_candidates(root), checkpoint.tag_dirs(root)
        incomplete = [d for d in dirs if d not in checkpoint.complete_tags(root)]
        if not self.resume and candidates:
            raise ConfigError(
                f"{root} already holds checkpoint {candidates[0]}: pass --resume to continue it, "
                "or choose another --out"
            )
        if not candidates and incomplete and self.resume and restarted_by_agent():
            say(
                f"{root} holds only {_count(incomplete, 'interrupted save')} ({', '.join(incomplete)}), this job's own "
                "under torchrun's elastic agent (a restart after a failure in its first save): starting from step 0"
            )
        elif not candidates and incomplete:
            raise ConfigError(
                f"{'--resume' if self.resume else '--out'}: {root} holds no complete checkpoint, only "
                f"{_count(incomplete, 'interrupted save')} ({', '.join(incomplete)}: no COMPLETE marker), so there is "
                "nothing to resume, and a start from step 0 would overwrite them: remove them (or the whole run "
                "directory) to start afresh, or choose another --out"
            )
        problems = []
        for i, tag in enumerate(candidates):
            try:
                self.cfg = self.resume_checks(tag)
            except UnreadableCheckpoint as err:
                problems.append(f"{tag}: {err.problem}")
                self.passed_over.append(str(err))
                continue
            self.candidates = candidates[i:]
            return tag
        if problems:
            raise none_readable(root, problems)
        return None

    def resume_checks(self, tag: str) -> RunConfig:
        """The run config as given, checked against checkpoint `tag` (its model, schedule, batch
        size, tokenizer and data order): ConfigError to refuse, UnreadableCheckpoint when the
        tag's own files cannot be read. Returns it with the started schedule kept."""
        notes: list[str] = []
        cfg = check_tag(copy.deepcopy(self.requested), self.ckpt_root, tag, manifest=self.manifest, notes=notes)
        self.check_data_order(tag, cfg)
        self.change_notes[tag] = notes
        return cfg

    def check_data_plan(self) -> list[Stage]:
        """The mixture's stages (train.data_stages), and the run against the repetition cap
        (train.max_repeats): refused in one line when the sources cannot fill the run."""
        t, data = self.cfg.train, self.manifest
        if not isinstance(data, DataMixture):
            if t.data_stages:
                raise ConfigError(
                    f"train.data_stages={t.data_stages!r} needs a mixture of sources (data=name=weight:path,...), "
                    f"not one manifest ({self.cfg.data!r})"
                )
            data = DataMixture([SourceSpec("data", 1.0, self.cfg.data)], [data])
        try:
            stages = parse_stages(t.data_stages, data.names)
            per_step = t.micro_batch_size * t.grad_accum * discover().world_size
            data.check_budget(t.steps * per_step, t.max_repeats, stages, data.seq_len)
        except MixtureError as err:
            raise ConfigError(str(err)) from None
        return stages

    def check_split_sizes(self) -> None:
        """Training needs one global batch (every rank's micro-batches of a step), validation,
        when it runs, one micro-batch per rank: a smaller split gives a rank no batch
        (validation's mean over nothing would be reported as a loss of 0.0)."""
        t = self.cfg.train
        world = discover().world_size
        per_round = f"train.micro_batch_size {t.micro_batch_size} x {world} rank(s)"
        needs = {
            "train": (
                world * t.micro_batch_size * t.grad_accum,
                f"one global batch ({per_round} x train.grad_accum {t.grad_accum})",
                "training would have no batch; use a smaller batch or prepare more data",
            )
        }
        if t.eval_every and self.sources("val"):
            needs["val"] = (
                world * t.micro_batch_size,
                f"one micro-batch per rank ({per_round})",
                "so validation (train.eval_every) would score nothing; prepare a larger validation split (grt data "
                "prepare --val-fraction), use a smaller train.micro_batch_size, or train without validation "
                "(--set train.eval_every=0)",
            )
        for split, (need, what, use) in needs.items():
            sources = self.sources(split) if split == "val" else [("", self.manifest)]
            for name, data in sources:
                have = data.sequences(split)
                if have < need:
                    where = f"data={self.cfg.data!r}" + (f" source {name!r}" if name else "")
                    raise ConfigError(
                        f"{where}: the {split} split has {have} sequences, fewer than {what} = {need}: {use}"
                    )

    def sources(self, split: str) -> list[tuple[str, Manifest]]:
        """The manifests that have `split`, by source name ("" for a run on one manifest)."""
        if isinstance(self.manifest, DataMixture):
            return self.manifest.with_split(split)
        return [("", self.manifest)] if self.manifest.splits.get(split) else []

    def build(self) -> None:
        """Checks first (`preflight`: no process group yet), then the group, the run directory's
        lock, the engine, the checkpoint (agreed by every rank), and only then anything written
        into --out (`commit`), the loaders and the writer."""
        tag, ds = self.preflight()
        cfg, t = self.cfg, self.cfg.train
        self.stop = StopSignal()  # before the slow start-up: a signal during it stops after the first step
        info = init_distributed(timeout_s=t.dist_timeout_s)
        self.rank, self.world = info.rank, info.world_size
        self.comm = comm_device()  # the device of every collective's tensors (distributed.comm_device)
        self.heartbeat = Heartbeat(self.rank, self.world)
        self.closing.callback(self.heartbeat.close)
        self.held_log = setup_logging(self.rank)
        self.spikes = LossSpikes(t.loss_spike_threshold, say=self.rank == 0)  # its history: the checkpoint's
        self.lock_run_dir()
        deepspeed_internals.quiet_deprecated_collectives()
        self.device = torch.device(f"cuda:{info.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(t.seed + self.rank)
        self.engine, self.ds = build_engine(cfg, self.world, self.device, self.manifest.seq_len, ds)
        self.seq_len = self.manifest.seq_len
        self.global_batch = t.micro_batch_size * t.grad_accum * self.world  # sequences per optimizer step
        self.tokens_per_step = self.global_batch * self.seq_len
        self.log_start()
        self.loader = self.train_loader()
        if tag is not None:
            tag = self.load_checkpoint(tag)
        self.commit()
        if tag is not None:
            log.info("resumed from %s at step %d", self.ckpt_root / tag, self.step)
        self.val = self.val_batches() if t.eval_every else None
        self.writer = MetricsWriter(self.out, self.rank, resume_step=self.step, world=self.world)
        self.closing.callback(self.writer.close)
        if self.rank == 0:
            self.wandb = WandbRun.open(self.out, self.cfg, self.ckpt_root / tag if tag is not None else None)
        if self.wandb is not None:
            self.writer.add_sink(self.wandb.log)
            self.closing.callback(self.wandb.finish)  # Trainer.close: before the writer closes
        self.writer.text("config", self.config_json)
        self.writer.text("deepspeed_config", json.dumps(self.ds, indent=2))
        self.throughput = Throughput(cfg.model, self.seq_len, self.peak * self.world)
        # the control vector's device-side inputs: set without a sync, read with the step's one sync
        self.stop_flag = torch.zeros((), dtype=torch.float64, device=self.comm)
        self.grad_norm_bad = torch.zeros((), dtype=torch.float64, device=self.comm)
        self.grad_norm: torch.Tensor | None = None
        self.grad_mask = GradientMask(self.engine.module) if t.grad_accum > 1 else None
        self.nan_faults = NanFaults(self.engine, NanInjection())
        self.delays = DelayInjection(self.engine, self.rank)
        self.data_digest = 0  # of the samples this rank read for the step (loader.sample_digest)
        self.watch_run()

    def watch_run(self) -> None:
        """What shows where the time goes (docs/training.md, "Watching a run"): the logged steps'
        breakdown, the slow-rank check (the hosts gathered once, a collective), the profiler window."""
        t = self.cfg.train
        self.timer = StepTimer(self.device, t.time_breakdown)
        hosts = gather_text(socket.gethostname(), 64)
        self.slow_ranks = SlowRanks(self.rank, hosts, t.slow_rank_factor, t.slow_rank_windows)
        self.data_starved_said = False
        self.capped_said: set[str] = set()  # mixture sources whose cap was said (mixture_scalars)
        self.stage_said = 0  # the mixture stage last said (mixture_scalars)
        self.spike_records = self.out / "spikes.jsonl"  # the micro-batches train.loss_spike_action=skip dropped
        self.step_spikes: list[dict[str, Any]] = []  # ... in the current step
        self.rollbacks: dict[str, int] = {}  # rollbacks to each checkpoint tag (train.loss_spike_action=rollback)
        if self.rank == 0:
            trim_records(self.spike_records, self.step)  # a resume rewrites those after its checkpoint
        window = profile_window(t.profile) if profiles(t.profile_ranks, self.rank) else None
        self.profiler = RunProfiler(window, self.out, self.rank, self.engine.module, t.memory_history)
        self.closing.callback(self.profiler.stop)

    def check_data_order(self, tag: str, cfg: RunConfig) -> None:
        """On resume, before any process group: the data must be the data the checkpoint saw."""
        state_path = self.ckpt_root / tag / "rank0_state.pt"
        if not state_path.is_file():
            raise UnreadableCheckpoint(tag, "rank0_state.pt is missing")
        try:
            saved = torch.load(state_path, weights_only=False).get("loader", {}).get("fingerprint")
        except Exception as err:  # torch reports a cut-off or corrupt file as RuntimeError, pickle errors, EOFError
            raise UnreadableCheckpoint(tag, f"rank0_state.pt is cut off or corrupt ({one_line(err)[:300]})") from None
        now = self.manifest.fingerprint("train")
        if saved is not None and saved != now and not allow_data_change(cfg):
            raise ConfigError(
                f"data={self.cfg.data!r}: the train split's shard list changed since checkpoint {tag} (fingerprint "
                f"{saved} -> {now}: shards added, removed, reordered or rewritten), so resuming would not continue "
                f"the same data order; restore the original manifest, or resume anyway with {_ALLOW_DATA_CHANGE_HINT}"
            )

    def lock_run_dir(self) -> None:
        """Rank 0 takes the run directory's lock (run_lock.py); every rank agrees on the
        outcome, so that a refusal stops them all (exit 2) before anything is written."""
        error = None
        if self.rank == 0:
            try:
                lock = run_lock.RunLock.acquire(self.out)
                self.lock = lock
                self.closing.callback(lock.release)
            except ConfigError as err:
                error = str(err)
        try:
            check_ranks(error, code=2)
        except RankFailed as failed:
            raise ConfigError(error or str(failed)) from None

    def load_checkpoint(self, checked: str) -> str:
        """Load the checkpoint to resume, `checked` (by preflight) or, where it cannot be loaded
        on every rank, an older complete one (agreed: checkpoint.load_agreed); its tag."""

        def passed_over(tag: str, why: str) -> None:
            self.passed_over.append(f"checkpoint {tag} cannot be loaded ({why})")

        tag, state = checkpoint.load_agreed(
            self.engine,
            self.ckpt_root,
            self.candidates,
            self.rank,
            self.world,
            precheck=lambda other: self.same_settings(other, checked),
            note=passed_over,
        )
        self.step = state["step"]
        self.loader.load_state_dict(state["loader"], strict=not allow_data_change(self.cfg))
        self.spikes.history = list(state.get("loss_history", []))  # a checkpoint from before it: a new history
        self.follow_data_skip(tag)
        if not state["rng_restored"]:
            written_by = checkpoint.ranks_that_wrote(self.ckpt_root / tag)
            streams = np.random.SeedSequence([self.cfg.train.seed, self.step, self.rank])
            torch.manual_seed(int(streams.generate_state(1)[0]))
            how = (
                f"through DeepSpeed's universal checkpoint ({universal.universal_dir(self.ckpt_root / tag)})"
                if self.engine.load_universal_checkpoint()
                else "(its ZeRO stage 0 state is whole on every rank)"
            )
            log.info(
                "checkpoint %s was written by %d rank(s), loaded on %d %s; the data order continues at global "
                "position %d; the per-rank random streams (training noise) start anew from (seed, step, rank)",
                tag,
                written_by,
                self.world,
                how,
                state["loader"].get("position", 0),
            )
        self.say_resume(tag)
        return tag

    def say_resume(self, tag: str) -> None:
        """What the resume from `tag` passed over and changes, said once it is sure (a refused
        resume says only why it is refused)."""
        for problem in self.passed_over:
            say(f"{problem}; resuming from the older complete checkpoint {tag}")
        for line in self.change_notes.get(tag, []):
            say(line)

    def check_files(self, checked: str) -> str:
        """`grt train --dry-run`: the load's checks of `load_checkpoint` in this one process
        (it reads every file): the tag a resume would load."""
        problems = []
        for tag in self.candidates:
            try:
                self.same_settings(tag, checked)
                problem = checkpoint.verify(self.ckpt_root, tag)
            except UnreadableCheckpoint as err:
                problem = err.problem
            if problem is None:
                return tag
            problems.append(f"{tag}: {problem}")
            self.passed_over.append(f"checkpoint {tag} cannot be loaded ({problem})")
        raise checkpoint.none_loadable(self.ckpt_root, problems)

    def same_settings(self, tag: str, checked: str) -> None:
        """A resume falling back from checkpoint `checked` to the older `tag`: the checks of
        `resume_checks`, and the same resulting config (the engine was built with it)."""
        if tag == checked:
            return
        root, world = self.ckpt_root, discover().world_size
        if universal.needs_universal(root / tag, world) != universal.needs_universal(root / checked, world):
            raise UnreadableCheckpoint(
                tag,
                f"it was written by {checkpoint.ranks_that_wrote(root / tag)} rank(s) and {checked} by "
                f"{checkpoint.ranks_that_wrote(root / checked)}: the engine was built to load {checked}'s way",
            )
        cfg = self.resume_checks(tag)
        if cfg.to_dict() != self.cfg.to_dict():
            raise ConfigError(
                f"resume: checkpoint {tag} (the newest that every rank can load) was trained with other settings than "
                f"{checked}; resume it with its own (--config-json {self.ckpt_root / tag / 'config.json'})"
            )

    def commit(self) -> None:
        """The start is good (the checkpoint loaded on every rank): from here the run writes
        into --out, first its config files and the log held so far (rank 0)."""
        self.config_json = json.dumps(self.cfg.to_dict(), indent=2) + "\n"
        if self.rank != 0:
            return
        if self.lock is not None:
            self.lock.commit()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.held_log is not None:
            log_to_file(self.held_log, self.out / "train.log")
            self.held_log = None
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

    def train_loader(self) -> TokenBatchLoader | MixtureLoader:
        """The training batches: one manifest's (data_pipeline/loader.py), or a mixture's drawn
        from its sources (data_pipeline/mixture.py); both in one global order whatever the ranks."""
        t = self.cfg.train
        if not isinstance(self.manifest, DataMixture):
            return self.data_loader(self.manifest, "train", global_batch=self.global_batch)
        return MixtureLoader(
            self.manifest,
            micro_batch_size=t.micro_batch_size,
            rank=self.rank,
            world_size=self.world,
            num_workers=t.num_workers,
            seed=t.seed,
            global_batch=self.global_batch,
            stages=self.stages,
            max_repeats=t.max_repeats,
            shuffle_buffer=t.shuffle_buffer,
            skip_corrupt=t.skip_corrupt_shards,
        )

    def data_loader(self, manifest: Manifest, split: str, **overrides: Any) -> TokenBatchLoader:
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
            expected_seq_len=manifest.seq_len,
        )
        return TokenBatchLoader(manifest, split=split, **{**options, **overrides})

    def val_batches(self) -> dict[str, list[Batch]] | None:
        """Each source's first train.eval_batches validation batches per rank ("" for a run on one
        manifest), read once: the batches `grt eval --data <that manifest>` scores."""
        sources = self.sources("val")
        if not sources:
            return None
        by_source = {}
        for name, manifest in sources:
            loader = self.data_loader(manifest, "val", num_workers=0, shuffle_buffer=0, loop=False)
            by_source[name] = list(itertools.islice(loader, self.cfg.train.eval_batches))
        return by_source

    # -- one optimizer step --------------------------------------------------------------
    def train_step(self, batches: Iterator[Batch], depth: int, log_now: bool) -> StepResult:
        """grad_accum good micro-batches (one with a non-finite loss on any rank is dropped on
        every rank and replaced by the next), then DeepSpeed's optimizer step.

        Each micro-batch's control vector (step_controls.py) is all-reduced on the device; the
        host reads the vectors not read yet once, after the forward of the micro-batch that
        completes the step if they are all good, before its backward: one host sync per step
        outside logging steps, whatever grad_accum is. The micro-batches before it run their
        backward unread, under `GradientMask`: a dropped one's gradients are zeroed on the
        device, so it adds nothing. A step that dropped one reads again for its replacements."""
        grad_accum = self.cfg.train.grad_accum
        tally, scalars = StepTally(), {}
        unread: list[torch.Tensor] = []  # the control vectors of the micro-batches run since the last read
        rounds: list[tuple[int, int]] = []  # the loader's (epoch, batch in epoch) after each of them
        timer, profiler = self.timer, self.profiler
        # the largest loss sum over the ranks a micro-batch may have (a spike's, train.loss_spike_action=skip)
        max_loss_sum = self.spikes.limit() * self.world if self.cfg.train.loss_spike_action != "log" else math.inf
        while tally.good < grad_accum:
            with timer.span("data", on_device=False), profiler.range("data"):
                batch = next(batches)
            rounds.append((self.loader.epoch, self.loader.batch_in_epoch))
            loss, gates = self.forward(batch, depth, log_now)
            unread.append(self.controls(loss))
            keep: torch.Tensor | None = None  # a micro-batch read before its backward needs no mask
            if tally.good + len(unread) < grad_accum:  # not the last one yet: its controls are read later
                keep = MicroBatchControls.kept(unread[-1], max_loss_sum)
            else:
                read, unread = MicroBatchControls.read(unread), []  # the step's host sync
                self.settle(read, depth, tally, max_loss_sum, rounds)
                rounds = []
                if read[-1].dropped or read[-1].loss_sum > max_loss_sum:  # this one too: dropped before its backward
                    continue
            self.backward(loss, keep, boundary=tally.good == grad_accum)
            if log_now and tally.good == grad_accum:  # the gradients are complete until engine.step() clears them
                scalars = self.gradient_scalars(gates)
            with timer.span("optimizer"), profiler.range("optimizer_step"):
                self.engine.step()
        self.record_grad_norm()
        if self.step_spikes and self.rank == 0:  # one record per step: trim_records keeps one per step
            with open(self.spike_records, "a") as f:
                f.write(json.dumps({"step": self.step + 1, "skipped": self.step_spikes}) + "\n")
        self.step_spikes = []
        return StepResult(tally.loss_sum / grad_accum, tally.stop_requested, {k: float(v) for k, v in scalars.items()})

    def forward(self, batch: Batch, depth: int, log_now: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The micro-batch's loss, and its gates on logging steps."""
        self.data_digest = (self.data_digest + sample_digest(batch["input_ids"])) % DIGEST_MOD  # on the host
        idx, targets, doc_ids = move(batch, self.device, self.cfg.train.doc_mask)
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
        depth: int,
        tally: StepTally,
        max_loss_sum: float,
        rounds: list[tuple[int, int]],
    ) -> None:
        """Account for the micro-batches just read, in order (`rounds`: the loader's position after
        each); raises TrainingStopped on a bad gradient norm or too many dropped micro-batches in a row."""
        for controls, (epoch, batch_in_epoch) in zip(read, rounds):
            if controls.grad_norm_bad:
                self.stop_on_bad_grad_norm()
            tally.stop_requested = tally.stop_requested or controls.stop_requested
            if controls.dropped:
                self.skip_bad_micro_batch(depth)
                continue
            if controls.loss_sum > max_loss_sum:
                if self.cfg.train.loss_spike_action == "rollback":
                    if checkpoint.find_latest(self.ckpt_root):
                        raise SpikeRollback()
                    if self.rank == 0:
                        log.warning("loss spike at step %d: no checkpoint yet to roll back to", self.step + 1)
                self.skip_spike(controls.loss_sum / self.world, max_loss_sum / self.world, epoch, batch_in_epoch)
                continue
            self.bad_in_a_row = 0
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

    def record_grad_norm(self) -> None:
        """The step's gradient norm, kept on the device: the next step's control vector checks
        it (or `check_grad_norm`)."""
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            self.grad_norm = torch.as_tensor(grad_norm, dtype=torch.float64).to(self.comm, non_blocking=True)
            self.grad_norm_bad = (~torch.isfinite(self.grad_norm)).double()

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

    def skip_spike(self, loss: float, limit: float, epoch: int, batch_in_epoch: int) -> None:
        """A micro-batch above the spike limit, dropped on every rank (train.loss_spike_action=skip):
        one line, and its samples (global positions in the epoch's order, rank r's share the r-th
        micro-batch of them) in <out>/spikes.jsonl; too many in a row stop the run."""
        t = self.cfg.train
        self.skipped_total += 1
        self.bad_in_a_row += 1
        width = self.world * t.micro_batch_size
        positions = [(batch_in_epoch - 1) * width, batch_in_epoch * width]
        if self.rank == 0:
            log.warning(
                "loss spike at step %d: a micro-batch's loss %.4f is above the limit %.4f (train.loss_spike_threshold"
                "=%g): skipped on every rank and replaced by the next (samples %d-%d of epoch %d, in %s)",
                self.step + 1,
                loss,
                limit,
                t.loss_spike_threshold,
                positions[0],
                positions[1] - 1,
                epoch,
                self.spike_records,
            )
        self.step_spikes.append({"loss": loss, "limit": limit, "epoch": epoch, "positions": positions})
        if self.bad_in_a_row >= t.max_bad_steps:
            raise TrainingStopped(
                f"{self.bad_in_a_row} micro-batches in a row dropped (loss spikes or non-finite losses) at step "
                f"{self.step + 1}: the loss level may have moved; train.loss_spike_action=log or a higher "
                f"train.loss_spike_threshold. The last good checkpoint is "
                f"{checkpoint.find_latest(self.ckpt_root) or 'none (no checkpoint yet)'}"
            )

    def roll_back(self) -> None:
        """train.loss_spike_action=rollback, on every rank: record that a resume from the last complete
        checkpoint continues the data where it is now (the window since the checkpoint, spike
        included, skipped), then load that checkpoint (model, optimizer, step, spike history, RNG)
        in this process and go on from it with the loader where it is."""
        tag = checkpoint.find_latest(self.ckpt_root)
        assert tag is not None  # settle raises SpikeRollback only when there is one
        spike_step, position = self.step + 1, self.loader.state_dict()
        self.rollbacks[tag] = self.rollbacks.get(tag, 0) + 1
        if self.rollbacks[tag] > self.cfg.train.max_bad_steps:
            raise TrainingStopped(
                f"loss spike at step {spike_step}: rolled back to checkpoint {tag} {self.rollbacks[tag] - 1} times "
                "already (train.max_bad_steps); the loss level may have moved: train.loss_spike_action=log or a "
                "higher train.loss_spike_threshold"
            )
        if self.rank == 0:
            skips = self.data_skips()
            skips[tag] = {"spike_step": spike_step, "loader": position}
            atomic_write_text(self.out / DATA_SKIPS, json.dumps(skips, indent=2) + "\n")
        self.step_spikes = []
        self.engine.zero_grad()  # the step's micro-batches backwarded before the spike add nothing
        state = checkpoint.load(self.engine, self.ckpt_root, tag, self.rank, self.world)
        self.step = state["step"]
        self.spikes.history = list(state.get("loss_history", []))
        self.writer.close()  # a writer that drops what the steps after the checkpoint wrote
        self.writer = MetricsWriter(self.out, self.rank, resume_step=self.step, world=self.world)
        if self.wandb is not None:
            self.writer.add_sink(self.wandb.log)
        self.throughput.reset()
        if self.rank == 0:
            log.warning(
                "loss spike at step %d: rolled back to checkpoint %s (step %d); the data since it is skipped, the "
                "loader goes on at global position %d of epoch %d (recorded in %s for a resume)",
                spike_step,
                tag,
                self.step,
                position["position"],
                position["epoch"],
                self.out / DATA_SKIPS,
            )

    def data_skips(self) -> dict[str, Any]:
        """<out>/data_skips.json: per checkpoint tag, where a resume from it takes the data (a rollback's)."""
        path = self.out / DATA_SKIPS
        return json.loads(path.read_text()) if path.is_file() else {}

    def follow_data_skip(self, tag: str) -> None:
        """A resume from a checkpoint that a rollback returned to continues the data where the rollback
        did, so that the window it skipped is not replayed."""
        skip = self.data_skips().get(tag)
        if skip is None:
            return
        self.loader.load_state_dict(skip["loader"], strict=not allow_data_change(self.cfg))
        log.info(
            "checkpoint %s was rolled back to after the loss spike at step %d: the data continues at global position "
            "%d of epoch %d, the window before it skipped (%s)",
            tag,
            skip["spike_step"],
            skip["loader"]["position"],
            skip["loader"]["epoch"],
            self.out / DATA_SKIPS,
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
        cfg, t, engine, heartbeat = self.cfg, self.cfg.train, self.engine, self.heartbeat
        assert heartbeat is not None  # build() started it
        max_r = cfg.model.max_loops
        batches = self.delays.batches(warn_on_skipped_shards(self.loader, self.rank))
        last_val, loss, stop_requested = {}, float("nan"), False  # a resume of a finished run trains no step
        engine.train()
        self.throughput.reset()
        while self.step < t.steps:
            depth = depth_for_step(t, max_r, self.step)
            log_now = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.steps
            heartbeat.step = self.step
            self.timer.start(log_now)
            try:
                with self.nan_faults.at_step(self.step), self.profiler.on_out_of_memory():
                    loss, stop_requested, scalars = self.train_step(batches, depth, log_now)
            except SpikeRollback:
                self.roll_back()
                continue
            seconds = self.timer.finish()
            self.profiler.step()
            self.step += 1
            self.throughput.add(self.tokens_per_step, depth)
            save_now = (
                (t.save_every and self.step % t.save_every == 0)
                or (t.save_final and self.step == t.steps)
                or stop_requested
            )
            if log_now:
                self.log_step(loss, depth, scalars, seconds)
            elif save_now:
                self.check_grad_norm()
            record = {"loss": loss, "depth": depth, "rss_mb": round(rss_mb(), 1), "data_digest": self.data_digest}
            if self.spikes.check(self.step, loss):
                record["loss_spike"] = True
                self.writer.scalars(self.step, {"train/loss_spike": 1.0})
            if self.val is not None and (self.step % t.eval_every == 0 or self.step == t.steps):
                last_val = self.validate(self.val, record)
            self.writer.step_record(self.step, record)
            self.data_digest = 0
            if self.tasks is not None and self.tasks.due(self.step, t.steps):
                self.score_tasks(self.tasks)
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
        if isinstance(self.loader, MixtureLoader):
            summary["tokens_by_source"] = self.loader.drawn_tokens()
            summary["sources_at_cap"] = dict(self.loader.exhausted)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def log_step(self, loss: float, depth: int, scalars: dict, seconds: dict[str, float]) -> None:
        """TensorBoard, metrics and the log line of a logging step; `seconds`: its time per span
        (StepTimer, {} with train.time_breakdown off), gathered over the ranks (a collective)."""
        t = self.cfg.train
        grad_norm = self.check_grad_norm()
        self.profiler.snapshot_if_asked(self.step)
        if seconds:
            scalars = {**scalars, **breakdown_scalars(seconds), **self.check_timing(seconds)}
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
            **self.mixture_scalars(),
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
            "peak mem %.0f MB | tokens %s | ETA %s%s",
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
            time_shares(seconds),
        )

    def mixture_scalars(self) -> dict[str, float]:
        """A mixture's realised draw: each source's training tokens so far and share of them
        (data/<source>/tokens, data/<source>/share); the sources that reached their cap said once."""
        if not isinstance(self.loader, MixtureLoader):
            return {}
        for name, g in self.loader.exhausted.items():
            if name not in self.capped_said:
                self.capped_said.add(name)
                log.warning(
                    "mixture source %r reached train.max_repeats=%g at global batch %d: it is not drawn from there, "
                    "its weight shared among the other sources",
                    name,
                    self.cfg.train.max_repeats,
                    g,
                )
        stage, start, weights = self.loader.stage()
        if stage != self.stage_said:
            self.stage_said = stage
            log.info(
                "mixture stage %d (train.data_stages) in force from global batch %d: weights %s",
                stage,
                start,
                " ".join(f"{n}={w:g}" for n, w in weights.items()),
            )
        drawn = self.loader.drawn_tokens()
        total = max(sum(drawn.values()), 1)
        values = {f"data/{n}/tokens": float(v) for n, v in drawn.items()}
        values.update({f"data/{n}/share": v / total for n, v in drawn.items()})
        values.update({f"data/{n}/at_cap": float(n in self.loader.exhausted) for n in drawn})
        values["data/stage"] = float(stage)
        return values

    def check_timing(self, seconds: dict[str, float]) -> dict[str, float]:
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
                self.step,
                seconds["data"],
                seconds["step"],
                t.data_starved_share,
                t.num_workers,
            )
        return self.slow_ranks.observe(seconds["data"] + seconds["forward"], self.step)

    def score_tasks(self, tasks: TaskEval) -> None:
        """The zero-shot tasks at this step (train.eval_tasks_every, task_eval.py), on every rank:
        TensorBoard tasks/<task>/<metric>_depth_<d>, <out>/tasks.jsonl, one log line with the cost."""
        scores = tasks.score(self.engine.module, self.step, self.rank, self.world, self.device)
        log.info("%s", tasks.report(scores, self.writer, self.out, self.rank))
        self.engine.train()
        self.throughput.reset()  # evaluation time is not training throughput

    def validate(self, batches: dict[str, list[Batch]], record: dict[str, Any]) -> dict[int, float]:
        """The validation loss at every exit depth: of each source (val/<source>/...) and, for a
        mixture, their mean under the mixture's weights (val/loss...), in TensorBoard and in the
        step's `record` (metrics.jsonl, under "val"). Returns the latter."""
        max_r = self.cfg.model.max_loops
        depths, doc_mask = list(range(max_r + 1)), self.cfg.train.doc_mask
        per_source = {n: evaluate_depths(self.engine, b, depths, self.device, doc_mask) for n, b in batches.items()}
        weights = self.manifest.weights if isinstance(self.manifest, DataMixture) else {"": 1.0}
        total = sum(weights[name] for name in per_source)
        by_depth = {k: sum(weights[n] * v[k] for n, v in per_source.items()) / total for k in depths}
        full = by_depth[max_r]
        values = {"val/loss": full, **{f"val/loss_depth_{k}": v for k, v in by_depth.items()}}
        for name, losses in per_source.items():
            if name:
                values[f"val/{name}/loss"] = losses[max_r]
                values.update({f"val/{name}/loss_depth_{k}": v for k, v in losses.items()})
        self.writer.scalars(self.step, values)
        record["val"] = values
        self.writer.scalars_by_tokens(self.step * self.tokens_per_step, {"val/loss": full})
        for name, losses in [*((n, v) for n, v in per_source.items() if n), ("", by_depth)]:
            log.info(
                "validation at step %d%s: loss %.4f at full depth; by exit depth: %s",
                self.step,
                f", source {name}" if name else (" (the mixture's weighted mean)" if len(per_source) > 1 else ""),
                losses[max_r],
                " ".join(f"{k}:{v:.3f}" for k, v in losses.items()),
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
                run_files=self.wandb.files() if self.wandb is not None else None,
                fit_state={"loss_history": self.spikes.history},
            )
        except checkpoint.CheckpointError as err:  # every rank agreed on it: stop cleanly, nothing half-written is used
            raise TrainingStopped(str(err)) from err

    def close(self) -> None:
        self.closing.close()


def dry_run(cfg: RunConfig, resume: bool = False) -> str:
    """`grt train --dry-run`: the run's checks (`Trainer.preflight`) and nothing else; one line
    saying what would train."""
    trainer = Trainer(cfg, resume)
    tag, ds = trainer.preflight()
    if tag is not None:
        tag = trainer.check_files(tag)
        trainer.say_resume(tag)
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
