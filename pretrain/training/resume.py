"""What makes a run itself: its tokenizer, its model, its schedule and batch size.

`check_same_tokenizer` is shared by resume, `grt eval` and `grt generate`: data tokenised
with another tokenizer is refused, whatever the overrides. `check_resume` compares a run
config with the checkpoint it continues, before any process group exists and before the
run directory's config.json is rewritten, so a refused resume changes nothing.

The resume rule (docs/reliability.md, "Resuming with changed settings"):
- the tokenizer and every model key must be the checkpoint's (no override);
- the learning-rate schedule (lr, min_lr, warmup_steps, schedule_steps), the optimizer
  settings the checkpoint restores (betas, weight_decay) and the batch size
  (micro_batch_size, grad_accum, ranks) must be the checkpoint's: a change is refused;
- train.steps may change: the run stops at the new count and the schedule keeps the
  horizon it was started with (train.schedule_steps), so the learning rate goes on from
  where it was instead of jumping; past the horizon it stays at min_lr;
- any other key takes its new value.
Every change that is applied is said in one line on stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.config import ConfigError
from pretrain.training.run_config import RunConfig, load_manifest

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest

REFUSED_TRAIN_KEYS = (
    "lr",
    "min_lr",
    "warmup_steps",
    "schedule_steps",
    "betas",
    "weight_decay",
    "micro_batch_size",
    "grad_accum",
)


def check_same_tokenizer(
    data_sha256: str | None,
    data_vocab: int,
    data_what: str,
    model_sha256: str | None,
    model_vocab: int,
    model_what: str,
) -> None:
    """Refuse data made with another tokenizer than the model's (sha256 of tokenizer.model,
    where both are known), or whose vocabulary does not fit the model."""
    if data_sha256 and model_sha256 and data_sha256 != model_sha256:
        raise ConfigError(
            f"{data_what} was tokenised with tokenizer sha256 {data_sha256[:16]} (vocab {data_vocab}), "
            f"but {model_what} was trained with tokenizer sha256 {model_sha256[:16]} "
            f"(vocab {model_vocab}): a model cannot switch tokenizer (no override allows it); use data "
            "prepared with the model's tokenizer.model"
        )
    if data_vocab > model_vocab:
        raise ConfigError(
            f"{data_what} has a vocabulary of {data_vocab} tokens, more than the {model_vocab} of "
            f"{model_what}: its token ids do not fit the model"
        )


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}.{k}": v for k, v in d.items()}


def _as_json(cfg: RunConfig) -> dict[str, Any]:
    return json.loads(json.dumps(cfg.to_dict()))  # tuples as lists, as the checkpoint stores them


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def check_resume(
    cfg: RunConfig, ckpt_root: Path, tag: str | None, world_size: int | None = None, manifest: Manifest | None = None
) -> RunConfig:
    """Check `cfg` (resolved against the data) against checkpoint `tag` (None: a fresh start,
    nothing to check) for a run of `world_size` ranks (default: this process's launch);
    refuse by the rule above (ConfigError), or return cfg with the started schedule kept.
    `manifest`: cfg.data's, when the caller has loaded it already."""
    from data_pipeline.tokenizer import file_sha256
    from pretrain.distributed import discover

    if tag is None or not (ckpt_root / tag / "config.json").is_file():
        return cfg  # checkpoint.load explains a checkpoint without its config
    step_dir = ckpt_root / tag
    # through RunConfig: keys added since the checkpoint was written take their defaults
    saved = _as_json(RunConfig.from_dict(json.loads((step_dir / "config.json").read_text())))
    where = f"checkpoint {tag}"
    manifest = manifest or load_manifest(cfg.data)
    saved_tok = step_dir / "tokenizer.model"
    check_same_tokenizer(
        manifest.tokenizer_sha256,
        manifest.vocab_size,
        f"data={cfg.data!r}",
        file_sha256(str(saved_tok)) if saved_tok.is_file() else None,
        int(saved["model"]["vocab_size"]),
        where,
    )
    now = _as_json(cfg)
    model_changes = _changes(_flat("model", saved["model"]), _flat("model", now["model"]))
    if model_changes:
        raise ConfigError(
            f"resume: the model differs from {where}'s ({'; '.join(model_changes)}); a run keeps its "
            f"model: resume with the saved settings (--config-json {step_dir / 'config.json'}) or start "
            "a new run with another --out"
        )
    old_t = saved["train"]
    old_horizon = old_t["schedule_steps"] or old_t["steps"]
    if not cfg.train.schedule_steps and cfg.train.steps != old_horizon:
        cfg.train.schedule_steps = old_horizon  # keep the started schedule
    new_t = _as_json(cfg)["train"]
    old_vals = {f"train.{k}": old_t[k] for k in REFUSED_TRAIN_KEYS} | {"train.schedule_steps": old_horizon}
    new_vals = {f"train.{k}": new_t[k] for k in REFUSED_TRAIN_KEYS} | {
        "train.schedule_steps": new_t["schedule_steps"] or new_t["steps"]
    }
    refused = _changes(old_vals, new_vals)
    world = world_size or discover().world_size
    saved_ranks = len(list(step_dir.glob("rank*_state.pt")))
    if saved_ranks and saved_ranks != world:
        refused.append(f"ranks {saved_ranks} -> {world}")
    if refused:
        raise ConfigError(
            f"resume: {'; '.join(refused)} would change the schedule or batch size that {where} was "
            "trained with; resume with the started values (docs/reliability.md), or start a new run "
            "with another --out"
        )
    top = ("data", "ds_config", "out")
    applied = _changes(_flat("train", old_t), _flat("train", new_t)) + _changes(
        {k: saved[k] for k in top}, {k: now[k] for k in top}
    )
    if applied and discover().rank == 0:
        note = (
            f" (the learning-rate schedule keeps its {old_horizon}-step horizon)"
            if new_t["steps"] != old_t["steps"]
            else ""
        )
        print(f"grt train: resuming {where} with changes: {'; '.join(applied)}{note}", file=sys.stderr, flush=True)
    return cfg
