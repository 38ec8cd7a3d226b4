"""A `grt train` command line as its run config, each setting read once, in one pass down: the
base its settings go onto (--config-json's; for a run continued from what it saved, that config:
a --resume's run directory's, a decay branch's source checkpoint's; else the defaults), the model
(--preset, --model-config, `model.*`), the flags and the `--set`s (one setting, one value; the
files they name resolved against the caller's directory, run_config.py), and a decay branch's
schedule and length.
Read by `grt train` and, through it, `grt launch`; a branch's checkpoint is made by
pretrain/training/start/branch.py, which describes decay branches."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.model_config import ConfigError, ModelConfig
from pretrain.presets import get_preset
from pretrain.runs import checkpoint_files, checkpoint_mirror
from pretrain.runs.run_config import (
    RunConfig,
    choose_model,
    is_model_override,
    saved_config,
    saved_where,
    set_flags,
)
from pretrain.runs.settings_rules import decay_steps, given_keys, mark_given
from pretrain.runs.train_config import global_batch, optimizer_defaults
from pretrain.say import say

ONE_START_KEYS = ("allow_data_change", "allow_batch_change")  # a consent given for the start that gives it


@dataclass(frozen=True)
class CommandLine:
    """What a `grt train` command line sets (pretrain/train.py `command_line`)."""

    out: str | None = None
    config_json: str | None = None
    resume: bool = False
    branch_from: str | None = None
    preset: str | None = None
    model_config: str | None = None
    flags: dict[str, tuple[str, Any]] = field(default_factory=dict)  # run config key -> (its flag, value)
    overrides: tuple[str, ...] = ()  # the --sets, in order

    @property
    def given(self) -> frozenset[str]:
        """The keys it sets itself: its --sets' and its train flags' (settings_rules.py `mark_given`)."""
        sets = {item.split("=", 1)[0] for item in self.overrides}
        return frozenset(sets | {key for key in self.flags if key.startswith("train.")})


@dataclass(frozen=True)
class Base:
    """What a command line's settings go onto (`base_config`): a config, and for a decay branch the
    checkpoint it branches from, with its step and its global batch (sequences a step, which a
    resume keeps)."""

    cfg: RunConfig
    source: Path | None = None
    step: int = 0
    batch: int = 0


def run_config(line: CommandLine) -> RunConfig:
    """The run config of `line`: its base (`base_config`), then the model, the flags and the
    `--set`s, in that order, the caller's files made absolute; a continued run's (`continued`) and a
    decay branch's own settings (`branch`); a new run's directory named."""
    base = base_config(line)
    cfg = base.cfg
    overrides = list(line.overrides)
    if line.preset or line.model_config:
        model = get_preset(line.preset) if line.preset else ModelConfig.load(line.model_config or "")
        choose_model(cfg, model, overrides)  # the model, its overrides, then its training recipe
        overrides = [item for item in overrides if not is_model_override(item)]
    set_flags(cfg, line.flags, overrides)
    mark_given(cfg, set(line.given))
    optimizer_defaults(cfg.train, line.given)
    if base.source is not None or (line.resume and not line.config_json):
        continued(cfg, line.given)
    if base.source is None and not line.out and not line.config_json:
        cfg.out = new_run_dir(line.preset or cfg.model.variant, line.resume)  # said by the start's first line
    return branch(cfg, base)


def base_config(line: CommandLine) -> Base:
    """The run config the command line's settings go onto: --config-json's; for a run continued from
    what it saved, the config it saved (`saved_config`): a decay branch's source checkpoint's
    (`checkpoint_files.branch_source`; or, pruned there since, the branch's copy), a --resume's run
    directory's `config.json` (the run as it last started; refused where its checkpoints are there
    without it); else the defaults (a --resume of a directory that never started is a fresh start)."""
    if line.out:
        checkpoint_files.check_not_a_checkpoint(Path(line.out))  # before any saved config is read as a run's
    branch_from = line.branch_from
    if branch_from and checkpoint_mirror.is_mirror_url(branch_from):  # downloaded once, then a local checkpoint
        branch_from = str(checkpoint_mirror.local_copy(branch_from, "--branch-from "))
    source = checkpoint_files.branch_source(branch_from, line.out) if branch_from else None
    if line.config_json:
        return Base(saved_where(RunConfig.load(line.config_json), Path(line.config_json)), source)
    if source is not None:
        for tag_dir in (source, Path(line.out or "") / "checkpoints" / source.name):
            if (tag_dir / "COMPLETE").is_file():
                saved = saved_config(tag_dir, f"--branch-from {tag_dir}")
                ranks = checkpoint_files.ranks_that_wrote(tag_dir) or 1
                return Base(saved, source, checkpoint_files.step_of(source.name), global_batch(saved.train, ranks))
        raise ConfigError(f"--branch-from {source}: no complete checkpoint there")
    if line.resume and line.out:
        run = Path(line.out)
        given = [o.partition("=")[2] for o in line.overrides if o.partition("=")[0] == "train.checkpoint_mirror"]
        mirror = checkpoint_mirror.mirror_of_run(run, given[-1] if given else None)
        if mirror:  # the local copy gone or older: the mirror's newest complete checkpoint (and config.json)
            checkpoint_mirror.fetch_for_resume(run, mirror, say)
        if (run / "config.json").is_file():
            return Base(saved_config(run, "--resume"))
        if checkpoint_files.tag_dirs(run / "checkpoints") and not (line.model_config or line.preset):
            raise ConfigError(
                f"--resume: {run / 'config.json'} is missing: {run} holds checkpoints but not the run's settings; "
                f"restore it, or resume with a checkpoint's own (--config-json {run}/checkpoints/<tag>/config.json)"
            )
    return Base(RunConfig())


def continued(cfg: RunConfig, given: frozenset[str]) -> RunConfig:
    """A run continued from its saved config (`base_config`) with the keys `given` on the command
    line: a consent of an earlier start (train.allow_data_change, allow_batch_change) is not carried
    over, and a length given in steps replaces the saved budget in tokens."""
    for key in ONE_START_KEYS:
        if f"train.{key}" not in given:
            setattr(cfg.train, key, False)
    if "train.steps" in given and "train.tokens" not in given:
        cfg.train.tokens = 0.0
    return cfg


def branch(cfg: RunConfig, base: Base) -> RunConfig:
    """Make `cfg` (the source's config with the command line's changes) a decay branch's: wsd, its
    horizon its own length, that length (unless given) the checkpoint's step + the decay's steps
    (of the checkpoint's global batch of the data's sequences). Any other run's as it is."""
    source = base.source
    if source is None:
        return cfg
    given = {key.removeprefix("train.") for key in given_keys(cfg)}
    out, run = Path(cfg.out).resolve(), source.parent.parent
    if out == run or run in out.parents:
        raise ConfigError(
            f"--out {cfg.out}: a branch needs a new run directory, not {run} or a folder inside it "
            "(the source run's files stay untouched)"
        )
    if "schedule" in given and cfg.train.schedule != "wsd":
        raise ConfigError(f"train.schedule={cfg.train.schedule!r}: a decay branch trains the wsd schedule's decay")
    t = cfg.train
    t.schedule = "wsd"
    cfg.branch_from = str(source)
    if "schedule_steps" not in given:
        t.schedule_steps = 0  # the decay ends at the branch's own last step
    if given & {"steps", "tokens"}:
        return cfg
    if t.decay_tokens <= 0:
        raise ConfigError(
            f"--branch-from {source}: a decay branch needs its decay: --set train.decay_tokens=N (tokens), "
            "or its length (--steps, train.tokens)"
        )
    if t.allow_batch_change:
        raise ConfigError(
            "--branch-from with train.allow_batch_change: the decay's steps follow the global batch, which the "
            "ranks set; give the branch's length (--steps)"
        )
    t.steps = base.step + decay_steps(t.decay_tokens, base.batch * cfg.data_spec.load().seq_len)
    t.tokens = 0.0  # the length is train.steps (said by the resume's line, with the decay, once the start is sure)
    return cfg


def new_run_dir(name: str, resume: bool) -> str:
    """A run without --out: its own directory, runs/<name>-<YYYYmmdd-HHMMSS> (a preset's or variant's)."""
    from pretrain.distributed.discovery import discover

    if resume:
        raise ConfigError("--resume needs --out: the run directory to continue")
    world = discover().world_size
    if world > 1:
        raise ConfigError(
            f"--out: {world} ranks started without --out would each name their own run directory; give --out "
            "(grt launch names one for all its ranks)"
        )
    stem = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run, n = stem, 1
    while os.path.exists(run):
        n += 1
        run = f"{stem}-{n}"
    return run
