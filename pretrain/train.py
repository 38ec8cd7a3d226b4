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

if __name__ == "__main__" and not __package__:
    # run as a script path: import this checkout's package (not another installed copy), and
    # keep the package's own directory off sys.path (its modules would shadow top-level names)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from grt_common.errors import ConfigError  # noqa: E402
from pretrain.distributed import run_command  # noqa: E402
from pretrain.runs.run_config import RunConfig  # noqa: E402
from pretrain.training.start.command_line import build_parser, read_command_line  # noqa: E402


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config of a `grt train` command line, checked: the start's reading of it
    (pretrain/training/start/command_line.py), which `grt launch` shares."""
    return read_command_line(args)


def printed_document(cfg: RunConfig, args: argparse.Namespace) -> str:
    """What --print-config, --print-ds-config and --dry-run print: the config.json or ds_config.json the
    run would write; a dry run first runs the trainer's checks and says what would train."""
    if not args.dry_run:  # the start's plan where the data can be read here, else the config as given
        from pretrain.say import say
        from pretrain.training.engine.ds_config import ds_config_json
        from pretrain.training.start.entry import run_start

        started = run_start(cfg, args.resume, where="if readable")
        for line in started.start_lines():
            say(line)  # what the start changes: the vocabulary, a budget's steps
        return started.cfg.to_json() if args.print_config else ds_config_json(started.ds)
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
