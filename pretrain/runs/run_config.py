"""The run config: one typed object (model + training), resolved once on the launching
host, saved as JSON in the run directory and in every checkpoint, and read back from there
(`RunConfig.load`; a command line's config is built by config_layers.py).

Every key and type is checked before any process group is created (`validate`); the checks that
need the data are `resolve`'s.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError
from pretrain.model_config import ModelConfig, check_keys, load_json_object
from pretrain.presets import get_preset
from pretrain.runs import checkpoint_files
from pretrain.runs.data_spec import DataSpec, data_stages, parse_data
from pretrain.runs.eval_tasks import task_depths, task_names
from pretrain.runs.settings_rules import check_settings, given_keys
from pretrain.runs.train_checks import train_checks
from pretrain.runs.train_config import TrainConfig, budget_steps, tokens_per_step

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture


DEFAULT_PRESET = "tiny-grt"  # the model of a run config that names none


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset(DEFAULT_PRESET))
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
        model_cfg = ModelConfig.from_dict(model) if isinstance(model, dict) else get_preset(model or DEFAULT_PRESET)
        # what the train section leaves out follows the model's recipe, then TrainConfig's defaults
        train_cfg = TrainConfig(**check_keys(TrainConfig, {**model_cfg.train_recipe(), **train}, "train config"))
        return cls(model=model_cfg, train=train_cfg, **top)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(load_json_object(path, str(path)))


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
