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
from typing import Any

if __name__ == "__main__" and not __package__:
    # run as a script path: import this checkout's package (not another installed copy), and
    # keep the package's own directory off sys.path (its modules would shadow top-level names)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pretrain.distributed import discover, run_command  # noqa: E402
from pretrain.model_config import ConfigError  # noqa: E402
from pretrain.presets import PRESETS  # noqa: E402
from pretrain.runs.command_line import CommandLine, run_config  # noqa: E402
from pretrain.runs.run_config import RunConfig  # noqa: E402


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


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config of a `grt train` command line (pretrain/runs/command_line.py), checked."""
    line = command_line(args)
    cfg = run_config(line)
    cfg.validate()
    return cfg


def resolved_configs(cfg: RunConfig, resume: bool) -> tuple[RunConfig, dict[str, Any]]:
    """`--print-config` and `--print-ds-config`: the run config the run would write as its
    config.json (the start's plan: resolved against the data, a resume's kept schedule and batch)
    and its merged DeepSpeed config; where the data cannot be read here, the config as given
    (said in one line)."""
    import torch

    from pretrain.say import say
    from pretrain.training.engine.ds_config import merged_ds_config
    from pretrain.training.start.plan import plan_start

    if cfg.data and all(os.path.isfile(p) for p in cfg.data_spec.paths):
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
        cfg.data_spec.load()  # a missing, foreign or malformed manifest: one line before anything starts
    except ConfigError as err:
        print(f"grt train: error: {err}", file=sys.stderr)
        return 2
    from pretrain.training.trainer import train

    try:  # a stop with the last checkpoint intact (TrainingStopped) is the error boundary's: exit 3
        summary = train(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"grt train: error: {err}", file=sys.stderr)
        return 2
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    from pretrain.runs.trusted_files import forbid_code_in_files

    forbid_code_in_files()  # a rank's process: nothing it or DeepSpeed reads from a file runs
    sys.exit(run_command(main, prog="grt train"))
