"""A `grt train` command line as its run config, each setting read once, in one pass down: the
base its settings go onto (--config-json's; for a run continued from what it saved, that config:
a --resume's run directory's, a decay branch's source checkpoint's; else the defaults), the model
(--preset, --model-config, `model.*`), the flags and the `--set`s (one setting, one value), the
files it names resolved against the caller's directory, and a decay branch's schedule and length.
Read by `grt train` and, through it, `grt launch`; a branch's checkpoint is made by
pretrain/training/start/branch.py, which describes decay branches."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError, ModelConfig
from pretrain.errors import UnreadableCheckpoint
from pretrain.presets import get_preset
from pretrain.runs import checkpoint_files
from pretrain.runs.data_spec import absolute, parse_data
from pretrain.runs.ds_file import resolve_ds_path, shipped_ds_file, shipped_ds_path
from pretrain.runs.run_config import RunConfig, apply_overrides, choose_model, is_model_override
from pretrain.runs.settings_rules import decay_steps, given_keys, mark_given
from pretrain.runs.train_config import tokens_per_step

ONE_START_KEYS = ("allow_data_change", "allow_batch_change")  # a consent given for the start that gives it
CALLERS_FILES = {"data", "ds_config"}  # the settings whose files the caller names (`callers_file`)


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


def run_config(line: CommandLine) -> RunConfig:
    """The run config of `line`: its base (`base_config`), then the model, the flags and the
    `--set`s, in that order, the caller's files made absolute; a new run's directory named; a
    continued run's (`continued`) and a decay branch's own settings (`branch`)."""
    source = branch_source(line.branch_from, line.out) if line.branch_from else None
    cfg = base_config(line, source)
    overrides = list(line.overrides)
    if line.preset or line.model_config:
        model = get_preset(line.preset) if line.preset else ModelConfig.load(line.model_config or "")
        choose_model(cfg, model, overrides)  # the model, its overrides, then its training recipe
        overrides = [item for item in overrides if not is_model_override(item)]
    set_flags(cfg, line.flags, overrides)
    if not line.out and not line.config_json and source is None:
        cfg.out = new_run_dir(line.preset or cfg.model.variant, line.resume)  # said by the start's first line
    mark_given(cfg, set(line.given))
    if source is not None or (line.resume and not line.config_json):
        continued(cfg, line.given)
    if source is not None:
        branch(cfg, source)
    return cfg


def branch_source(given: str, out: str | None) -> Path:
    """The checkpoint (absolute tag directory) `--branch-from given` names: a tag directory, a
    `checkpoints/` folder or a run directory (their newest complete checkpoint). Where `out`
    already is a branch of that run (its branch.json; a restart), the tag it was made from.
    ConfigError (one line) when there is none."""
    if not out:
        raise ConfigError("--branch-from needs --out: the branch's own, new run directory")
    p = Path(given).resolve()
    if checkpoint_files.TAG_RE.match(p.name) and p.is_dir():
        if not (p / "COMPLETE").is_file():
            raise ConfigError(f"--branch-from {given}: not a complete checkpoint (no COMPLETE marker)")
        tag_dir: Path | None = p
        root = p.parent
    else:
        root = p if p.name == "checkpoints" else p / "checkpoints"
        if not root.is_dir():
            raise ConfigError(
                f"--branch-from {given}: no run directory, checkpoints folder or checkpoint "
                "(a run directory holds checkpoints/stepNNNNNNNN)"
            )
        tag_dir = None
    recorded = checkpoint_files.read_json(Path(out) / checkpoint_files.BRANCH_FILE)
    if recorded is not None and Path(recorded.get("source_run", "")) == root.parent:
        made_from = Path(recorded.get("checkpoint", ""))
        if tag_dir is not None and tag_dir != made_from:
            raise ConfigError(
                f"--out {out} is a branch of {made_from} ({checkpoint_files.BRANCH_FILE}), not of {tag_dir}: "
                f"resume it with --branch-from {made_from}, or choose another --out"
            )
        return made_from
    if tag_dir is not None:
        return tag_dir
    latest = checkpoint_files.find_latest(root)
    if latest is None:
        raise ConfigError(f"--branch-from {given}: {root} holds no complete checkpoint")
    return root / latest


def base_config(line: CommandLine, source: Path | None) -> RunConfig:
    """The run config the command line's settings go onto: --config-json's; for a run continued from
    what it saved, the config it saved (`saved_config`): a decay branch's source checkpoint's (or,
    pruned there since, the branch's copy), a --resume's run directory's `config.json` (the run as
    it last started; refused where its checkpoints are there without it); else the defaults (a
    --resume of a directory that never started is a fresh start)."""
    if line.out:
        checkpoint_files.check_not_a_checkpoint(Path(line.out))  # before any saved config is read as a run's
    if line.config_json:
        return saved_where(RunConfig.load(line.config_json), Path(line.config_json))
    if source is not None:
        for tag_dir in (source, Path(line.out or "") / "checkpoints" / source.name):
            if (tag_dir / "COMPLETE").is_file():
                return saved_config(tag_dir, f"--branch-from {tag_dir}")
        raise ConfigError(f"--branch-from {source}: no complete checkpoint there")
    if line.resume and line.out:
        run = Path(line.out)
        if (run / "config.json").is_file():
            return saved_config(run, "--resume")
        if checkpoint_files.tag_dirs(run / "checkpoints") and not (line.model_config or line.preset):
            raise ConfigError(
                f"--resume: {run / 'config.json'} is missing: {run} holds checkpoints but not the run's settings; "
                f"restore it, or resume with a checkpoint's own (--config-json {run}/checkpoints/<tag>/config.json)"
            )
    return RunConfig()


def saved_config(folder: Path, where: str) -> RunConfig:
    """The run config a run saved in `folder` (a checkpoint's, or a run directory's `config.json`);
    `where` names it in the one line that refuses an unreadable one."""
    try:
        return saved_where(RunConfig.from_dict(checkpoint_files.read_config(folder)), folder / "config.json")
    except UnreadableCheckpoint as err:
        raise ConfigError(f"{where}: {folder / 'config.json'}: {err.problem}") from None


def saved_where(cfg: RunConfig, path: Path) -> RunConfig:
    """A run config read from the file `path`: where that is a run's own config.json (its run
    directory's, or one of its checkpoints'), a relative `out` in it names that run directory (it
    was relative to the directory the run was started from, not to this command's). A relative
    DeepSpeed file in any saved config is a shipped one by its name (the run made the caller's own
    absolute, `callers_file`): that file, whatever this directory holds of that name."""
    folder = Path(os.path.abspath(path)).parent
    run = folder.parent.parent if checkpoint_files.TAG_RE.match(folder.name) else folder
    if cfg.out and not os.path.isabs(cfg.out) and (run / "checkpoints").is_dir():
        cfg.out = str(run)
    shipped = shipped_ds_path(Path(cfg.ds_config))
    if shipped is not None and not (os.path.exists(cfg.ds_config) and os.path.samefile(cfg.ds_config, shipped)):
        cfg.ds_config = str(shipped)
    return cfg


def _setting(cfg: RunConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(cfg.train if section == "train" else cfg, name)


def _set(cfg: RunConfig, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    setattr(cfg.train if section == "train" else cfg, name, value)


def _same_value(key: str, a: Any, b: Any) -> bool:
    """Two values of one setting name the same thing: paths by the files they name."""
    if key == "out":
        return os.path.abspath(a) == os.path.abspath(b)
    if key == "ds_config":
        return os.path.abspath(resolve_ds_path(a)) == os.path.abspath(resolve_ds_path(b))
    return bool(a == b)  # the data: both the caller's, resolved alike (`callers_file`)


def set_flags(cfg: RunConfig, flags: dict[str, tuple[str, Any]], overrides: list[str]) -> None:
    """The --sets into `cfg`, then the flags' values, the files either names resolved against the
    caller's directory (`callers_file`); a --set of a flag's key that names another value is
    refused (before, the --set won without a word: `--set out=B` beside `--out A` trained in B)."""
    apply_overrides(cfg, overrides)
    sets = {item.split("=", 1)[0]: item for item in overrides}
    for key in CALLERS_FILES & set(sets) - set(flags):  # a file only a --set names
        _set(cfg, key, callers_file(key, _setting(cfg, key)))
    for key, (flag, given) in flags.items():
        value = callers_file(key, given)
        if key in sets and not _same_value(key, value, callers_file(key, _setting(cfg, key))):
            raise ConfigError(
                f"{flag} {given} and --set {sets[key]} disagree: one setting has one value; give one of them"
            )
        _set(cfg, key, value)


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


def branch(cfg: RunConfig, source: Path) -> RunConfig:
    """Make `cfg` (the source's config with the command line's changes) a decay branch's: wsd, its
    horizon its own length, that length (unless given) the checkpoint's step + the decay's steps
    (the checkpoint's global batch x the data's sequence length)."""
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
    per_step = _tokens_per_step(source, Path(cfg.out), cfg.data_spec.load().seq_len)
    t.steps = checkpoint_files.step_of(source.name) + decay_steps(t.decay_tokens, per_step)
    t.tokens = 0.0  # the length is train.steps (said by the resume's line, with the decay, once the start is sure)
    return cfg


def _tokens_per_step(source: Path, out: Path, seq_len: int) -> int:
    """The tokens per optimizer step of the source checkpoint's global batch (a resume keeps it): read
    from it, or, where the source has pruned it since, from the branch's own copy or newest checkpoint."""
    root = out / "checkpoints"
    newest = checkpoint_files.find_latest(root)
    for tag_dir in (source, root / source.name, *([root / newest] if newest else [])):
        if (tag_dir / "COMPLETE").is_file():
            saved = saved_config(tag_dir, f"--branch-from {tag_dir}")
            return tokens_per_step(saved.train, checkpoint_files.ranks_that_wrote(tag_dir) or 1, seq_len)
    raise ConfigError(f"--branch-from {source}: no complete checkpoint there")


def callers_file(key: str, value: Any) -> Any:
    """A file the command line names (`key` data or ds_config) that the run reads again later,
    resolved against the caller's working directory once, here (issue 41): the data's manifests
    and a DeepSpeed file found there, made absolute, so that the config.json the run saves (which
    a --resume, `grt export`'s run_config.json, `grt eval` and `grt analyze` read again, from any
    directory) names the same files. A shipped DeepSpeed file named by its name
    (ds_configs/zero3.json, found from any directory) and a URL stay as they are; so does --out,
    which only this command and its ranks (started in this directory) use, and so does a path of
    a saved config (a --resume's base): where it was relative to is not known here."""
    if key == "data" and value:
        return parse_data(value).with_paths(absolute)
    # the caller's own file, which `resolve_ds_path` takes before a shipped one of that name
    if key == "ds_config" and os.path.exists(value) and not shipped_ds_file(value):
        return absolute(value)
    return value


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
