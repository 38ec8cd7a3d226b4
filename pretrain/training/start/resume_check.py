"""What makes a run itself: its tokenizer, its model, its schedule and batch size.

The tokenizer must be the checkpoint's (pretrain/runs/identity.py). `check_tag` compares a run
config with the checkpoint it continues, before any process group exists and before the
run directory's config.json is rewritten, so a refused resume changes nothing.

The resume rule (docs/reliability.md, "Resuming with changed settings"):
- the tokenizer and every model key must be the checkpoint's (no override);
- the learning-rate schedule (train.schedule, lr, min_lr, warmup_steps, schedule_steps),
  the optimizer and the settings the checkpoint restores (betas, weight_decay, muon_*) must be
  the checkpoint's: a change is refused (cosine -> wsd and wsd -> cosine included), except as
  below for a wsd run;
- the global batch (micro_batch_size x grad_accum x ranks) is kept on any number of ranks:
  grad_accum follows from it (`keep_global_batch`); a world size and micro-batch size that
  cannot split it is refused, naming the sizes that can, unless train.allow_batch_change;
- train.steps (and train.tokens) may change: the run stops at the new count and a cosine
  schedule keeps the horizon it was started with (train.schedule_steps), so the learning
  rate goes on from where it was instead of jumping; past the horizon it stays at min_lr;
- a wsd run (engine/lr_schedule.py) may also change where its decay is: train.steps/tokens (its
  length), train.decay_tokens, train.decay_shape and train.schedule_steps, as long as the
  learning rate at the checkpoint stays what it was (`keep_wsd_lr`): the decay is put at the
  end of the new length while it has not started at the checkpoint (a longer stable run; a
  decay added to end a stable run; a decay branch, branch.py, which is such a resume in a new
  run directory); once it has started, a new length keeps the started horizon as cosine's
  does; a change that would move the learning rate at the checkpoint is refused, naming both
  values;
- any other key takes its new value (the out dir and branch_from included).
`check_tag` changes nothing: it returns the settings the resume keeps and the one line that
says every change (`ResumeChanges`), which the start's plan applies once and says once it is sure.

A checkpoint whose own files cannot be read (its config.json cut off, its tokenizer
unreadable) is not a refusal: `check_tag` raises UnreadableCheckpoint, and the start's plan
(plan.py) checks the previous complete checkpoint instead, as the trainer's resume loads it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError
from pretrain.runs.checkpoint_files import UnreadableCheckpoint, ranks_that_wrote, read_config, step_of
from pretrain.runs.data_spec import parse_data
from pretrain.runs.identity import check_same_tokenizer
from pretrain.runs.run_config import RunConfig
from pretrain.runs.settings_rules import global_batch
from pretrain.runs.train_config import TrainConfig, kept_on_resume, tokens_per_step
from pretrain.training.engine.lr_schedule import Schedule

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture

REFUSED_TRAIN_KEYS = kept_on_resume()  # the fields declared `resume=KEPT` (train_config.py)
# a wsd run: schedule_steps may change (with train.steps, decay_tokens, decay_shape), checked by `keep_wsd_lr`
WSD_REFUSED_KEYS = tuple(k for k in REFUSED_TRAIN_KEYS if k != "schedule_steps")


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}.{k}": v for k, v in d.items()}


def _as_json(cfg: RunConfig) -> dict[str, Any]:
    return json.loads(json.dumps(cfg.to_dict()))  # tuples as lists, as the checkpoint stores them


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _real(path: str) -> str:
    return path if "://" in path else os.path.realpath(path)


def named_file(key: str, value: Any) -> Any:
    """A top-level path setting by what it resolves to (a DeepSpeed file by `resolve_ds_path`, the
    data's manifests, the run directories), so that one file named two ways is no change."""
    from pretrain.training.engine.ds_config import resolve_ds_path

    if not isinstance(value, str) or not value:
        return value
    if key == "ds_config":
        return _real(str(resolve_ds_path(value)))
    if key == "data":
        return parse_data(value).with_paths(_real)
    return _real(value)  # out, branch_from


def _path_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`_changes` of the top-level path settings, each compared by the file it names."""
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in sorted(old) if named_file(k, old[k]) != named_file(k, new[k])]


# DeepSpeed's checkpoint layouts by ZeRO stage: stages 1 and 2 write the same files
CHECKPOINT_FORMAT = {0: "ZeRO-0", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "ZeRO-3"}


def saved_zero_stage(step_dir: Path) -> int | None:
    """The ZeRO stage a checkpoint was written under, read from its file names (None: not known,
    e.g. bf16 ZeRO-0, which also writes bf16_zero_pp_* files)."""
    names = {p.name for p in step_dir.iterdir()}
    if any(re.fullmatch(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt", n) for n in names):
        return 3
    if any(re.fullmatch(r"zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt", n) for n in names):
        return 2
    if "mp_rank_00_model_states.pt" in names and not any(n.startswith("bf16_") for n in names):
        return 0
    return None


def _check_same_checkpoint_format(step_dir: Path, cfg: RunConfig, where: str) -> None:
    """Refuse, before any process group, a resume under a ZeRO stage whose checkpoint layout
    differs from the saved one (DeepSpeed's loader would fail with a traceback after start-up)."""
    from pretrain.training.engine.ds_config import load_ds_json, zero_stage

    old, new = saved_zero_stage(step_dir), zero_stage(load_ds_json(cfg.ds_config))
    if old is not None and CHECKPOINT_FORMAT[old] != CHECKPOINT_FORMAT.get(new):
        raise ConfigError(
            f"resume: {where} was written under ZeRO stage {old} and ds_config {cfg.ds_config!r} is stage {new}: "
            f"DeepSpeed cannot load a {CHECKPOINT_FORMAT[old]} checkpoint under {CHECKPOINT_FORMAT.get(new, new)}; "
            "resume with the checkpoint's DeepSpeed config, or start a new run with another --out"
        )


@dataclass(frozen=True)
class ResumeChanges:
    """What a resume from a checkpoint changes in the run config asked for: the train settings it
    keeps from the checkpoint (the started schedule's horizon, the global batch's grad_accum),
    applied once by the caller (`applied`), and the line that says every change (rank 0's; ""
    when there is none), said by the caller once the resume is sure."""

    train: dict[str, Any]
    line: str

    def applied(self, cfg: RunConfig) -> RunConfig:
        """A copy of `cfg` (the config asked for) with the settings the resume keeps."""
        resumed = copy.deepcopy(cfg)
        for key, value in self.train.items():
            setattr(resumed.train, key, value)
        return resumed


def check_tag(
    asked: RunConfig,
    ckpt_root: Path,
    tag: str,
    world_size: int | None = None,
    manifest: Manifest | DataMixture | None = None,
) -> ResumeChanges:
    """Check `asked` (resolved against the data) against checkpoint `tag` for a run of `world_size`
    ranks (default: this process's launch): refuse by the rule above (ConfigError), or return what
    the resume changes (the started schedule and global batch kept); UnreadableCheckpoint when the
    tag's config or tokenizer cannot be read. `asked` itself is not changed."""
    from pretrain.distributed import discover

    cfg = copy.deepcopy(asked)  # the settings kept are set on a copy, compared with `asked` at the end
    step_dir = ckpt_root / tag
    # through RunConfig: keys added since the checkpoint was written take their defaults
    saved_cfg = RunConfig.from_dict(read_config(step_dir))
    saved = _as_json(saved_cfg)
    where = f"checkpoint {tag}"
    manifest = manifest or cfg.data_spec.load()
    _check_same_run(cfg, saved, manifest, step_dir, tag)
    old_t = saved["train"]
    old_horizon = _keep_schedule(cfg, old_t, where)
    world = world_size or discover().world_size
    saved_world = ranks_that_wrote(step_dir) or world
    batch_note = keep_global_batch(cfg, old_t, saved_world, world, where)
    if cfg.train.schedule == "wsd":
        old_tokens = tokens_per_step(saved_cfg.train, saved_world, manifest.seq_len)
        new_tokens = tokens_per_step(cfg.train, world, manifest.seq_len)
        note = keep_wsd_lr(cfg.train, saved_cfg.train, step_of(tag), new_tokens, old_tokens, where)
    else:
        steps_changed = cfg.train.steps != old_t["steps"]
        note = f" (the learning-rate schedule keeps its {old_horizon}-step horizon)" if steps_changed else ""
    return _resume_changes(asked, cfg, saved, where, note + batch_note)


def _check_same_run(
    cfg: RunConfig, saved: dict[str, Any], manifest: Manifest | DataMixture, step_dir: Path, tag: str
) -> None:
    """What makes the run itself: the data's tokenizer, the model and the checkpoint's format are the checkpoint's."""
    from data_pipeline.tokenizer import file_sha256

    where = f"checkpoint {tag}"
    saved_tok = step_dir / "tokenizer.model"
    try:
        saved_sha = file_sha256(str(saved_tok)) if saved_tok.is_file() else None
    except OSError as err:
        raise UnreadableCheckpoint(tag, f"tokenizer.model cannot be read ({err.strerror})") from None
    check_same_tokenizer(
        manifest.tokenizer_sha256,
        manifest.vocab_size,
        f"data={cfg.data!r}",
        saved_sha,
        int(saved["model"]["vocab_size"]),
        where,
    )
    model_changes = _changes(_flat("model", saved["model"]), _flat("model", _as_json(cfg)["model"]))
    if model_changes:
        raise ConfigError(
            f"resume: the model differs from {where}'s ({'; '.join(model_changes)}); a run keeps its "
            f"model: resume with the saved settings (--config-json {step_dir / 'config.json'}) or start "
            "a new run with another --out"
        )
    _check_same_checkpoint_format(step_dir, cfg, where)


def _keep_schedule(cfg: RunConfig, old_t: dict[str, Any], where: str) -> int:
    """Refuse a change of the schedule, the optimizer or the seed; a cosine run keeps its started
    horizon (set into `cfg`). Returns that horizon."""
    old_horizon: int = old_t["schedule_steps"] or old_t["steps"]
    if old_t["schedule"] != cfg.train.schedule:
        raise ConfigError(
            f"resume: train.schedule {old_t['schedule']!r} -> {cfg.train.schedule!r} would change the schedule that "
            f"{where} was trained with (a decay branch needs a run trained with train.schedule=wsd, docs/training.md); "
            "resume with the started schedule, or start a new run with another --out"
        )
    wsd = cfg.train.schedule == "wsd"
    if not wsd and not cfg.train.schedule_steps and cfg.train.steps != old_horizon:
        cfg.train.schedule_steps = old_horizon  # keep the started schedule
    new_t = _as_json(cfg)["train"]
    keys = WSD_REFUSED_KEYS if wsd else REFUSED_TRAIN_KEYS
    old_vals = {f"train.{k}": old_t[k] for k in keys}
    new_vals = {f"train.{k}": new_t[k] for k in keys}
    if not wsd:
        old_vals["train.schedule_steps"] = old_horizon
        new_vals["train.schedule_steps"] = new_t["schedule_steps"] or new_t["steps"]
    refused = _changes(old_vals, new_vals)
    if refused:
        raise ConfigError(
            f"resume: {'; '.join(refused)} would change the schedule or optimizer that {where} was "
            "trained with; resume with the started values (docs/reliability.md), or start a new run "
            "with another --out"
        )
    if "seed" in old_t and old_t["seed"] != cfg.train.seed:  # the loader's order, depths and noise streams
        raise ConfigError(
            f"resume: train.seed {old_t['seed']} -> {cfg.train.seed} would apply only in part ({where}'s data order "
            "and random streams go on from the old seed, the depths would follow the new one); resume with "
            f"train.seed={old_t['seed']}, or start a new run with another --out"
        )
    return old_horizon


def _resume_changes(asked: RunConfig, cfg: RunConfig, saved: dict[str, Any], where: str, note: str) -> ResumeChanges:
    """The settings the resume keeps (those of `cfg` that differ from `asked`) and, on rank 0, the
    one line that says every change from the checkpoint's config `saved`, with `note` after it."""
    from pretrain.distributed import discover

    old_t, now = saved["train"], _as_json(cfg)
    top = ("data", "ds_config", "out", "branch_from")
    applied = _changes(_flat("train", old_t), _flat("train", now["train"])) + _path_changes(
        {k: saved[k] for k in top}, {k: now[k] for k in top}
    )
    if cfg.train.tokens:  # the steps follow the budget from the tokens trained: its own line says them (start/plan.py)
        applied = [change for change in applied if not change.startswith("train.steps ")]
    kept = {f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(cfg.train)}
    kept = {key: value for key, value in kept.items() if getattr(asked.train, key) != value}
    if not applied or discover().rank != 0:
        return ResumeChanges(kept, "")
    return ResumeChanges(kept, f"resuming {where} with changes: {'; '.join(applied)}{note}")


def keep_wsd_lr(
    train: TrainConfig, saved: TrainConfig, step: int, tokens_per_step: int, saved_tokens_per_step: int, where: str
) -> str:
    """A wsd run resumed at `step` (its scheduler at step - 1) with `train` instead of `saved`: where
    train.schedule_steps is 0 and train.steps changed, the horizon follows the new steps if that keeps
    the learning rate at the checkpoint (the decay had not started), else it keeps the started horizon
    (set into train.schedule_steps). Refused (ConfigError naming both rates): a schedule whose rate at
    the checkpoint differs from the saved one's. Returns the note of the resume's line."""
    at = step - 1
    old = Schedule.of(saved, saved_tokens_per_step)
    if not train.schedule_steps and train.steps != old.horizon:
        if Schedule.of(train, tokens_per_step).ratio(at) != old.ratio(at):
            train.schedule_steps = old.horizon  # the decay has begun: it ends where it was going to
    new = Schedule.of(train, tokens_per_step)
    if not math.isclose(new.ratio(at), old.ratio(at), rel_tol=1e-9):
        raise ConfigError(
            f"resume: the learning rate at {where} (step {step}) would jump {old.lr_at(at):.6g} -> "
            f"{new.lr_at(at):.6g}: "
            f"{where} was trained with {old.describe(saved_tokens_per_step)}, the new settings give "
            f"{new.describe(tokens_per_step)}; a wsd run may move its decay (train.steps, tokens, decay_tokens, "
            "decay_shape) only where it starts after the checkpoint: give more steps or fewer decay_tokens, or "
            "start a new run with another --out"
        )
    return f" (the learning rate goes on from {new.lr_at(at):.3g} at step {step}; {new.describe(tokens_per_step)})"


def _splits(global_batch: int, micro_batch: int, world: int) -> str:
    worlds = [w for w in range(1, global_batch // micro_batch + 1) if global_batch % (micro_batch * w) == 0]
    micros = [b for b in range(1, global_batch // world + 1) if global_batch % (b * world) == 0]
    return (
        f"world sizes that can, with micro-batch {micro_batch}: {', '.join(map(str, worlds)) or 'none'}; "
        f"micro-batch sizes that can, on {world} rank(s): {', '.join(map(str, micros)) or 'none'}"
    )


def keep_global_batch(cfg: RunConfig, saved: dict[str, Any], saved_world: int, world: int, where: str) -> str:
    """Set cfg.train.grad_accum so that the run's global batch is the checkpoint's on `world`
    ranks (`saved`: the checkpoint's train section, written by `saved_world` ranks); returns
    what that changes, for the resume's line (empty when nothing). Refused (ConfigError): a
    micro-batch size and world size that cannot split the global batch, or a grad_accum given
    that would change it; with train.allow_batch_change the given sizes are used as they are."""
    t = cfg.train
    old = dataclasses.replace(t, micro_batch_size=int(saved["micro_batch_size"]), grad_accum=int(saved["grad_accum"]))
    old_batch, new_batch = global_batch(old, saved_world), global_batch(t, world)
    how = f"micro-batch {saved['micro_batch_size']} x grad_accum {saved['grad_accum']} x {saved_world} rank(s)"
    if t.allow_batch_change:
        if old_batch == new_batch:
            return ""
        return f"; the global batch changes {old_batch} -> {new_batch} (train.allow_batch_change)"
    per_round = t.micro_batch_size * world
    if old_batch % per_round:
        raise ConfigError(
            f"resume: {where} was trained with a global batch of {old_batch} sequences ({how}), which {world} "
            f"rank(s) with train.micro_batch_size {t.micro_batch_size} cannot split into whole micro-batches; "
            f"{_splits(old_batch, t.micro_batch_size, world)}; or accept a changed batch with "
            "--set train.allow_batch_change=true"
        )
    keeps = old_batch // per_round
    if t.grad_accum not in (int(saved["grad_accum"]), keeps):
        raise ConfigError(
            f"resume: train.grad_accum {t.grad_accum} would change the global batch of {old_batch} sequences that "
            f"{where} was trained with ({how}); on {world} rank(s) with micro-batch {t.micro_batch_size} it is kept "
            f"by grad_accum {keeps} (the default on resume); or accept a changed batch with "
            "--set train.allow_batch_change=true"
        )
    t.grad_accum = keeps
    if world == saved_world:
        return ""
    return f"; on {world} rank(s) instead of {saved_world}, grad_accum {keeps} keeps the global batch of {old_batch}"
