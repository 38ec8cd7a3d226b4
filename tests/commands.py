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
    out: Path | str,
    steps: int,
    micro_batch_size: int,
    ds_config: str,
    sets: Iterable[str] = (),
    *extra: str,
) -> list[str]:
    """`grt train` arguments: `preset` on `data` into `out` for `steps` steps, each of `sets`
    as a `--set`, then `extra` as they are."""
    args = ["train", "--preset", preset, "--data", str(data), "--out", str(out), "--steps", str(steps)]
    args += ["--micro-batch-size", str(micro_batch_size), "--ds-config", ds_config]
    for s in sets:
        args += ["--set", s]
    return [*args, *extra]
