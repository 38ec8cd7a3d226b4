"""`grt train`: build the run config (preset or model JSON + overrides), check it, train.

Also the entry point that plain launchers start, as their users type them:
`deepspeed --num_gpus N --module pretrain.train ...`, `torchrun --nproc_per_node N pretrain/train.py ...`,
`python pretrain/train.py ...`. The launchers' own arguments are accepted: `--local_rank`,
and `--deepspeed [DS_JSON]` / `--deepspeed_config DS_JSON` as aliases of `--ds-config`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # run as a script path: import this checkout's package (not another installed copy), and
    # keep the package's own directory off sys.path (its modules would shadow top-level names)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pretrain.config import ConfigError, ModelConfig  # noqa: E402
from pretrain.distributed import discover, run_command  # noqa: E402
from pretrain.presets import PRESETS, get_preset  # noqa: E402
from pretrain.runs import checkpoint_files  # noqa: E402
from pretrain.runs.checkpoint_files import check_not_a_checkpoint  # noqa: E402
from pretrain.runs.data_spec import absolute, data_paths, load_manifest, with_data_paths  # noqa: E402
from pretrain.runs.run_config import RunConfig, apply_overrides, choose_model, is_model_override  # noqa: E402
from pretrain.runs.settings_rules import mark_given  # noqa: E402
from pretrain.training.start import branch  # noqa: E402


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


def base_config(args: argparse.Namespace, source: Path | None) -> RunConfig:
    """The run config the command line's settings go onto: --config-json's; for a run continued from
    what it saved, the config it saved (one mechanism, `branch.saved_config`): a decay branch's source
    checkpoint's, a --resume's run directory's `config.json` (the run as it last started; refused
    where its checkpoints are there without it); else the defaults (a --resume of a directory that
    never started is a fresh start). A saved config's relative `out` is the run it was saved in."""
    if args.out:
        check_not_a_checkpoint(Path(args.out))  # before any saved config is read as a run's
    if args.config_json:
        return branch.saved_where(RunConfig.load(args.config_json), Path(args.config_json))
    if source is not None:
        return branch.base_config(source, args.out)
    if args.resume and args.out:
        run = Path(args.out)
        if (run / "config.json").is_file():
            return branch.saved_config(run, "--resume")
        if checkpoint_files.tag_dirs(run / "checkpoints") and not (args.model_config or args.preset):
            raise ConfigError(
                f"--resume: {run / 'config.json'} is missing: {run} holds checkpoints but not the run's settings; "
                f"restore it, or resume with a checkpoint's own (--config-json {run}/checkpoints/<tag>/config.json)"
            )
    return RunConfig()


# the flags that set a run config key: a --set of the same key must agree (one setting, one value)
FLAG_KEYS = (
    ("--out", "out"),
    ("--data", "data"),
    ("--ds-config", "ds_config"),
    ("--steps", "train.steps"),
    ("--micro-batch-size", "train.micro_batch_size"),
    ("--grad-accum", "train.grad_accum"),
)


def flag_values(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """The run config keys the command line's flags set: key -> (flag, value)."""
    values = {
        "out": args.out,
        "data": ",".join(args.data) if args.data else None,  # the run config's one string (data_pipeline/mixture.py)
        "ds_config": args.ds_config or args.deepspeed,
        "train.steps": args.steps,
        "train.micro_batch_size": args.micro_batch_size,
        "train.grad_accum": args.grad_accum,
    }
    return {key: (flag, values[key]) for flag, key in FLAG_KEYS if values[key] not in (None, "")}


def _setting(cfg: RunConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(cfg.train if section == "train" else cfg, name)


def _same_value(key: str, a: Any, b: Any) -> bool:
    """Two values of one setting name the same thing: paths by the files they name."""
    if key == "out":
        return os.path.abspath(a) == os.path.abspath(b)
    if key == "data":
        return with_data_paths(a, absolute) == with_data_paths(b, absolute)
    if key == "ds_config":
        from pretrain.training.engine.ds_config import resolve_ds_path

        return os.path.abspath(resolve_ds_path(a)) == os.path.abspath(resolve_ds_path(b))
    return bool(a == b)


def set_flags(cfg: RunConfig, flags: dict[str, tuple[str, Any]], overrides: list[str]) -> None:
    """The flags' values into `cfg`, then the --sets; a --set of a flag's key that names another value
    is refused (before, the --set won without a word: `--set out=B` beside `--out A` trained in B)."""
    for key, (_, value) in flags.items():
        section, _, name = key.rpartition(".")
        setattr(cfg.train if section == "train" else cfg, name, value)
    apply_overrides(cfg, overrides)
    for item in overrides:
        key = item.split("=", 1)[0]
        if key in flags:
            flag, value = flags[key]
            if not _same_value(key, value, _setting(cfg, key)):
                raise ConfigError(
                    f"{flag} {value} and --set {item} disagree: one setting has one value; give one of them"
                )
            section, _, name = key.rpartition(".")
            setattr(cfg.train if section == "train" else cfg, name, value)


ONE_START_KEYS = ("allow_data_change", "allow_batch_change")  # a consent given for the start that gives it


def continued(cfg: RunConfig, given: set[str]) -> RunConfig:
    """A run continued from its saved config (`base_config`) with the keys `given` on the command
    line: a consent of an earlier start (train.allow_data_change, allow_batch_change) is not carried
    over, and a length given in steps replaces the saved budget in tokens."""
    for key in ONE_START_KEYS:
        if f"train.{key}" not in given:
            setattr(cfg.train, key, False)
    if "train.steps" in given and "train.tokens" not in given:
        cfg.train.tokens = 0.0
    return cfg


def run_name(args: argparse.Namespace, cfg: RunConfig) -> str:
    """A run without --out: its own directory, runs/<preset or variant>-<YYYYmmdd-HHMMSS>."""
    if args.resume:
        raise ConfigError("--resume needs --out: the run directory to continue")
    world = discover().world_size
    if world > 1:
        raise ConfigError(
            f"--out: {world} ranks started without --out would each name their own run directory; give --out "
            "(grt launch names one for all its ranks)"
        )
    stem = f"runs/{args.preset or cfg.model.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    name, n = stem, 1
    while os.path.exists(name):
        n += 1
        name = f"{stem}-{n}"
    return name


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config of a `grt train` command line: its base (`base_config`), then the model
    (--preset, --model-config, `model.*`), the flags and the `--set`s, in that order."""
    source = branch.find_source(args.branch_from, args.out) if args.branch_from else None
    cfg = base_config(args, source)
    if args.preset and args.model_config:
        raise ConfigError("give --preset or --model-config, not both")
    overrides = args.overrides
    if args.preset or args.model_config:
        model = get_preset(args.preset) if args.preset else ModelConfig.load(args.model_config)
        choose_model(cfg, model, overrides)  # the model, its overrides, then its training recipe
        overrides = [item for item in overrides if not is_model_override(item)]
    if args.ds_config and args.deepspeed and args.ds_config != args.deepspeed:
        raise ConfigError(
            f"--deepspeed {args.deepspeed} and --ds-config {args.ds_config} name different DeepSpeed files; give one"
        )
    flags = flag_values(args)
    set_flags(cfg, flags, overrides)
    given = {item.split("=", 1)[0] for item in args.overrides} | {k for k in flags if k.startswith("train.")}
    mark_given(cfg, given)  # the flags and the --sets (settings_rules.py)
    if source is not None or (args.resume and not args.config_json):
        continued(cfg, given)
    if source is not None:
        branch.configure(cfg, source, branch.given_train_keys(args))  # wsd, its length, branch_from
    callers_paths(cfg, {"data", "ds_config"} & (set(flags) | given))
    if not args.out and not args.config_json and source is None:
        cfg.out = run_name(args, cfg)  # said by the start's first line (StartPlan.start_lines)
    cfg.validate()
    return cfg


def callers_paths(cfg: RunConfig, keys: set[str]) -> None:
    """The files this command line names (`keys`: data, ds_config) that the run reads again later,
    resolved against the caller's working directory once, here (issue 41): the data's manifests
    and a DeepSpeed file found there, made absolute, so that the config.json the run saves (which
    a --resume, `grt export`'s run_config.json, `grt eval` and `grt analyze` read again, from any
    directory) names the same files. A shipped DeepSpeed file named by its name
    (ds_configs/zero3.json, found from any directory) and a URL stay as they are; so does --out,
    which only this command and its ranks (started in this directory) use, and so does a path of
    a saved config (a --resume's base): where it was relative to is not known here."""
    from pretrain.training.engine.ds_config import shipped_ds_file

    if "data" in keys and cfg.data:
        cfg.data = with_data_paths(cfg.data, absolute)
    # the caller's own file, which `resolve_ds_path` takes before a shipped one of that name
    if "ds_config" in keys and os.path.exists(cfg.ds_config) and not shipped_ds_file(cfg.ds_config):
        cfg.ds_config = absolute(cfg.ds_config)


def resolved_configs(cfg: RunConfig, resume: bool) -> tuple[RunConfig, dict[str, Any]]:
    """`--print-config` and `--print-ds-config`: the run config the run would write as its
    config.json (the start's plan: resolved against the data, a resume's kept schedule and batch)
    and its merged DeepSpeed config; where the data cannot be read here, the config as given
    (said in one line)."""
    import torch

    from pretrain.training.engine.ds_config import merged_ds_config
    from pretrain.training.start.plan import plan_start, say

    if cfg.data and all(os.path.isfile(p) for p in data_paths(cfg.data)):
        plan = plan_start(cfg, resume or bool(cfg.branch_from))
        for line in plan.start_lines():  # what the start changes: the vocabulary, a budget's steps
            say(line)
        return plan.cfg, plan.ds
    say(f"data={cfg.data!r} cannot be read here: the config as given, not resolved against the data")
    return cfg, merged_ds_config(cfg, discover().world_size, torch.cuda.is_available())


def printed_document(cfg: RunConfig, args: argparse.Namespace) -> str:
    """What --print-config, --print-ds-config and --dry-run print: the config.json or ds_config.json the
    run would write; a dry run first runs the trainer's checks and says what would train."""
    if not args.dry_run:
        from pretrain.training.engine.ds_config import ds_config_json

        resolved, ds = resolved_configs(cfg, args.resume)
        return resolved.to_json() if args.print_config else ds_config_json(ds)
    from pretrain.training.trainer import dry_run  # its plan loads (and checks) the manifest once

    summary, resolved = dry_run(cfg, resume=args.resume)
    print(f"grt train: dry run: {summary}", file=sys.stderr)
    return resolved.to_json()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    try:
        cfg = config_from_args(args)
        if args.print_config or args.print_ds_config or args.dry_run:
            # stdout is the document alone: what libraries print on the way (DeepSpeed's accelerator line) is not
            with contextlib.redirect_stdout(sys.stderr):
                document = printed_document(cfg, args)
            sys.stdout.write(document)
            return 0
        load_manifest(cfg.data)  # a missing, foreign or malformed manifest: one line before anything starts
    except ConfigError as err:
        print(f"grt train: error: {err}", file=sys.stderr)
        return 2
    from pretrain.training.trainer import TrainingStopped, train

    try:
        summary = train(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"grt train: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"grt train: stopped: {err}", file=sys.stderr)
        return 3
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, prog="grt train"))
