"""The run config: one typed object (model + training), resolved once on the launching
host, saved as JSON in the run directory and in every checkpoint, and read back from there
(`saved_config`).

Overrides use dotted keys: `--set train.lr=3e-4 --set model.d_model=256`; the flags that set the
same keys go on after them (`set_flags`). Every key and type is checked before any process group
is created. The files a run config names (its data's manifests, its DeepSpeed file) are resolved
once, here, against the caller's directory (`callers_file`, `resolve_ds_path`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError
from pretrain import PROJECT_ROOT
from pretrain.model_config import ModelConfig, check_keys, coerce, load_json_object
from pretrain.presets import get_preset
from pretrain.runs import checkpoint_files
from pretrain.runs.data_spec import DataSpec, data_stages, parse_data
from pretrain.runs.eval_tasks import task_depths, task_names
from pretrain.runs.settings_rules import check_settings, given_keys
from pretrain.runs.train_config import TrainConfig, budget_steps, tokens_per_step, train_checks
from pretrain.variants import get_variant

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny-grt"))
    train: TrainConfig = field(default_factory=TrainConfig)
    data: str = ""  # manifest.json from `grt data prepare`
    ds_config: str = "ds_configs/zero3.json"
    out: str = "runs/default"
    branch_from: str = ""  # a decay branch: the checkpoint (tag directory) it starts from (--branch-from,
    # pretrain/training/start/branch.py); "" = none

    def validate(self) -> None:
        """Every value checked once, before anything starts: the first meaningless one is a
        ConfigError of one line naming the key, its value and what is accepted; then the rules of
        settings_rules.py (what each setting needs to take effect)."""
        self.model.validate()
        for ok, message in (*train_checks(self.train), *self._top_checks()):
            if not ok:
                raise ConfigError(message)
        sources = self.data_spec.sources  # a mixture that does not parse: one line now
        if sources is not None:
            data_stages(self.train.data_stages, [s.name for s in sources])  # stages that do not parse, too
        task_names(self.train.eval_tasks)
        task_depths(self.train.eval_tasks_depths, self.model)  # against the model's layout
        check_settings(self)

    @property
    def data_spec(self) -> DataSpec:
        """`data` parsed, once per value (parse_data): what every reader of the run's data uses."""
        return parse_data(self.data)

    def _top_checks(self) -> list[tuple[bool, str]]:
        return [
            (bool(self.data), "data: the manifest.json written by `grt data prepare` is required (--data)"),
            (bool(self.out), f"out={self.out!r}: the run directory is required (--out)"),
            (bool(self.ds_config), f"ds_config={self.ds_config!r}: a DeepSpeed JSON is required (--ds-config)"),
        ]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The bytes of the run's `config.json` (and of what `--print-config` and `--dry-run` print)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data)
        model = data.pop("model", None)
        train = data.pop("train", {})
        top = check_keys(cls, data, "run config")
        if isinstance(model, str):
            model_cfg = get_preset(model)
        elif model is None:
            model_cfg = get_preset("tiny-grt")
        else:
            model_cfg = ModelConfig.from_dict(model)
        # what the train section leaves out follows the model's recipe, then TrainConfig's defaults
        train = {**train_recipe(model_cfg), **train}
        train_cfg = TrainConfig(**check_keys(TrainConfig, _tuples(train), "train config"))
        return cls(model=model_cfg, train=train_cfg, **top)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(load_json_object(path, str(path)))


def train_recipe(model: ModelConfig) -> dict[str, Any]:
    """The training settings the model's method trains with (its Variant's recipe: depth sampling
    and its parameters), for the model as configured (Huginn's Poisson mean follows its R)."""
    return get_variant(model.variant).train_recipe(model)


def is_model_override(item: str) -> bool:
    return item.startswith("model.")


def choose_model(cfg: RunConfig, model: ModelConfig, overrides: list[str]) -> RunConfig:
    """Give the run `model`, in the one order every command follows: the model, its `model.*`
    overrides, the training recipe of the model so overridden, then (by the caller, last) the
    user's training settings, which win over the recipe."""
    cfg.model = model
    apply_overrides(cfg, [item for item in overrides if is_model_override(item)])
    return apply_recipe(cfg)


def apply_recipe(cfg: RunConfig) -> RunConfig:
    for key, value in train_recipe(cfg.model).items():
        setattr(cfg.train, key, value)
    return cfg


def apply_token_budget(cfg: RunConfig, world: int, seq_len: int, trained: tuple[int, int] = (0, 0)) -> str:
    """train.tokens sets train.steps: the `trained` (steps, tokens) of a resume's checkpoint, then the
    rest at the global batch on `world` ranks of `seq_len`-token samples (`budget_steps`), so that a
    changed global batch trains the budget. Returns the line that says so (empty without a budget)."""
    t = cfg.train
    if not t.tokens:
        return ""
    per_step = tokens_per_step(t, world, seq_len)
    done_steps, done = trained
    rest = budget_steps(t.tokens - done, per_step) if t.tokens > done else 0
    t.steps = done_steps + rest
    total = done + rest * per_step
    if done == done_steps * per_step:  # every step at this global batch
        return f"train.tokens={t.tokens:.4g}: {t.steps} steps of {per_step} tokens ({total:.4g} tokens)"
    return (
        f"train.tokens={t.tokens:.4g}: {t.steps} steps ({done_steps} trained, {done} tokens; then {rest} of "
        f"{per_step} tokens) ({total:.4g} tokens)"
    )


def resolve(
    cfg: RunConfig, manifest: Manifest | DataMixture | None = None, notes: list[str] | None = None
) -> RunConfig:
    """Checks that need the data: the model's vocabulary and context follow the tokenizer's; --out
    is empty, a run's, or holds only the run's own data (`check_run_output`). (The splits' sizes
    against the batch are the trainer's, which knows the ranks.) A vocabulary
    changed is said in one line, into `notes`; one the command line set itself is refused."""
    manifest = manifest or cfg.data_spec.load()
    old, new = cfg.model.vocab_size, manifest.vocab_size
    if old != new:
        if "model.vocab_size" in given_keys(cfg):
            raise ConfigError(
                f"model.vocab_size={old} (--set) is not the vocabulary of the data's tokenizer, {new} "
                f"(data={cfg.data!r}): the model's vocabulary follows the tokenizer; drop the --set, or "
                "prepare the data with a tokenizer of that size"
            )
        cfg.model.vocab_size = new
        if notes is not None:
            notes.append(f"model.vocab_size {old} -> {new}: the vocabulary of the data's tokenizer")
    if manifest.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"the shards' seq_len={manifest.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    cfg.validate()
    check_out(cfg)
    return cfg


def check_out(cfg: RunConfig) -> None:
    """--out is absent, empty, a run's, or holds only this run's own inputs (its data's manifests, its
    DeepSpeed file): `check_run_output`, before anything is read or written."""
    checkpoint_files.check_run_output(Path(cfg.out), [*cfg.data_spec.paths, cfg.ds_config])


def _tuples(train: dict) -> dict:
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in train.items()}


CALLERS_FILES = {"data", "ds_config"}  # the settings whose files the caller names (`callers_file`)


def _setting(cfg: RunConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(cfg.train if section == "train" else cfg, name)


def _set(cfg: RunConfig, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    setattr(cfg.train if section == "train" else cfg, name, value)


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
        if key in sets and not same_setting(key, value, callers_file(key, _setting(cfg, key))):
            raise flag_and_set_disagree(flag, given, sets[key])
        _set(cfg, key, value)


def flag_and_set_disagree(flag: str, given: Any, item: str) -> ConfigError:
    """The refusal of a flag and a --set of its key that name two values (`grt train`'s `set_flags`,
    `grt compare`): before, one of them won without a word."""
    return ConfigError(f"{flag} {given} and --set {item} disagree: one setting has one value; give one of them")


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.key=value` strings (sections: model, train; or a top-level key)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=3e-4")
        key, value = item.split("=", 1)
        section, _, name = key.rpartition(".")
        target: Any = {"": cfg, "model": cfg.model, "train": cfg.train}.get(section)
        if target is None:
            raise ConfigError(
                f"override {item!r}: unknown section {section!r}; accepted: model, train, or a top-level key"
            )
        fields = {f.name: f for f in dataclasses.fields(target)}
        if name not in fields or name in ("model", "train"):
            accepted = ", ".join(f for f in fields if f not in ("model", "train"))
            raise ConfigError(f"override {item!r}: unknown key {key!r}; accepted keys: {accepted}")
        parsed: Any
        if name == "betas":
            try:
                parsed = tuple(float(x) for x in value.strip("()[] ").split(","))
            except ValueError:
                raise ConfigError(f"{key}={value!r}: expected two numbers, e.g. {key}=0.9,0.95") from None
        elif name == "extra":
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{key}={value!r}: expected a JSON object ({err})") from None
        else:
            parsed = coerce(key, value, fields[name].type)
        setattr(target, name, parsed)
    cfg.model.validate()
    return cfg


# A run config read back from where a run saved it


def saved_config(path: str | Path, data: dict[str, Any] | None = None) -> RunConfig:
    """The run config saved in the file `path`, read where it was saved (`saved_where`): a --config-json,
    or a checkpoint's or run directory's `config.json` whose `data` is read already
    (checkpoint_files.py `saved_run`)."""
    return saved_where(RunConfig.load(path) if data is None else RunConfig.from_dict(data), Path(path))


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


# The files a run config names, resolved once against the caller's directory


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


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Two values of one setting name the same thing: paths by the files they name."""
    if key == "out":
        return os.path.abspath(a) == os.path.abspath(b)
    if key == "ds_config":
        return os.path.abspath(resolve_ds_path(a)) == os.path.abspath(resolve_ds_path(b))
    return bool(a == b)  # the data: both the caller's, resolved alike (`callers_file`)


def absolute(path: str) -> str:
    """A path made absolute against the working directory, so that every process reads the same file
    whatever its own (a URL as it is)."""
    return path if os.path.isabs(path) or "://" in path else os.path.abspath(path)


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
