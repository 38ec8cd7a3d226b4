"""Tokenise text dumps in parallel and pack them into WebDataset token shards.

Pipeline: the main process reads documents in a fixed order (sources.py), assigns each
to a split, and hands chunks of documents to a pool of worker processes that tokenise
them with SentencePiece. Results come back in submission order (a bounded window of
chunks in flight), so the output does not depend on the number of workers or on timing.
The main process packs each split's token stream — a separator token before every
document — into samples of ``seq_len + 1`` tokens (sample i covers stream positions
[i*seq_len, (i+1)*seq_len], so consecutive samples share one token and no token is
wasted as a target), writes shards atomically, and finally writes the manifest.

Everything that can be checked before a byte is written is checked first (options, inputs
readable, the tokenizer, at least one usable document). The output folder then changes
only through `OutputDir` (prepare_output.py): what an earlier run left there is set aside
under hidden names, never deleted, until the new manifest is in place; a run refused later
(say no complete sequence, a full disk) or interrupted by Ctrl-C under `grt` (`Interrupted`,
raised by the command's error boundary) puts everything back, so it leaves the file system
as it found it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from grt_common.errors import Interrupted
from grt_common.files import check_output_path

from .manifest import MANIFEST_NAME, Manifest, manifest_dict
from .parts import inputs_digest, part_dir, part_files
from .prepare_encode import SPLITS, Chunk, Entry, Packer, stream_tokens, tokenise_and_pack
from .prepare_output import TOKENIZER_NAME, OutputDir, prepare_identity, tokenizer_bytes
from .shards import ext_for_vocab, member_size
from .sources import TXT_MODES, SourceStats, check_readable, expand_inputs, iter_file_documents
from .tokenizer import Tokenizer, load_tokenizer

_CHUNK_CHARS = 1 << 21  # ~2 MB of text per task sent to a worker


def _val_draw(text: str, seed: int) -> float:
    """A uniform number in [0, 1) that depends only on the document's content and the seed.

    Content-based, so identical documents always land in the same split (no train/val
    leak through duplicates) and adding a file does not reshuffle the others.
    """
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()[:64])
    return int.from_bytes(h.digest(), "little") / 2.0**64


@dataclass(frozen=True)
class _Options:
    """The settings of one run, recorded in the manifest's ``options``."""

    seq_len: int
    shard_size_mb: float
    sequences_per_shard: int
    val_fraction: float
    seed: int
    text_field: str
    txt_mode: str
    max_mb: float | None


# --------------------------------------------------------------------------- the stages of prepare


def _check_options(options: _Options, workers: int | None) -> None:
    """Refuse a setting no run can use, before anything is read or written."""
    checks = (
        (options.seq_len >= 1, f"seq_len must be >= 1, got {options.seq_len}"),
        (0.0 <= options.val_fraction < 1.0, f"val_fraction must be in [0, 1), got {options.val_fraction}"),
        (
            math.isfinite(options.shard_size_mb) and options.shard_size_mb > 0,
            f"shard_size_mb must be > 0, got {options.shard_size_mb}",
        ),
        (workers is None or workers >= 1, f"workers must be >= 1 (leave it out for the CPU count), got {workers}"),
        (
            options.max_mb is None or options.max_mb > 0,
            f"max_mb must be > 0 (leave it out to read everything), got {options.max_mb}",
        ),
        (options.txt_mode in TXT_MODES, f"txt_mode must be one of {TXT_MODES}, got {options.txt_mode!r}"),
        (bool(options.text_field), "text_field must not be empty"),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _input_files(inputs: Sequence[str], val_inputs: Sequence[str]) -> list[tuple[str, str]]:
    """(path, split) of every input file, train files first; a file in ``val_inputs`` is val only."""
    train_files = expand_inputs(inputs)
    val_files = expand_inputs(val_inputs) if val_inputs else []
    val_set = set(val_files)
    return [(f, "train") for f in train_files if f not in val_set] + [(f, "val") for f in val_files]


def _split_of(text: str, file_split: str, options: _Options) -> str:
    """A document's split: its file's, or val for a ``val_fraction`` of the train documents."""
    if file_split == "val" or (options.val_fraction > 0 and _val_draw(text, options.seed) < options.val_fraction):
        return "val"
    return "train"


class _DocumentReader:
    """The input documents in a fixed order, each with its split, in chunks of about ``_CHUNK_CHARS``.

    Counts what it reads: ``stats`` over all files, and one ``sources`` entry per file read.
    Stops after ``max_mb`` MB of document text, when set.
    """

    def __init__(self, files: list[tuple[str, str]], options: _Options) -> None:
        self.files, self.options = files, options
        self.limit = None if options.max_mb is None else int(options.max_mb * 1e6)
        self.stats = SourceStats()
        self.sources: list[dict[str, Any]] = []

    def chunks(self) -> Iterator[Chunk]:
        texts: list[str] = []
        splits: list[str] = []
        nchars = 0
        done = 0  # document bytes of the files finished
        for path, file_split in self.files:
            fstats = SourceStats()
            documents = iter_file_documents(
                path, text_field=self.options.text_field, txt_mode=self.options.txt_mode, stats=fstats
            )
            for text in documents:
                texts.append(text)
                splits.append(_split_of(text, file_split, self.options))
                nchars += len(text)
                if nchars >= _CHUNK_CHARS:
                    yield texts, splits
                    texts, splits, nchars = [], [], 0
                if self._reached_limit(done + fstats.bytes):
                    break
            done += fstats.bytes
            self._count(path, file_split, fstats)
            if self._reached_limit(done):
                break
        if texts:
            yield texts, splits

    def _reached_limit(self, nbytes: int) -> bool:
        return self.limit is not None and nbytes >= self.limit

    def _count(self, path: str, file_split: str, fstats: SourceStats) -> None:
        if fstats.truncated_files:
            print(
                f"prepare: warning: input {path!r} ends early or is damaged (compressed data cut short): "
                f"{fstats.documents} documents read up to the damage, the rest is lost",
                file=sys.stderr,
                flush=True,
            )
        self.stats.add(fstats)
        self.sources.append(
            {"path": path, "split": file_split, "file_bytes": os.path.getsize(path), **fstats.to_dict()}
        )


def _written_splits(packers: dict[str, Packer], seq_len: int, stats: SourceStats) -> dict[str, list[Entry]]:
    """The shards of each split (train always, val when it has some); refuses a run that wrote none."""
    if not any(p.entries for p in packers.values()):
        raise ValueError(
            f"no complete sequence of {seq_len + 1} tokens in the input "
            f"({stats.documents} usable documents, stats {stats.to_dict()})"
        )
    return {s: p.entries for s, p in packers.items() if p.entries or s == "train"}


def _write_manifest(
    out: OutputDir,
    tok: Tokenizer,
    options: _Options,
    splits: dict[str, list[Entry]],
    reader: _DocumentReader,
    packers: dict[str, Packer],
    dropped: dict[str, int],
    part_options: dict[str, Any],
) -> None:
    run_stats = {
        **reader.stats.to_dict(),
        "documents_per_split": {s: p.documents for s, p in packers.items()},
        "stream_tokens_per_split": {s: p.stream_tokens for s, p in packers.items()},
        "dropped_tail_tokens": dropped,
    }
    doc = manifest_dict(
        seq_len=options.seq_len,
        vocab_size=tok.vocab_size,
        sep_id=tok.sep_id,
        sep_piece=tok.sep_piece,
        ext=ext_for_vocab(tok.vocab_size),
        tokenizer_name=TOKENIZER_NAME,
        tokenizer_sha256=tok.sha256,
        splits=splits,
        sources=reader.sources,
        stats=run_stats,
        options={**asdict(options), **part_options},
    )
    out.put_bytes(MANIFEST_NAME, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))


def _print_summary(
    stats: SourceStats,
    splits: dict[str, list[Entry]],
    text_field: str,
    elapsed: float,
    stream_tokens: int,
    manifest_path: str,
) -> None:
    mb = stats.bytes / 1e6
    print(
        f"prepare: {stats.documents:,} documents ({mb:.1f} MB, skipped {stats.skipped_empty} empty, "
        f"{stats.skipped_non_utf8} non-UTF-8, {stats.skipped_bad_json} bad JSON, "
        f"{stats.skipped_missing_field} without {text_field!r}"
        + (f"; {stats.truncated_files} truncated file(s)" if stats.truncated_files else "")
        + ") -> "
        + ", ".join(f"{s}: {len(v)} shards / {sum(e['sequences'] for e in v):,} sequences" for s, v in splits.items())
        + f" in {elapsed:.1f}s ({mb / max(elapsed, 1e-9):.2f} MB/s, {stream_tokens / max(elapsed, 1e-9) / 1e6:.2f}M "
        f"tokens/s); manifest {manifest_path}",
        file=sys.stderr,
        flush=True,
    )


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    out_dir: str,
    seq_len: int = 1024,
    shard_size_mb: float = 64.0,
    workers: int | None = None,
    val_fraction: float = 0.0,
    val_inputs: Sequence[str] = (),
    seed: int = 0,
    text_field: str = "text",
    txt_mode: str = "file",
    max_mb: float | None = None,
    progress: bool = True,
    part: tuple[int, int] | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Tokenise ``inputs`` into shards under ``out_dir``; returns the loaded manifest. An ``out_dir``
    holding anything but this prepare's own output (another prepare's, a run, an export, other
    files) is refused unless ``overwrite`` (prepare_output.py, `check_output_folder`).

    ``val_inputs`` go entirely to the ``val`` split; otherwise a ``val_fraction`` of the
    documents (chosen by a seeded hash of their content) does. ``max_mb`` stops after that
    many MB of document text (for benchmarks and smoke runs). ``part=(i, N)`` prepares part i of
    N into ``out_dir/part-0000i-of-0000N`` (data_pipeline/parts.py; `parts.join` joins them).
    """
    t_start = time.time()
    options = _Options(
        seq_len=seq_len,
        shard_size_mb=shard_size_mb,
        sequences_per_shard=0,  # set once the tokenizer gives the sample size
        val_fraction=val_fraction,
        seed=seed,
        text_field=text_field,
        txt_mode=txt_mode,
        max_mb=max_mb,
    )
    if part is not None:
        out_dir = os.path.join(out_dir, part_dir(*part))
    files, tok, part_options = _preflight(inputs, val_inputs, tokenizer, out_dir, options, workers, part)
    ext = ext_for_vocab(tok.vocab_size)
    options = replace(options, sequences_per_shard=max(1, int(shard_size_mb * 1e6) // member_size(seq_len + 1, ext)))
    n_workers = workers if workers is not None else (os.cpu_count() or 1)

    identity = prepare_identity(files, {**asdict(options), **part_options}, tok.sha256)
    out = OutputDir(out_dir, identity, overwrite, inputs=(*(path for path, _ in files), tok.model_path))
    manifest_path = os.path.join(out_dir, MANIFEST_NAME)
    try:
        out.open()
        packers = {s: Packer(s, out, seq_len, options.sequences_per_shard, ext) for s in SPLITS}
        reader = _DocumentReader(files, options)
        tokenise_and_pack(reader.chunks(), tok, packers, n_workers, progress, t_start)
        dropped = {s: p.finish() for s, p in packers.items()}
        splits = _written_splits(packers, seq_len, reader.stats)
        tokenizer_data = tokenizer_bytes(tok, out)
        if tokenizer_data is not None:
            out.put_bytes(TOKENIZER_NAME, tokenizer_data)
        _write_manifest(out, tok, options, splits, reader, packers, dropped, part_options)
        manifest = Manifest.load(manifest_path)
    except (Exception, Interrupted):  # refused or Ctrl-C: the folder as it was (a kill leaves no manifest)
        problems = out.rollback()
        if problems:
            print(f"prepare: could not restore {out_dir!r}: {'; '.join(problems)}", file=sys.stderr, flush=True)
        raise
    except BaseException:  # a kill's stand-in (a bare KeyboardInterrupt): nothing undone, the lock let go
        out.unlock()
        raise
    out.commit(keep={e["name"] for entries in splits.values() for e in entries})
    if progress:
        elapsed = time.time() - t_start
        _print_summary(reader.stats, splits, text_field, elapsed, stream_tokens(packers), manifest_path)
    return manifest


def _preflight(
    inputs: Sequence[str],
    val_inputs: Sequence[str],
    tokenizer: str,
    out_dir: str,
    options: _Options,
    workers: int | None,
    part: tuple[int, int] | None,
) -> tuple[list[tuple[str, str]], Tokenizer, dict[str, Any]]:
    """Everything that can be refused before a byte is written: the options, the inputs (they
    exist and can be read), the tokenizer (a SentencePiece model), the output path, and at
    least one usable document (in the part's files, for a part). Returns the input files (path,
    split), the tokenizer and what a part adds to the manifest's options."""
    _check_options(options, workers)
    files = _input_files(inputs, val_inputs)
    part_options: dict[str, Any] = {}
    if part is not None:  # the digest of the whole input: the join checks that the parts agree
        part_options = {"part": list(part), "inputs_sha256": inputs_digest(files)}
        files = part_files(files, *part)
    tok = load_tokenizer(tokenizer)
    check_output_path(out_dir, "output folder", is_dir=True)
    for path, _ in files:
        check_readable(path, options.text_field)
    stats = SourceStats()
    for path, _ in files:
        documents = iter_file_documents(path, text_field=options.text_field, txt_mode=options.txt_mode, stats=stats)
        if any(True for _ in itertools.islice(documents, 1)):
            return files, tok, part_options
    raise ValueError(f"no usable documents in the {len(files)} input file(s) (stats {stats.to_dict()})")
