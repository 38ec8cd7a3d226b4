"""A run config built once from where its settings come from (`Layers`: the config a run saved, the
command line's model, --sets and flags), for `grt train`'s command line (training/start/command_line.py);
the --set strings of any command (`parsed_sets`, `apply_overrides`); and the files a command line
names, resolved once against the caller's directory (`callers_ds_file`, `resolve_ds_path`).

Overrides use dotted keys: `--set train.lr=3e-4 --set model.d_model=256`; the flags that set the
same keys go on after them and may not name another value. Every key and type is checked before
any process group is created.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from pretrain import PROJECT_ROOT
from pretrain.model_config import ModelConfig, check_keys
from pretrain.presets import get_preset
from pretrain.runs import checkpoint_files
from pretrain.runs.checkpoint_files import SavedRun
from pretrain.runs.data_spec import callers_data
from pretrain.runs.run_config import DEFAULT_PRESET, RunConfig
from pretrain.runs.settings_rules import decay_branch, global_batch, mark_given, switch_defaults
from pretrain.runs.train_config import TrainConfig


class SettingGivenTwice(ConfigError):
    """A flag and a --set of its key that name two values (`grt train`, `grt compare`): before, one
    of them won without a word (`--set out=B` beside `--out A` trained in B)."""

    def __init__(self, flag: str, given: Any, item: str) -> None:
        super().__init__(f"{flag} {given} and --set {item} disagree: one setting has one value; give one of them")


@dataclass(frozen=True)
class Layers:
    """A run config's settings by where they come from, each over the ones before it: the config a
    run saved (`saved`, checkpoint_files.py `saved_run`; none: the defaults); the command line's
    model (`preset` or `model_config`; none: the saved one's) with its `model.*` --sets, then the
    training recipe of that model (under the saved training settings, over them where the command
    line chose the model); what a continued run does not carry over (`continued`); the --sets, in
    order; the flags (key -> (flag, value)). `new_run`: the name of a run of no --out, which gets its
    own directory. A decay branch (`saved.source`) then takes its schedule and length."""

    saved: SavedRun = field(default_factory=SavedRun)
    preset: str | None = None
    model_config: str | None = None
    sets: tuple[str, ...] = ()
    flags: dict[str, tuple[str, Any]] = field(default_factory=dict)
    continued: bool = False
    new_run: str | None = None

    @property
    def given(self) -> frozenset[str]:
        """The keys the command line sets itself: its --sets' and its train flags' (settings_rules.py
        `mark_given`)."""
        sets = {item.split("=", 1)[0] for item in self.sets}
        return frozenset(sets | {key for key in self.flags if key.startswith("train.")})


def build(layers: Layers) -> RunConfig:
    """The run config of `layers`, built once: their plain values merged, then typed and checked key
    by key (a value of the command line named by its dotted key), then what the command line's
    switches and a decay branch derive, and the caller's data made absolute (data_spec.py `callers_data`)."""
    saved = saved_where(layers.saved.config or {}, layers.saved.path)
    sets = parsed_sets(layers.sets)
    top = {key: value for key, value in saved.items() if key not in ("model", "train")}
    saved_train = dict(saved.get("train") or {})
    train = {**saved_train, **(continued(layers.given) if layers.continued else {})}
    data = command_line_files(top, sets, layers.flags)
    if layers.new_run:
        top["out"] = fresh_run_dir(layers.new_run)
    model_sets = {key.removeprefix("model."): value for key, value in sets.items() if key.startswith("model.")}
    base = saved.get("model")  # a preset's name or a model config, or none
    chosen = layers.preset or layers.model_config  # the command line's, which replaces it
    name = layers.preset or (base if isinstance(base, str) and not chosen else None)
    written = layers.model_config or (base if isinstance(base, dict) and not chosen else None)
    if name or not written:
        model = get_preset(name or DEFAULT_PRESET)
    else:
        model = ModelConfig.load(written) if isinstance(written, str) else ModelConfig.from_dict(written)
    model = model.replace(**check_keys(ModelConfig, model_sets, "model config", "model."))
    model.validate()
    recipe = model.train_recipe()  # the user's training settings win over it, and a saved config's (unless
    # the command line chose the model)
    settings = {**train, **recipe} if chosen else {**recipe, **train}
    settings.update({key.removeprefix("train."): value for key, value in sets.items() if key.startswith("train.")})
    typed = check_keys(TrainConfig, settings, "train config", "train.")  # a --set's value refused as itself
    for key, (flag, value) in layers.flags.items():  # then the train flags', which a --set may not contradict
        if key.startswith("train."):
            if key in sets and typed[key.removeprefix("train.")] != value:
                raise SettingGivenTwice(flag, value, f"{key}={sets[key]}")
            typed[key.removeprefix("train.")] = value
    cfg = RunConfig(model=model, train=TrainConfig(**typed), **check_keys(RunConfig, top, "run config"))
    mark_given(cfg, set(layers.given))
    switch_defaults(cfg)  # the defaults a switch the command line gave sets
    if (source := layers.saved.source) is not None:  # a decay branch's checkpoint, trained at its own global batch
        trained = TrainConfig(**check_keys(TrainConfig, saved_train, "train config", "train."))
        decay_branch(cfg, source, layers.saved.step, global_batch(trained, layers.saved.ranks))
    if data:  # the data the command line names: one setting, one value, its files the caller's
        data_flag, item = layers.flags.get("data", ("", None)), sets.get("data")
        named = callers_data([value for value in (data_flag[1], item) if value is not None])
        if len(set(named)) > 1:
            raise SettingGivenTwice(data_flag[0], data_flag[1], f"data={item}")
        cfg.data = named[0]
    return cfg


def parsed_sets(items: tuple[str, ...]) -> dict[str, Any]:
    """`section.key=value` strings (sections: model, train; or a top-level key) by dotted key, the
    last of a key winning: each key checked, values as given (typed by `build`), but train.betas'
    two numbers and an `extra` JSON object, which are read here."""
    sets: dict[str, Any] = {}
    sections = {"": RunConfig, "model": ModelConfig, "train": TrainConfig}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=3e-4")
        key, value = item.split("=", 1)
        section, _, name = key.rpartition(".")
        if section not in sections:
            raise ConfigError(
                f"override {item!r}: unknown section {section!r}; accepted: model, train, or a top-level key"
            )
        fields = [f.name for f in dataclasses.fields(sections[section]) if f.name not in ("model", "train")]
        if name not in fields:
            raise ConfigError(f"override {item!r}: unknown key {key!r}; accepted keys: {', '.join(fields)}")
        sets[key] = parsed_value(key, value)
    return sets


def parsed_value(key: str, value: str) -> Any:
    name = key.rpartition(".")[2]
    if name == "betas":
        try:
            return tuple(float(x) for x in value.strip("()[] ").split(","))
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected two numbers, e.g. {key}=0.9,0.95") from None
    if name == "extra":
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{key}={value!r}: expected a JSON object ({err})") from None
    return value


def continued(given: frozenset[str]) -> dict[str, Any]:
    """What a run continued from its saved config does not carry over, where the command line gives
    none of it: a consent of an earlier start (train.allow_data_change, allow_batch_change), and a
    budget in tokens where it gives a length in steps."""
    settings: dict[str, Any] = {key: False for key in ONE_START_KEYS if f"train.{key}" not in given}
    if "train.steps" in given and "train.tokens" not in given:
        settings["tokens"] = 0.0
    return settings


ONE_START_KEYS = ("allow_data_change", "allow_batch_change")  # a consent given for the start that gives it


def command_line_files(top: dict[str, Any], sets: dict[str, Any], flags: dict[str, tuple[str, Any]]) -> bool:
    """The top-level --sets, then the top-level flags, into `top`; a flag and a --set of its key that
    name two files refused (`SettingGivenTwice`); the DeepSpeed file either names resolved against the
    caller's directory (`callers_ds_file`). Whether the command line names the data (which `build`
    resolves last)."""
    for key, value in sets.items():
        if "." not in key:
            top[key] = callers_ds_file(value) if key == "ds_config" else value
    for key, (flag, value) in flags.items():
        if key in ("out", "ds_config") and key in sets and not same_setting(key, value, sets[key]):
            raise SettingGivenTwice(flag, value, f"{key}={sets[key]}")
        if not key.startswith("train."):
            top[key] = callers_ds_file(value) if key == "ds_config" else value
    return "data" in sets or "data" in flags


def fresh_run_dir(name: str) -> str:
    """A run without --out: its own directory, runs/<name>-<YYYYmmdd-HHMMSS> (a preset's, a model
    config file's or a variant's name)."""
    stem = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run, n = stem, 1
    while os.path.exists(run):
        n += 1
        run = f"{stem}-{n}"
    return run


def saved_where(saved: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """A run config as saved in the file `path`: where that is a run's own config.json (its run
    directory's, or one of its checkpoints'), a relative `out` in it names that run directory (it
    was relative to the directory the run was started from, not to this command's). A relative
    DeepSpeed file in any saved config is a shipped one by its name (the run made the caller's own
    absolute, `callers_ds_file`): that file, whatever this directory holds of that name."""
    if path is None:
        return saved
    saved = dict(saved)
    folder = Path(os.path.abspath(path)).parent
    run = folder.parent.parent if checkpoint_files.TAG_RE.match(folder.name) else folder
    out = saved.get("out")
    if isinstance(out, str) and out and not os.path.isabs(out) and (run / "checkpoints").is_dir():
        saved["out"] = str(run)
    ds = str(saved.get("ds_config") or "")
    shipped = shipped_ds_path(Path(ds)) if ds else None
    if shipped is not None and not (os.path.exists(ds) and os.path.samefile(ds, shipped)):
        saved["ds_config"] = str(shipped)
    return saved


# The --sets of a command into a run config it holds (`grt compare`)


def is_model_override(item: str) -> bool:
    return item.startswith("model.")


def choose_model(cfg: RunConfig, model: ModelConfig, overrides: list[str]) -> RunConfig:
    """Give the run `model`, in the one order every command follows: the model, its `model.*`
    overrides, the training recipe of the model so overridden, then (by the caller, last) the
    user's training settings, which win over the recipe (as `build` orders them)."""
    cfg.model = model
    apply_overrides(cfg, [item for item in overrides if is_model_override(item)])
    return apply_recipe(cfg)


def apply_recipe(cfg: RunConfig) -> RunConfig:
    for key, value in cfg.model.train_recipe().items():
        setattr(cfg.train, key, value)
    return cfg


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.key=value` strings (`parsed_sets`), each typed as `build` types them."""
    for key, value in parsed_sets(tuple(overrides)).items():
        section, _, name = key.rpartition(".")
        target: Any = {"": cfg, "model": cfg.model, "train": cfg.train}[section]
        setattr(target, name, check_keys(type(target), {name: value}, key, f"{section}." if section else "")[name])
    cfg.model.validate()
    return cfg


# The files a command line names, resolved once against the caller's directory


def callers_ds_file(value: str) -> str:
    """A DeepSpeed file the command line names, which the run reads again later, resolved against
    the caller's working directory once, here (issue 41): the caller's own file, which
    `resolve_ds_path` takes before a shipped one of that name, made absolute, so that the config.json
    the run saves (which a --resume, `grt export`'s run_config.json, `grt eval` and `grt analyze`
    read again, from any directory) names the same file. A shipped file named by its name
    (ds_configs/zero3.json, found from any directory) stays as it is. (The data's manifests alike:
    data_spec.py `callers_data`; --out, which only this command and its ranks, started in this
    directory, use, and a path of a saved config, where it was relative to is not known here, stay.)"""
    if os.path.exists(value) and not shipped_ds_file(value):
        return os.path.abspath(value)
    return value


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Two values of one setting name the same thing: paths by the files they name."""
    if key == "out":
        return os.path.abspath(a) == os.path.abspath(b)
    if key == "ds_config":
        return os.path.abspath(resolve_ds_path(a)) == os.path.abspath(resolve_ds_path(b))
    return bool(a == b)


SHIPPED_DIR = PROJECT_ROOT / "ds_configs"


def resolve_ds_path(path: str | Path) -> Path:
    """The DeepSpeed file `path` names: as given when it exists (or is absolute), else one of
    the shipped configs (`ds_configs/zero3.json` or `zero3.json`), whatever the working directory."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return shipped_ds_path(p) or p


def shipped_ds_path(path: Path) -> Path | None:
    """The shipped config a relative name finds from any directory (None: it names none)."""
    names = [] if path.is_absolute() else [base / path for base in (PROJECT_ROOT, SHIPPED_DIR)]
    return next((p for p in names if p.is_file()), None)


def shipped_ds_file(path: str | Path) -> bool:
    """Whether `path` names a shipped config by its shipped name (`ds_configs/zero3.json` from the
    checkout, `zero3.json` from ds_configs/): a name that finds it from any directory."""
    p = Path(path)
    if p.is_absolute() or not p.exists():
        return False
    return any((base / p).is_file() and (base / p).samefile(p) for base in (PROJECT_ROOT, SHIPPED_DIR))
