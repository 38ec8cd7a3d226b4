"""The start of a run, checked once: `plan_start` computes a frozen `StartPlan`, or refuses.

The plan is every check that needs no process group: the data (resolved against the model),
that no live run holds --out, the checkpoint to resume (its tokenizer, model, schedule, global
batch and data order, the newest complete one that can be read), the token budget, the splits
against the batch, the mixture's stages against the repetition cap, the merged DeepSpeed config
and the checkpointing mode. `grt train` builds its Trainer from it, `--dry-run` prints it, a
decay branch not made yet (`--branch-from`) is planned against its source checkpoint, and
`grt launch` computes it on the launching host before any rank starts, each through the start's
one entry (entry.py). Computing it writes
nothing, prints nothing (its lines are said by the caller once the start is sure) and leaves
the given run config as it was: every refusal is a ConfigError of one line.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from data_pipeline.batches import TokenCount, plan_stages, with_split
from data_pipeline.mixture import MixtureError
from data_pipeline.remote import ranged_settings
from grt_common.errors import ConfigError
from pretrain.distributed import discover
from pretrain.runs import checkpoint_files
from pretrain.runs.checkpoint_files import UnreadableCheckpoint
from pretrain.runs.data_spec import parse_data
from pretrain.runs.run_config import RunConfig, apply_token_budget, resolve
from pretrain.runs.settings_rules import RunShape, check_settings, global_batch, start_notes
from pretrain.runs.train_config import tokens_per_step as step_tokens
from pretrain.runs.trusted_files import load_weights_only
from pretrain.training.checkpoint import store, universal
from pretrain.training.engine.ds_config import merged_ds_config, zero_stage
from pretrain.training.engine.parallelize import check_checkpointing
from pretrain.training.report.wandb_sink import check_available
from pretrain.training.start import branch, run_lock
from pretrain.training.start.memory_fit import check_fits
from pretrain.training.start.resume_check import check_tag
from pretrain.training.start.run_dir import check_run_paths

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture, Stage

ALLOW_DATA_CHANGE_HINT = "--set train.allow_data_change=true (or GRT_ALLOW_DATA_CHANGE=1 in the environment)"


def allow_data_change(cfg: RunConfig) -> bool:
    return cfg.train.allow_data_change or os.environ.get("GRT_ALLOW_DATA_CHANGE") == "1"


def restarted_by_agent() -> bool:
    """Whether torchrun's elastic agent runs this process and may restart it (the same answer on
    every node: TORCHELASTIC_MAX_RESTARTS is the job's)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def _count(items: list[str], what: str) -> str:
    return f"{len(items)} {what}{'' if len(items) == 1 else 's'}"


@dataclass(frozen=True)
class Resume:
    """What a resume loads: checkpoint `tag`, or where not every rank can load it, the newest of
    the older `candidates` that passes `check_fallback`."""

    tag: str
    candidates: tuple[str, ...]  # tag, then the older complete checkpoints
    saved_world: int  # the ranks that wrote it
    universal: bool  # written on another world size: loaded through DeepSpeed's universal checkpoint
    passed_over: tuple[str, ...]  # why each newer complete checkpoint was passed over
    notes: tuple[str, ...]  # the line of settings the resume changes
    trained: tuple[int, int] = (0, 0)  # the steps and tokens it trained (its saved count): the budget goes on from them


@dataclass(frozen=True)
class StartPlan:
    cfg: RunConfig  # what the run trains with: a resume's started schedule and global batch kept
    requested: RunConfig  # as given, resolved and its budget applied: what a fallback is checked against
    data: Manifest | DataMixture
    world: int
    global_batch: int  # sequences per optimizer step
    tokens_per_step: int
    budget: str  # the line of the steps train.tokens gives ("" without a budget)
    stages: tuple[Stage, ...]  # a mixture's train.data_stages
    ds: dict[str, Any]  # the merged DeepSpeed config
    resume: Resume | None  # None: a fresh start
    branch_source: Path | None  # a decay branch not made yet: the source checkpoint it was planned on
    restart_note: str  # a restart under torchrun's elastic agent that finds only its own interrupted save
    notes: tuple[str, ...] = ()  # what the start changes in the config given (the vocabulary the data's)

    @property
    def root(self) -> Path:
        """The run's checkpoints (a branch's, once `branch.prepared` has made it)."""
        return Path(self.cfg.out) / "checkpoints"

    def start_lines(self) -> list[str]:
        """What the start says before anything else: the run directory it writes and how it starts,
        a restart's interrupted save, what it changes in the config given, the budget's steps."""
        how = f"resuming {self.resume.tag}" if self.resume is not None else "a fresh start"
        if self.branch_source is not None:
            how = f"a decay branch of {self.branch_source}"
        first = f"start: run directory {os.path.abspath(self.cfg.out)}: {how}"  # a progress line (tests/commands.py)
        return [line for line in (first, self.restart_note, *self.notes, self.budget) if line]

    @property
    def nothing_to_do(self) -> str:
        """A resume whose checkpoint is at or past train.steps trains nothing: the one line that says
        so, and the run is left as it is (exit 0, pretrain/train.py); "" when there is a step to train."""
        if self.resume is None:
            return ""
        step, steps = checkpoint_files.step_of(self.resume.tag), self.cfg.train.steps
        if step < steps:
            return ""
        where = self.branch_source or Path(self.cfg.out)
        past = "" if step == steps else f" (train.steps={steps} is below the checkpoint's step)"
        return f"nothing to do: {where} is at step {step} of {steps}{past}; nothing was changed"

    def resume_lines(self, tag: str, passed_over: list[str], notes: tuple[str, ...]) -> list[str]:
        """What a resume from `tag` says once it is sure (a refused one says only why): the newer
        checkpoints it passed over (the plan's, then the load's), and the settings it changes."""
        assert self.resume is not None
        passed = [*self.resume.passed_over, *passed_over]
        return [f"{p}; resuming from the older complete checkpoint {tag}" for p in passed] + list(notes)


def plan_start(given: RunConfig, resume: bool, world: int | None = None, use_cuda: bool | None = None) -> StartPlan:
    """The plan of a run of `given` on `world` ranks (default: this launch's), resuming (`resume`,
    or a decay branch) from the newest complete checkpoint in --out; ConfigError refuses it."""
    cfg = copy.deepcopy(given)
    data = cfg.data_spec.load()  # loaded once: the loaders share it (the tokenizer hashed once)
    notes: list[str] = []
    resolve(cfg, data, notes)
    check_available(cfg)  # train.wandb=true without the wandb package
    try:
        ranged_settings()  # GRT_SHARD_* are read in the loader's workers: checked here
    except ValueError as err:
        raise ConfigError(str(err)) from None
    world = world or discover().world_size
    apply_token_budget(cfg, world, data.seq_len)  # the steps a resume is checked with
    requested = copy.deepcopy(cfg)
    run_lock.refuse_if_in_use(cfg.out)  # before any checkpoint is read: another run may be writing them
    check_run_paths(Path(cfg.out))  # a file where tb/ or checkpoints/ goes: refused now, not after the engine
    source, restart_note = branch.unmade_source(cfg), ""
    chosen: Resume | None
    if source is not None:
        cfg, chosen = _branch_resume(requested, data, source, world)
    else:
        cfg, chosen, restart_note = _choose_checkpoint(requested, data, resume or bool(cfg.branch_from), world)
    trained = chosen.trained if chosen is not None else (0, 0)
    budget = apply_token_budget(cfg, world, data.seq_len, trained)  # on the global batch kept, from the tokens trained
    check_split_sizes(cfg, data, world)
    t = cfg.train
    try:
        samples = trained[1] // data.seq_len + (t.steps - trained[0]) * global_batch(t, world)  # the run's, in all
        stages = plan_stages(data, t.data_stages, t.max_repeats, samples, cfg.data, global_batch(t, world))
    except MixtureError as err:
        raise ConfigError(str(err)) from None
    start_step = checkpoint_files.step_of(chosen.tag) if chosen is not None else 0
    check_settings(cfg, RunShape(world, step_tokens(t, world, data.seq_len), start_step))  # what must fit the run
    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    ds = checked_ds_config(cfg, world, cuda)
    if chosen is not None and chosen.universal:
        ds = universal.with_universal_load(ds)  # read when the engine is built
    check_fits(cfg.model, ds, world, cuda)  # before any engine is built: one line, not an allocation traceback
    return StartPlan(
        cfg=cfg,
        requested=requested,
        data=data,
        world=world,
        global_batch=global_batch(t, world),
        tokens_per_step=step_tokens(t, world, data.seq_len),
        budget=budget,
        stages=tuple(stages),
        ds=ds,
        resume=chosen,
        branch_source=source,
        restart_note=restart_note,
        notes=(*notes, *start_notes(cfg)),  # and the defaults that do not fit the run (settings_rules.py)
    )


def checked_ds_config(cfg: RunConfig, world: int, use_cuda: bool) -> dict[str, Any]:
    """The DeepSpeed config every rank builds (the run config merged with its file, engine/ds_config.py),
    with the activation checkpointing mode its ZeRO stage allows: a refusal is one line, here."""
    ds = merged_ds_config(cfg, world, use_cuda)
    check_checkpointing(cfg.train.activation_checkpointing, zero_stage(ds))
    return ds


def _resumed(
    requested: RunConfig, data: Manifest | DataMixture, root: Path, tag: str, world: int
) -> tuple[RunConfig, list[str], tuple[int, int]]:
    """The run config as requested, checked against checkpoint `tag` (its model, schedule, batch
    size, tokenizer and data order) and given its budget's steps from what it trained: ConfigError
    to refuse, UnreadableCheckpoint when the tag's own files cannot be read. With the line of its
    changes, and the steps and tokens it trained."""
    changes = check_tag(requested, root, tag, world, manifest=data)
    cfg, notes = changes.applied(requested), [changes.line] if changes.line else []
    state = check_data_order(cfg, data, root, tag)
    step, per_step = int(state.get("step", 0)), step_tokens(cfg.train, world, data.seq_len)
    trained = step, TokenCount.saved(state.get("tokens"), state.get("loader", {}), step, per_step, data.seq_len).total
    apply_token_budget(cfg, world, data.seq_len, trained)
    return cfg, notes, trained


def _resume(
    root: Path,
    tag: str,
    world: int,
    candidates: list[str],
    passed: list[str],
    notes: list[str],
    trained: tuple[int, int],
) -> Resume:
    return Resume(
        tag=tag,
        candidates=tuple(candidates),
        saved_world=checkpoint_files.ranks_that_wrote(root / tag) or world,
        universal=universal.needs_universal(root / tag, world),
        passed_over=tuple(passed),
        notes=tuple(notes),
        trained=trained,
    )


def _choose_checkpoint(
    requested: RunConfig, data: Manifest | DataMixture, resume: bool, world: int
) -> tuple[RunConfig, Resume | None, str]:
    """The checkpoint to resume (None: a fresh start): the newest complete one that can be read (a
    newer unreadable one is passed over), and the note of an elastic restart's fresh start. Refused:
    a start without --resume over checkpoints, a --resume over checkpoints of which none is
    complete, or none that can be read."""
    root = Path(requested.out) / "checkpoints"
    candidates, dirs = checkpoint_files.resume_candidates(root), checkpoint_files.tag_dirs(root)
    incomplete = [d for d in dirs if d not in checkpoint_files.complete_tags(root)]
    if not resume and candidates:
        raise ConfigError(
            f"{root} already holds checkpoint {candidates[0]}: pass --resume to continue it, or choose another --out"
        )
    if not candidates and incomplete and not (resume and restarted_by_agent()):
        raise ConfigError(
            f"{'--resume' if resume else '--out'}: {root} holds no complete checkpoint, only "
            f"{_count(incomplete, 'interrupted save')} ({', '.join(incomplete)}: no COMPLETE marker), so there is "
            "nothing to resume, and a start from step 0 would overwrite them: remove them (or the whole run "
            "directory) to start afresh, or choose another --out"
        )
    note = ""
    if not candidates and incomplete:
        note = (
            f"{root} holds only {_count(incomplete, 'interrupted save')} ({', '.join(incomplete)}), this job's own "
            "under torchrun's elastic agent (a restart after a failure in its first save): starting from step 0"
        )
    if not candidates:
        return copy.deepcopy(requested), None, note
    fallback = checkpoint_files.Fallback(root, candidates)

    def read(tag: str | None) -> tuple[RunConfig, Resume]:
        assert tag is not None
        cfg, notes, trained = _resumed(requested, data, root, tag, world)
        passed = [str(UnreadableCheckpoint(t, problem)) for t, problem in fallback.passed.items()]
        return cfg, _resume(root, tag, world, fallback.remaining, passed, notes, trained)

    cfg, chosen = fallback.first_usable(read, "read")
    return cfg, chosen, note


def _branch_resume(
    requested: RunConfig, data: Manifest | DataMixture, source: Path, world: int
) -> tuple[RunConfig, Resume]:
    """A decay branch not made yet: checked against its source checkpoint, which `branch.prepared`
    links into --out (the only candidate: a branch does not fall back to an older one)."""
    if not (source / "COMPLETE").is_file():
        raise ConfigError(f"branch_from={requested.branch_from!r}: no complete checkpoint there")
    cfg, notes, trained = _resumed(requested, data, source.parent, source.name, world)
    return cfg, _resume(source.parent, source.name, world, [source.name], [], notes, trained)


def check_data_order(cfg: RunConfig, data: Manifest | DataMixture, root: Path, tag: str) -> dict[str, Any]:
    """On resume: the data must be the data the checkpoint saw (its train split's shard list).
    Returns rank 0's saved state (its step, loader state and tokens trained)."""
    state_path = root / tag / "rank0_state.pt"
    if not state_path.is_file():
        raise UnreadableCheckpoint(tag, "rank0_state.pt is missing")
    state = load_weights_only(state_path, tag)  # data only: nothing in it runs
    try:
        saved = state.get("loader", {}).get("fingerprint")
    except AttributeError:
        raise UnreadableCheckpoint(tag, "rank0_state.pt holds no state of a rank") from None
    now = data.fingerprint("train")
    if saved is not None and saved != now and not allow_data_change(cfg):
        _refuse_reordered_sources(cfg, root, tag)
        raise ConfigError(
            f"data={cfg.data!r}: the train split's shard list changed since checkpoint {tag} (fingerprint "
            f"{saved} -> {now}: shards added, removed, reordered or rewritten), so resuming would not continue "
            f"the same data order; restore the original manifest, or resume anyway with {ALLOW_DATA_CHANGE_HINT}"
        )
    return state


def _refuse_reordered_sources(cfg: RunConfig, root: Path, tag: str) -> None:
    """A mixture given with the checkpoint's sources in another order: refused naming both orders (a
    mixture draws its sources in the order given, so the data order would change; data_pipeline/mixture.py)."""
    try:
        saved = parse_data(str(checkpoint_files.read_config(root / tag).get("data", ""))).sources
    except (ConfigError, UnreadableCheckpoint):
        return
    now = cfg.data_spec.sources
    if saved is None or now is None:
        return
    old, new = [s.name for s in saved], [s.name for s in now]
    if old != new and sorted(old) == sorted(new):
        raise ConfigError(
            f"data: the mixture's sources come in another order than at checkpoint {tag} ({', '.join(old)} -> "
            f"{', '.join(new)}; compared: the train split's shard list, source by source in order): a mixture draws "
            "its sources in the order given, so the data order would change; give the --data sources in the "
            f"checkpoint's order ({', '.join(old)})"
        )


def check_split_sizes(cfg: RunConfig, data: Manifest | DataMixture, world: int) -> None:
    """Training needs one global batch (every rank's micro-batches of a step), validation, when it
    runs, one micro-batch per rank: a smaller split gives a rank no batch (validation's mean over
    nothing would be reported as a loss of 0.0)."""
    t = cfg.train
    per_round = f"train.micro_batch_size {t.micro_batch_size} x {world} rank(s)"
    need = global_batch(t, world)
    have = data.sequences("train")
    if have < need:
        raise ConfigError(
            f"data={cfg.data!r}: the train split has {have} sequences, fewer than one global batch ({per_round} x "
            f"train.grad_accum {t.grad_accum}) = {need}: training would have no batch; use a smaller batch or "
            "prepare more data"
        )
    if not t.eval_every:
        return
    for source in with_split(data, "val"):
        have, need = source.manifest.sequences("val"), world * t.micro_batch_size
        if have < need:
            where = f"data={cfg.data!r}" + (f" source {source.name!r}" if source.name else "")
            raise ConfigError(
                f"{where}: the val split has {have} sequences, fewer than one micro-batch per rank ({per_round}) = "
                f"{need}: so validation (train.eval_every) would score nothing; prepare a larger validation split "
                "(grt data prepare --val-fraction), use a smaller train.micro_batch_size, or train without "
                "validation (--set train.eval_every=0)"
            )


def check_fallback(plan: StartPlan, tag: str) -> tuple[str, ...]:
    """A resume falling back from the planned checkpoint to the older `tag` (it cannot be loaded on
    every rank): the plan's checks of it, and the same resulting config (the engine was built with
    the plan's). Returns the line of its changes; ConfigError refuses, UnreadableCheckpoint passes over it."""
    assert plan.resume is not None
    checked = plan.resume.tag
    if tag == checked:
        return plan.resume.notes
    root = plan.root
    if universal.needs_universal(root / tag, plan.world) != plan.resume.universal:
        raise UnreadableCheckpoint(
            tag,
            f"it was written by {checkpoint_files.ranks_that_wrote(root / tag)} rank(s) and {checked} by "
            f"{plan.resume.saved_world}: the engine was built to load {checked}'s way",
        )
    cfg, notes, _ = _resumed(plan.requested, plan.data, root, tag, plan.world)
    if cfg.to_dict() != plan.cfg.to_dict():
        raise ConfigError(
            f"resume: checkpoint {tag} (the newest that every rank can load) was trained with other settings than "
            f"{checked}; resume it with its own (--config-json {root / tag / 'config.json'})"
        )
    return tuple(notes)


def check_files(plan: StartPlan) -> tuple[str, list[str]]:
    """`grt train --dry-run`: the load's checks in this one process (it reads every file of the
    checkpoint): the tag a resume would load, and the lines its resume would say."""
    assert plan.resume is not None
    root = plan.branch_source.parent if plan.branch_source is not None else plan.root
    fallback = checkpoint_files.Fallback(root, plan.resume.candidates)

    def load(tag: str | None) -> tuple[str, list[str]]:
        assert tag is not None
        notes = check_fallback(plan, tag)
        problem = store.verify(root, tag)
        if problem is not None:
            raise UnreadableCheckpoint(tag, problem)
        return tag, plan.resume_lines(tag, fallback.unloadable(), notes)

    return fallback.first_usable(load, "loaded")


def check_shards(plan: StartPlan) -> int:
    """`grt train --dry-run`: every shard the run reads (train and validation, every source) exists
    or answers, and is the one its manifest lists (its size and first member); one line refuses the
    first that is not. Returns how many were checked."""
    from data_pipeline.shard_reader import check_manifest_shards
    from data_pipeline.shards import ShardError

    splits = ("train", "val") if plan.cfg.train.eval_every else ("train",)
    try:
        return sum(check_manifest_shards(source.manifest, splits) for source in with_split(plan.data, "train"))
    except ShardError as err:
        raise ConfigError(f"data={plan.cfg.data!r}: {err}") from None
