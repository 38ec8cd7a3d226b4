"""A `grt train` command line as its run config: its flags (`build_parser`, also the launcher's
reading of the arguments it hands on), what they set (`CommandLine`: two flags that name one thing
differently refused), and the layers of settings they give (`layers`: the config the run goes on
from, read once where it was saved; the model; the --sets and flags), which config_layers.py
`build`s into the run config once.
Read by `grt train` and `grt launch` (entry.py); a branch's checkpoint is made by branch.py,
which describes decay branches."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from pretrain.distributed.discovery import discover
from pretrain.presets import PRESETS
from pretrain.runs import checkpoint_files, checkpoint_mirror
from pretrain.runs.config_layers import Layers, build
from pretrain.runs.run_config import DEFAULT_PRESET, RunConfig
from pretrain.say import say


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
    new_run: str | None = None  # a run of no --out (nor a config or checkpoint that names one): its name


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
    new_run = None
    if not (args.out or args.config_json or args.branch_from):
        new_run = run_name(args)
    return CommandLine(
        out=args.out,
        config_json=args.config_json,
        resume=args.resume,
        branch_from=args.branch_from,
        preset=args.preset,
        model_config=args.model_config,
        flags={key: (flag, values[key]) for flag, key in FLAG_KEYS if values[key] not in (None, "")},
        overrides=tuple(args.overrides),
        new_run=new_run,
    )


def run_name(args: argparse.Namespace) -> str:
    """The name of a run without --out, which gets its own directory (config_layers.py
    `fresh_run_dir`): its preset's, its model variant's (--set model.variant), its model config
    file's, or the default preset's."""
    if args.resume:
        raise ConfigError("--resume needs --out: the run directory to continue")
    world = discover().world_size
    if world > 1:
        raise ConfigError(
            f"--out: {world} ranks started without --out would each name their own run directory; give --out "
            "(grt launch names one for all its ranks)"
        )
    variants = [item.partition("=")[2] for item in args.overrides if item.partition("=")[0] == "model.variant"]
    return args.preset or (variants[-1] if variants else "") or Path(args.model_config or DEFAULT_PRESET).stem


def read_command_line(args: argparse.Namespace) -> RunConfig:
    """The run config of a `grt train` command line (`build_parser`'s), built once from its layers
    (config_layers.py `build`) and checked."""
    line = command_line(args)
    given = layers(line)
    cfg = build(given)
    cfg.validate()
    return cfg


def layers(line: CommandLine) -> Layers:
    """What `line`'s settings go onto, read once from where it was saved: --config-json's; for a run
    continued from what it saved (checkpoint_files.py `saved_run`, every read of it: a decay branch's
    source checkpoint's, a --resume's run directory's `config.json`, the run as it last started);
    else the defaults (a --resume of a directory that never started is a fresh start). The
    checkpoint to read is brought here from a mirror first (a --branch-from URL's; a --resume's where
    its mirror is newer than the local copy, or that is gone), after the refusal of an --out that is a
    checkpoint (`saved_run`)."""
    branch_from, fetch = line.branch_from, None
    if branch_from and checkpoint_mirror.is_mirror_url(branch_from):  # downloaded once, then a local checkpoint
        branch_from = str(checkpoint_mirror.local_copy(branch_from, "--branch-from "))
    elif line.resume and line.out and not line.config_json and not branch_from:
        given = [o.partition("=")[2] for o in line.overrides if o.partition("=")[0] == "train.checkpoint_mirror"]
        url = checkpoint_mirror.mirror_of_run(Path(line.out), given[-1] if given else None)
        if url:  # the mirror's newest complete checkpoint (and config.json) fetched into the run directory
            fetch = functools.partial(checkpoint_mirror.fetch_for_resume, url=url, say=say)
    model_given = bool(line.model_config or line.preset)
    saved = checkpoint_files.saved_run(
        line.out, branch_from, line.resume, config_json=line.config_json, model_given=model_given, fetch=fetch
    )
    return Layers(
        saved=saved,
        preset=line.preset,
        model_config=line.model_config,
        sets=line.overrides,
        flags=line.flags,
        continued=saved.source is not None or (line.resume and not line.config_json),
        new_run=line.new_run,
    )
