"""The `grt` command lines the tests run, written once: a tokenizer and shards of a text
(`grt data tokenizer` + `grt data prepare`), and a short `grt train` run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def data_commands(
    text: Path | str, root: Path | str, vocab: int = 512, shard_mb: float = 0.1, *prepare_extra: str
) -> list[list[str]]:
    """The two commands that make <root>/tok.model and <root>/shards/manifest.json (seq 64,
    5% validation) from a paragraph-mode text file."""
    root = Path(root)
    return [
        ["data", "tokenizer", "-i", str(text), "--txt-mode", "paragraph", "--vocab-size", str(vocab)]
        + ["-o", str(root / "tok"), "-q"],
        ["data", "prepare", "-i", str(text), "--txt-mode", "paragraph", "-t", str(root / "tok.model")]
        + ["-o", str(root / "shards"), "--seq-len", "64", "--shard-size-mb", str(shard_mb), "--val-fraction", "0.05"]
        + [*prepare_extra, "-q"],
    ]


def manifest_of(root: Path | str) -> Path:
    """The manifest data_commands(..., root) writes."""
    return Path(root) / "shards" / "manifest.json"


def train_command(
    preset: str,
    data: Path | str,
    out: Path | str | None,
    steps: int | None,
    micro_batch_size: int | None,
    ds_config: str | None,
    sets: Iterable[str] = (),
    *extra: str,
    grad_accum: int | None = None,
) -> list[str]:
    """`grt train` arguments (the tests' one builder of them): `preset` on `data` into `out` for
    `steps` steps of `micro_batch_size` (`grad_accum` micro-batches each) under `ds_config`, each
    of `sets` as a `--set`, then `extra` as they are. A None leaves its flag out (the preset's
    value; no --out: a named run)."""
    flags = (
        ("--out", out),
        ("--steps", steps),
        ("--micro-batch-size", micro_batch_size),
        ("--grad-accum", grad_accum),
        ("--ds-config", ds_config),
    )
    args = ["train", "--preset", preset, "--data", str(data)]
    args += [x for flag, value in flags if value is not None for x in (flag, str(value))]
    for s in sets:
        args += ["--set", s]
    return [*args, *extra]


def resume_command(out: Path | str, *extra: str) -> list[str]:
    """`grt train --out <out> --resume`: a run continued from its directory alone, then `extra`."""
    return ["train", "--out", str(out), "--resume", *extra]


# what a refused or failed command prints besides its own lines: DeepSpeed's import-time
# accelerator notice, and a start's progress ("grt train: start: checks ...")
NOT_THE_COMMANDS = ("real_accelerator.py", ": start: ")


def error_lines(stderr: str, *also_not: str) -> list[str]:
    """The non-blank lines of `stderr` that the command itself says (NOT_THE_COMMANDS and any of
    `also_not` aside): what a "one line" refusal is counted on."""
    skip = NOT_THE_COMMANDS + also_not
    return [line for line in stderr.splitlines() if line.strip() and not any(s in line for s in skip)]


def grt_output(argv: list, capsys) -> tuple[int, str, str]:
    """`grt ARGV` in this process (pytest's `capsys` captures it): its exit code, stdout and stderr.
    An argparse exit is its code; anything else raised is a traceback and fails the test."""
    from pretrain import cli

    capsys.readouterr()
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as stop:
        rc = stop.code if isinstance(stop.code, int) else 2
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def grt_in_process(argv: list, capsys) -> tuple[int, str]:
    """`grt ARGV` in this process: its exit code and stderr (`grt_output`)."""
    rc, _, err = grt_output(argv, capsys)
    return rc, err
