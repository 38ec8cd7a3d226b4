"""The `grt` command: a thin dispatcher to each component's own `main(argv)`.

Subcommands are imported lazily so that `grt presets` does not pay for DeepSpeed,
and each component owns its argument parsing. Every command ends here, through
`pretrain.distributed.run_command`: a command that started a process group ends the
process through its one exit path, with the command's exit code, and every command has
its one error boundary there (a full disk, a path of the wrong kind, Ctrl-C: one line).
"""

import argparse
import importlib
import sys
from typing import NoReturn

COMMANDS = {
    "presets": ("pretrain.presets", "print the model presets"),
    "train": ("pretrain.train", "train a model with DeepSpeed"),
    "export": ("pretrain.infer.export", "consolidate a checkpoint into a standalone directory"),
    "eval": ("pretrain.infer.evaluation.evaluate", "evaluate a model at every exit depth"),
    "analyze": ("pretrain.infer.analyze.analysis", "the paper's analyses of a trained GRT"),
    "generate": ("pretrain.infer.generate", "sample text with a KV cache"),
    "lm-eval": ("pretrain.infer.evaluation.lm_eval_model", "lm-evaluation-harness with the grt model registered"),
    "compare": ("pretrain.tools.compare.cli", "train several methods at equal FLOPs and tabulate"),
    "demo": ("pretrain.tools.demo", "the main job: tokenizer, shards, training, evaluation"),
    "data": ("data_pipeline.cli", "tokenizer training and shard preparation"),
    "launch": ("launcher.cli", "start a run locally, with deepspeed, Slurm or MPI"),
    "hangs": ("pretrain.distributed.hangs", "which rank a hang dump (<out>/hangs/<time>) names, and where"),
    "bench": ("pretrain.tools.bench.cli", "benchmarks (data, train-step, memory, zero, decode, precision, loss)"),
}


def usage() -> str:
    lines = ["usage: grt <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def one_line_usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's error, as one line: the usage it prints first wraps over several lines."""
    parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")


def dispatch(argv: list[str] | None = None) -> int:
    # every subcommand's parser: patching the class is the point
    argparse.ArgumentParser.error = one_line_usage_error  # type: ignore[method-assign, assignment]
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"grt: unknown command {name!r} (commands: {', '.join(COMMANDS)}; see grt --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    """The `grt` entry point (also `python -m pretrain.cli`)."""
    from pretrain.distributed import run_command
    from pretrain.runs.trusted_files import forbid_code_in_files

    if argv is None:  # the process's own command line: nothing it or its children read from a file runs
        forbid_code_in_files()
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(dispatch, argv, prog=prog_of(argv))


def prog_of(argv: list[str]) -> str:
    """The name of the command `argv` runs, as its error lines say it: `grt train`, `grt data prepare`."""
    words = ["grt"]
    if argv and argv[0] in COMMANDS:
        words.append(argv[0])
        if argv[0] in ("data", "bench") and len(argv) > 1 and not argv[1].startswith("-"):  # their subcommand
            words.append(argv[1])
    return " ".join(words)


if __name__ == "__main__":
    sys.exit(main())
