"""A `grt train` command line as its run config: its flags (`build_parser`, also the launcher's
reading of the arguments it hands on), then each setting read once, in one pass down: the
base its settings go onto (--config-json's; for a run continued from what it saved, that config:
a --resume's run directory's, a decay branch's source checkpoint's; else the defaults), the model
(--preset, --model-config, `model.*`), the flags and the `--set`s (one setting, one value; the
files they name resolved against the caller's directory, run_config.py), and a decay branch's
schedule and length.
Read by `grt train` and `grt launch` (entry.py); a branch's checkpoint is made by branch.py,
which describes decay branches."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from pretrain.model_config import ModelConfig
from pretrain.presets import PRESETS, get_preset
from pretrain.runs import checkpoint_files, checkpoint_mirror
from pretrain.runs.run_config import (
    RunConfig,
    choose_model,
    is_model_override,
    saved_config,
    set_flags,
)
from pretrain.runs.settings_rules import decay_steps, given_keys, mark_given, switch_defaults
from pretrain.runs.train_config import global_batch
from pretrain.say import say

ONE_START_KEYS = ("allow_data_change", "allow_batch_change")  # a consent given for the start that gives it


@dataclass(frozen=True)
class CommandLine:
    """What a `grt train` command line sets (`command_line`)."""

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grt train", description="Train a GRT or dense model with DeepSpeed.")
    p.add_argument(
        "--config-json", help="a complete run config (as saved in <out>/config.json); flags below override it"
    )
    p.add_argument("--preset", help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--model-config", help="model config JSON (instead of --preset)")
    p.add_argument(
        "--data",
        action="append",
        help="manifest.json written by `grt data prepare`; or a mixture, one source per flag: "
        "--data web=0.7:path/a/manifest.json --data books=0.3:path/b/manifest.json (docs/data.md)",
    )
    p.add_argument(
        "--ds-config",
        "--deepspeed_config",
        "--deepspeed-config",
        dest="ds_config",
        help="DeepSpeed JSON (default ds_configs/zero3.json, the shipped one from any directory); "
        'its batch sizes, optimizer, schedule, precision and clipping must be "auto" or agree '
        "with the run config (docs/launching.md)",
    )
    p.add_argument(
        "--deepspeed",
        nargs="?",
        const="",
        metavar="DS_JSON",
        help="accepted for Megatron/HF habits (DeepSpeed is always on); with a path, as --ds-config",
    )
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        dest="local_rank",
        help="set by the deepspeed launcher; ranks read LOCAL_RANK from the environment",
    )
    p.add_argument("--out", help="run directory: config, logs, TensorBoard, checkpoints")
    p.add_argument("--steps", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in --out, if any"
    )
    p.add_argument(
        "--branch-from",
        metavar="RUN_OR_CHECKPOINT",
        help="a decay branch: start the new run --out from this wsd run's newest complete checkpoint (or the "
        "checkpoints/stepNNNNNNNN given), its config as the base, and train its decay of train.decay_tokens; "
        "the source run is left untouched (implies --resume; docs/training.md)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. train.lr=3e-4, model.layout=2+4x4+2 (repeatable)",
    )
    only = p.add_mutually_exclusive_group()  # each prints one document on stdout
    only.add_argument(
        "--dry-run",
        action="store_true",
        help="check the run against its data, checkpoint and DeepSpeed config (everything checked before "
        "training starts, no process group), print the config.json it would write, and exit",
    )
    only.add_argument(
        "--print-config",
        action="store_true",
        help="print the config.json the run would write (resolved against the data) and exit",
    )
    only.add_argument(
        "--print-ds-config",
        action="store_true",
        help="print the ds_config.json the run would write (the DeepSpeed file merged for this rank count) and exit",
    )
    return p


# the flags that set a run config key: a --set of the same key must agree (one setting, one value)
FLAG_KEYS = (
    ("--out", "out"),
    ("--data", "data"),
    ("--ds-config", "ds_config"),
    ("--steps", "train.steps"),
    ("--micro-batch-size", "train.micro_batch_size"),
    ("--grad-accum", "train.grad_accum"),
)


def command_line(args: argparse.Namespace) -> CommandLine:
    """What the command line sets, read once: two flags that name one thing differently refused."""
    if args.preset and args.model_config:
        raise ConfigError("give --preset or --model-config, not both")
    if args.ds_config and args.deepspeed and args.ds_config != args.deepspeed:
        raise ConfigError(
            f"--deepspeed {args.deepspeed} and --ds-config {args.ds_config} name different DeepSpeed files; give one"
        )
    values = {
        "out": args.out,
        "data": ",".join(args.data) if args.data else None,  # the run config's one string (data_pipeline/mixture.py)
        "ds_config": args.ds_config or args.deepspeed,
        "train.steps": args.steps,
        "train.micro_batch_size": args.micro_batch_size,
        "train.grad_accum": args.grad_accum,
    }
    return CommandLine(
        out=args.out,
        config_json=args.config_json,
        resume=args.resume,
        branch_from=args.branch_from,
        preset=args.preset,
        model_config=args.model_config,
        flags={key: (flag, values[key]) for flag, key in FLAG_KEYS if values[key] not in (None, "")},
        overrides=tuple(args.overrides),
    )


def read_command_line(args: argparse.Namespace) -> RunConfig:
    """The run config of a `grt train` command line (`build_parser`'s), checked."""
    line = command_line(args)
    cfg = run_config(line)
    cfg.validate()
    return cfg


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
    switch_defaults(cfg)  # the defaults a switch it gave sets
    if base.source is not None or (line.resume and not line.config_json):
        continued(cfg, line.given)
    if base.source is None and not line.out and not line.config_json:
        cfg.out = new_run_dir(line.preset or cfg.model.variant, line.resume)  # said by the start's first line
    return branch(cfg, base)


def base_config(line: CommandLine) -> Base:
    """The run config the command line's settings go onto, read once from where it was saved
    (`saved_config`): --config-json's; for a run continued from what it saved, the config it saved
    (checkpoint_files.py `saved_run`, every read of it: a decay branch's source checkpoint's, a
    --resume's run directory's `config.json`, the run as it last started); else the defaults (a
    --resume of a directory that never started is a fresh start). Before any of it: an --out that is a
    checkpoint is refused, and the checkpoint to read is brought here from a mirror (a --branch-from
    URL's; a --resume's where its mirror is newer than the local copy, or that is gone)."""
    if line.out:
        checkpoint_files.check_not_a_checkpoint(Path(line.out))  # before any saved config is read as a run's
    branch_from = line.branch_from
    if branch_from:
        if checkpoint_mirror.is_mirror_url(branch_from):  # downloaded once, then a local checkpoint
            branch_from = str(checkpoint_mirror.local_copy(branch_from, "--branch-from "))
    elif line.resume and line.out and not line.config_json:
        run = Path(line.out)
        given = [o.partition("=")[2] for o in line.overrides if o.partition("=")[0] == "train.checkpoint_mirror"]
        mirror = checkpoint_mirror.mirror_of_run(run, given[-1] if given else None)
        if mirror:  # the mirror's newest complete checkpoint (and config.json) fetched into the run directory
            checkpoint_mirror.fetch_for_resume(run, mirror, say)
    model_given = bool(line.model_config or line.preset)
    saved = checkpoint_files.saved_run(
        line.out, branch_from, line.resume, config_given=bool(line.config_json), model_given=model_given
    )
    path = line.config_json or saved.path
    if path is None:
        return Base(RunConfig(), saved.source)
    cfg = saved_config(path, saved.config)
    return Base(cfg, saved.source, saved.step, global_batch(cfg.train, saved.ranks))  # a batch of the source's


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
