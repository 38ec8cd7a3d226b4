"""A prepare that spans machines: ``grt data prepare --part i/N`` tokenises its share of the input
files into ``OUT/part-0000i-of-0000N/`` (a complete prepare of its own), and ``grt data join OUT``
writes ``OUT/manifest.json`` over every part's shards.

The input files (sorted, as for one prepare; ``--val-input`` files after the others) are cut into
N contiguous runs of as equal a count as may be: part i takes run i, so the parts' documents,
concatenated in part order, are the one-part prepare's in the same order, and every document gets
the split one prepare gives it (the split depends on its content and the seed only). Each part
packs its own token stream, so a part boundary drops one part's tail (< seq_len + 1 tokens per
split) where one prepare would carry it over.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grt_common.files import FolderLock, atomic_write_text

from .manifest import MANIFEST_NAME, Manifest, manifest_dict
from .prepare_output import refuse_other_output

_PART_DIR = re.compile(r"^part-(\d{5})-of-(\d{5})$")
_PART_ARG = re.compile(r"^(\d+)/(\d+)$")


def part_dir(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def parse_part(text: str, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``i/N`` (0 <= i < N), or ``slurm``: this task of a Slurm job array (its id from the array's
    first id, the array's task count as N)."""
    if text == "slurm":
        try:
            count = int(environ["SLURM_ARRAY_TASK_COUNT"])
            index = int(environ["SLURM_ARRAY_TASK_ID"]) - int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        except (KeyError, ValueError):
            raise ValueError(
                "--part slurm needs a Slurm job array (SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT; "
                "sbatch --array=0-N-1)"
            ) from None
    else:
        m = _PART_ARG.match(text)
        if m is None:
            raise ValueError(f"--part {text!r} is not i/N (e.g. 0/4) or 'slurm'")
        index, count = int(m.group(1)), int(m.group(2))
    if not 0 <= index < count:
        raise ValueError(f"--part {index}/{count}: the part number must be in [0, {count})")
    return index, count


def part_files(files: Sequence[tuple[str, str]], index: int, count: int) -> list[tuple[str, str]]:
    """Part `index`'s share of the input files: the index-th of `count` contiguous runs."""
    if count > len(files):
        raise ValueError(
            f"--part {index}/{count}: the input has {len(files)} file(s), a part is at least one: use at most "
            f"{len(files)} parts"
        )
    return list(files[index * len(files) // count : (index + 1) * len(files) // count])


def inputs_digest(files: Sequence[tuple[str, str]]) -> str:
    """What every part must agree on: the whole input's files (path, split, size)."""
    h = hashlib.sha256()
    for path, split in files:
        h.update(f"{path}\t{split}\t{os.path.getsize(path)}\n".encode())
    return h.hexdigest()


def _sum_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts' stats added up, field by field (per-split fields split by split)."""
    out: dict[str, Any] = {}
    for s in stats:
        for key, value in s.items():
            if isinstance(value, dict):
                into = out.setdefault(key, {})
                for k, v in value.items():
                    into[k] = into.get(k, 0) + v
            else:
                out[key] = out.get(key, 0) + value
    return out


def _load_parts(out_dir: str, count: int | None) -> tuple[int, list[Manifest]]:
    found = sorted(
        (int(m.group(1)), int(m.group(2)))
        for m in (_PART_DIR.match(d) for d in (os.listdir(out_dir) if os.path.isdir(out_dir) else []))
        if m is not None
    )
    counts = {n for _, n in found}
    if count is not None and count < 1:
        raise ValueError(f"--parts must be >= 1, got {count}")
    if count is None:
        if len(counts) != 1:
            what = "no part-*-of-* folders" if not counts else f"parts of {sorted(counts)} runs"
            raise ValueError(f"{out_dir!r} holds {what}: say how many parts with --parts N")
        count = counts.pop()
    parts = []
    for i in range(count):
        path = os.path.join(out_dir, part_dir(i, count), MANIFEST_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"part {i}/{count} is missing: no {path} (its prepare failed, was interrupted or has not run); "
                f"run it again with --part {i}/{count}"
            )
        try:
            parts.append(Manifest.load(path))
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"part {i}/{count}: {exc}") from None
    return count, parts


def _check_parts(count: int, parts: list[Manifest]) -> None:
    """Every part of the same run (input, tokenizer, options), each with its shards complete."""
    first = parts[0].raw
    same = {k: v for k, v in first["options"].items() if k != "part"}
    for i, m in enumerate(parts):
        opts = m.raw["options"]
        if opts.get("part") != [i, count]:
            raise ValueError(f"part {i}/{count}: {m.path} was written by --part {opts.get('part')}")
        for what, mine, theirs in (
            ("tokenizer sha256", m.tokenizer_sha256, parts[0].tokenizer_sha256),
            ("options", {k: v for k, v in opts.items() if k != "part"}, same),
        ):
            if mine != theirs:
                raise ValueError(
                    f"part {i}/{count} ({m.path}) has {what} {mine}, part 0 has {theirs}: every part must be "
                    "run with the same input, tokenizer and flags"
                )
        for entries in m.splits.values():
            for e in entries:
                size = os.path.getsize(e.url) if os.path.isfile(e.url) else None
                if size != e.bytes:
                    state = "missing" if size is None else f"{size} bytes, the manifest lists {e.bytes}"
                    raise ValueError(f"part {i}/{count}: shard {e.url} is {state}")


def join(out_dir: str, count: int | None = None, overwrite: bool = False) -> Manifest:
    """Write ``out_dir/manifest.json`` over the shards of parts 0..N-1 (N from `count` or the
    part folders found); refuses, writing nothing, when a part is missing, failed or differs, when
    another command writes the folder (its lock), or when a manifest there says something else and
    `overwrite` is not given (the shards it describes would be orphaned)."""
    count, parts = _load_parts(out_dir, count)
    _check_parts(count, parts)
    splits: dict[str, list[dict[str, Any]]] = {}
    for i, m in enumerate(parts):
        for split, entries in m.raw["splits"].items():
            splits.setdefault(split, []).extend({**e, "name": f"{part_dir(i, count)}/{e['name']}"} for e in entries)
    first = parts[0]
    options = {k: v for k, v in first.raw["options"].items() if k != "part"}
    doc = manifest_dict(
        seq_len=first.seq_len,
        vocab_size=first.vocab_size,
        sep_id=first.sep_id,
        sep_piece=first.sep_piece,
        ext=first.ext,
        tokenizer_name=f"{part_dir(0, count)}/{first.raw['tokenizer']['path']}",
        tokenizer_sha256=first.tokenizer_sha256,
        splits=splits,
        sources=[s for m in parts for s in m.sources],
        stats=_sum_stats([m.stats for m in parts]),
        options={**options, "parts": count},
    )
    path = os.path.join(out_dir, MANIFEST_NAME)
    text = json.dumps(doc, indent=1) + "\n"
    lock = FolderLock(out_dir, "join")
    try:
        holds = "a manifest of other shards than these parts (a run trained on it could no longer resume)"
        refuse_other_output(path, holds, not _differs(path, text), overwrite)
        atomic_write_text(path, text)
    finally:
        lock.release()
    return Manifest.load(path)


def _differs(path: str, text: str) -> bool:
    """Whether a manifest is at `path` with another text than `text` (a join of the same parts
    writes the same text: joining again replaces nothing)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read() != text
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        return True
