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
only through `_OutputDir`: what an earlier run left there is set aside under hidden names,
never deleted, until the new manifest is in place; a run refused later (say no complete
sequence, a full disk) or interrupted by Ctrl-C under `grt` (`Interrupted`, raised by the
command's error boundary) puts everything back, so it leaves the file system as it found it.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from pretrain.errors import Interrupted

from .files import check_output_path, is_temp
from .manifest import MANIFEST_NAME, Manifest, manifest_dict
from .parts import inputs_digest, part_dir, part_files
from .shards import DTYPES, build_shard, ext_for_vocab, member_size, write_shard_atomic
from .sources import TXT_MODES, SourceStats, check_readable, expand_inputs, iter_file_documents
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

TOKENIZER_NAME = "tokenizer.model"
SPLITS = ("train", "val")
_SHARD_RE = re.compile(r"^(train|val)-\d{6}\.tar$")
_SHARD_TMP_RE = re.compile(r"^(train|val)-\d{6}\.tar\.tmp$")
# what a run set aside (`_OutputDir`): `.NAME.oldN` of the pipeline's own names only
_ASIDE_RE = re.compile(r"^\.(manifest\.json|tokenizer\.model|(train|val)-\d{6}\.tar(\.tmp)?)\.old\d+$")
_CHUNK_CHARS = 1 << 21  # ~2 MB of text per task sent to a worker
_SEGMENT_CHARS = 1000

_Tokens = npt.NDArray[np.uint32]
_Chunk = tuple[list[str], list[str]]  # documents and the split of each
_Task = tuple[list[str], list[str], int]  # a chunk and the separator id, as sent to a worker
_Encoded = dict[str, _Tokens]  # split -> [sep, doc..., sep, doc...] of the chunk's documents in it
_Entry = dict[str, Any]  # one shard in the manifest

_worker_sp: SentencePieceProcessor | None = None
_worker_segment = False


def _init_worker(model_path: str) -> None:
    global _worker_sp, _worker_segment
    import sentencepiece as spm

    sp = _worker_sp = spm.SentencePieceProcessor(model_file=model_path)
    # SentencePiece's BPE encoder slows down on very long strings (a 500 kB book encodes
    # at less than half the speed of the same text in 1 kB pieces). When no piece holds a
    # newline (true for tokenizers trained by train_tokenizer, which learns from lines),
    # no merge can cross one, so encoding newline-delimited segments and concatenating
    # gives exactly the tokens of encoding the whole document.
    _worker_segment = not any("\n" in sp.id_to_piece(i) for i in range(sp.get_piece_size()))


def segments(text: str, size: int = _SEGMENT_CHARS) -> list[str]:
    """Cut ``text`` just before newlines, into pieces of roughly ``size`` characters."""
    if len(text) <= size:
        return [text]
    out, i, n = [], 0, len(text)
    while i < n:
        j = text.find("\n", i + size)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        i = j
    return out


def _encode_chunk(task: _Task) -> _Encoded:
    """Tokenise one chunk: returns {split: uint32 array of [sep, doc..., sep, doc...]}."""
    texts, splits, sep_id = task
    sp = _worker_sp
    assert sp is not None, "_init_worker runs first"
    ids: list[list[int]]
    if _worker_segment:
        pieces: list[str] = []
        counts: list[int] = []
        for t in texts:
            seg = segments(t)
            pieces += seg
            counts.append(len(seg))
        flat = sp.encode(pieces, out_type=int)
        ids, k = [], 0
        for c in counts:
            ids.append([t for part in flat[k : k + c] for t in part] if c > 1 else flat[k])
            k += c
    else:
        ids = sp.encode(texts, out_type=int)
    out = {}
    for split in SPLITS:
        docs = [d for d, s in zip(ids, splits) if s == split]
        if not docs:
            continue
        total = sum(len(d) for d in docs) + len(docs)
        arr = np.empty(total, dtype=np.uint32)
        pos = 0
        for d in docs:
            arr[pos] = sep_id
            arr[pos + 1 : pos + 1 + len(d)] = d
            pos += 1 + len(d)
        out[split] = arr
    return out


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


class _Packer:
    """Packs one split's token stream into fixed-size samples and writes full shards."""

    def __init__(self, split: str, out: _OutputDir, seq_len: int, per_shard: int, ext: str) -> None:
        self.split, self.out, self.seq_len, self.per_shard, self.ext = split, out, seq_len, per_shard, ext
        self.pending: list[_Tokens] = []
        self.pending_len = 0
        self.entries: list[_Entry] = []
        self.documents = 0
        self.stream_tokens = 0  # tokens including separators

    def add(self, arr: _Tokens, ndocs: int) -> None:
        self.pending.append(arr)
        self.pending_len += len(arr)
        self.documents += ndocs
        self.stream_tokens += len(arr)
        need = self.per_shard * self.seq_len + 1
        while self.pending_len >= need:
            stream = np.concatenate(self.pending)
            self._write(stream, self.per_shard)
            rest = stream[self.per_shard * self.seq_len :]
            self.pending, self.pending_len = [rest], len(rest)

    def finish(self) -> int:
        """Write the last (smaller) shard; returns the number of tail tokens dropped."""
        if self.pending_len == 0:
            return 0
        stream = np.concatenate(self.pending)
        n = (len(stream) - 1) // self.seq_len
        if n > 0:
            self._write(stream, n)
        dropped = len(stream) - n * self.seq_len - (1 if n else 0)
        self.pending, self.pending_len = [], 0
        return max(0, dropped)

    def _write(self, stream: _Tokens, n: int) -> None:
        T = self.seq_len
        idx = np.arange(n)[:, None] * T + np.arange(T + 1)[None, :]
        samples = stream[idx].astype(DTYPES[self.ext])
        stem = f"{self.split}-{len(self.entries):06d}"
        name = stem + ".tar"
        data = build_shard(stem, samples, self.ext)
        sha = self.out.put_shard(name, data)
        self.entries.append(
            {"name": name, "sequences": int(n), "tokens": int(n * T), "bytes": len(data), "sha256": sha}
        )


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


class _OutputDir:
    """The output folder of one run, changed so that a refused run can be undone.

    Nothing there is deleted or overwritten before the run is complete: whatever a new file
    replaces is first renamed to a hidden ``.NAME.oldN`` beside it, the old manifest before
    the first file it may describe (so that no manifest describes shards being replaced).
    `commit` deletes what was set aside, and stale shards, once the new manifest is in place;
    `rollback` (a refused run) deletes what this run wrote, renames everything back and
    removes the folders it made. An interrupted run (a kill, Ctrl-C) leaves complete
    ``*.tar`` files only, and the old manifest only if none of its files was replaced yet;
    the next complete run deletes what it set aside.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.created: list[str] = []  # folders this run made, outermost first
        self.aside: list[tuple[str, str]] = []  # (name, hidden name it was renamed to), in order
        self.written: list[str] = []  # names this run wrote (temporaries included)

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self) -> None:
        """Make the folder and its missing parents."""
        missing, d = [], os.path.abspath(self.path)
        while not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            os.mkdir(d)
            self.created.append(d)

    def _set_aside(self, name: str) -> None:
        if not os.path.lexists(self._join(name)):
            return
        if name != MANIFEST_NAME and not name.endswith(".tmp"):  # a file the old manifest may describe
            self._set_aside(MANIFEST_NAME)
        n = os.getpid()
        while os.path.lexists(self._join(f".{name}.old{n}")):
            n += 1
        os.rename(self._join(name), self._join(f".{name}.old{n}"))
        self.aside.append((name, f".{name}.old{n}"))

    def put_shard(self, name: str, data: bytes) -> str:
        """Write shard ``name`` (through ``NAME.tmp``); returns its sha256."""
        if name + ".tmp" not in self.written:
            self._set_aside(name + ".tmp")  # a partial shard of an interrupted run: garbage, but not ours
            self.written.append(name + ".tmp")
        return write_shard_atomic(self._join(name), data, before_replace=lambda: self._replacing(name))

    def _replacing(self, name: str) -> None:
        """``name`` is about to be this run's: the old one set aside (a write that fails before
        this, a full disk, leaves the old file where it is, for `rollback` not to remove)."""
        self._set_aside(name)
        self.written.append(name)

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` complete (fsynced under a temporary name), then set the old one aside and rename."""
        tmp = f".{name}.tmp{os.getpid()}"
        self.written.append(tmp)
        with open(self._join(tmp), "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self._replacing(name)
        os.replace(self._join(tmp), self._join(name))

    def commit(self, keep: set[str]) -> None:
        """The new manifest is in place: delete what was set aside, shards an earlier (larger) run
        left behind and leftovers of interrupted runs; only this pipeline's own names."""
        for f in os.listdir(self.path):
            stale_shard = _SHARD_RE.match(f) is not None and f not in keep
            if stale_shard or _SHARD_TMP_RE.match(f) or _ASIDE_RE.match(f) or is_temp(f):
                os.unlink(self._join(f))

    def rollback(self) -> list[str]:
        """Undo the run: the folder as it was before `open`. Returns what could not be undone."""
        problems = []
        for name in reversed(self.written):
            try:
                if os.path.lexists(self._join(name)):
                    os.unlink(self._join(name))
            except OSError as err:
                problems.append(f"remove {name}: {err}")
        for name, hidden in reversed(self.aside):
            try:
                os.rename(self._join(hidden), self._join(name))
            except OSError as err:
                problems.append(f"rename {hidden} back to {name}: {err}")
        for d in reversed(self.created):
            try:
                os.rmdir(d)
            except OSError as err:
                problems.append(f"remove the folder {d}: {err}")
        return problems


def _tokenizer_bytes(tok: Tokenizer, out: _OutputDir) -> bytes | None:
    """The tokenizer to put next to the shards, or None when it is that file already."""
    dst = os.path.join(out.path, TOKENIZER_NAME)
    if os.path.exists(dst) and os.path.samefile(dst, tok.model_path):
        return None
    with open(tok.model_path, "rb") as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != tok.sha256:
        raise ValueError(f"the tokenizer {tok.model_path!r} changed while prepare ran")
    return data


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

    def chunks(self) -> Iterator[_Chunk]:
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


class _PendingChunk(Protocol):
    """A chunk being encoded: multiprocessing's AsyncResult, or `_EncodedHere`."""

    def get(self) -> _Encoded: ...


@dataclass(frozen=True)
class _EncodedHere:
    """A chunk encoded in this process, behind AsyncResult's ``get``."""

    encoded: _Encoded

    def get(self) -> _Encoded:
        return self.encoded


def _pool_worker(model_path: str) -> None:
    """A pool process: Ctrl-C (SIGINT, sent to the terminal's whole process group) is the main
    process's to handle (it undoes the run and ends the pool), not a traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(model_path)


@contextmanager
def _encoder_pool(model_path: str, workers: int) -> Iterator[Callable[[_Task], _PendingChunk]]:
    """``submit(task)`` for the block: encodes in ``workers`` processes (in this one when 1).

    The processes end with the block, whether it finishes or fails.
    """
    if workers == 1:
        _init_worker(model_path)
        yield lambda task: _EncodedHere(_encode_chunk(task))
        return
    start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(start_method).Pool(workers, initializer=_pool_worker, initargs=(model_path,))
    try:
        yield lambda task: pool.apply_async(_encode_chunk, (task,))
    finally:
        pool.terminate()
        pool.join()


def _in_submission_order(
    chunks: Iterator[_Chunk], submit: Callable[[_Task], _PendingChunk], sep_id: int, window: int
) -> Iterator[tuple[int, list[str], _PendingChunk]]:
    """(text bytes, splits, pending result) of each chunk in the order read, while up to
    ``window`` later chunks are being encoded."""
    pending: collections.deque[tuple[int, list[str], _PendingChunk]] = collections.deque()
    for texts, splits in chunks:
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        pending.append((nbytes, splits, submit((texts, splits, sep_id))))
        while len(pending) > window:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def _tokenise_and_pack(
    reader: _DocumentReader, tok: Tokenizer, packers: dict[str, _Packer], workers: int, progress: bool, t_start: float
) -> None:
    """Read, encode and pack every document, with a progress bar of the text read."""
    from tqdm import tqdm

    # the pool first: fork before tqdm starts its monitor thread
    with (
        _encoder_pool(tok.model_path, workers) as submit,
        tqdm(
            desc="prepare",
            unit="B",
            unit_scale=True,
            disable=not progress,
            file=sys.stderr,
            smoothing=0.1,
            mininterval=0.5,
        ) as bar,
    ):
        for nbytes, splits, result in _in_submission_order(reader.chunks(), submit, tok.sep_id, window=2 * workers):
            for split, tokens in result.get().items():
                packers[split].add(tokens, splits.count(split))
            bar.update(nbytes)
            tokens_per_s = _stream_tokens(packers) / max(1e-9, time.time() - t_start)
            shards = sum(len(p.entries) for p in packers.values())
            bar.set_postfix_str(f"{tokens_per_s / 1e6:.2f}M tok/s, {shards} shards", refresh=False)


def _stream_tokens(packers: dict[str, _Packer]) -> int:
    return sum(p.stream_tokens for p in packers.values())


def _written_splits(packers: dict[str, _Packer], seq_len: int, stats: SourceStats) -> dict[str, list[_Entry]]:
    """The shards of each split (train always, val when it has some); refuses a run that wrote none."""
    if not any(p.entries for p in packers.values()):
        raise ValueError(
            f"no complete sequence of {seq_len + 1} tokens in the input "
            f"({stats.documents} usable documents, stats {stats.to_dict()})"
        )
    return {s: p.entries for s, p in packers.items() if p.entries or s == "train"}


def _write_manifest(
    out: _OutputDir,
    tok: Tokenizer,
    options: _Options,
    splits: dict[str, list[_Entry]],
    reader: _DocumentReader,
    packers: dict[str, _Packer],
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
    splits: dict[str, list[_Entry]],
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
) -> Manifest:
    """Tokenise ``inputs`` into shards under ``out_dir``; returns the loaded manifest.

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

    out = _OutputDir(out_dir)
    manifest_path = os.path.join(out_dir, MANIFEST_NAME)
    try:
        out.open()
        packers = {s: _Packer(s, out, seq_len, options.sequences_per_shard, ext) for s in SPLITS}
        reader = _DocumentReader(files, options)
        _tokenise_and_pack(reader, tok, packers, n_workers, progress, t_start)
        dropped = {s: p.finish() for s, p in packers.items()}
        splits = _written_splits(packers, seq_len, reader.stats)
        tokenizer_bytes = _tokenizer_bytes(tok, out)
        if tokenizer_bytes is not None:
            out.put_bytes(TOKENIZER_NAME, tokenizer_bytes)
        _write_manifest(out, tok, options, splits, reader, packers, dropped, part_options)
        manifest = Manifest.load(manifest_path)
    except (Exception, Interrupted):  # refused or Ctrl-C: the folder as it was (a kill leaves no manifest)
        problems = out.rollback()
        if problems:
            print(f"prepare: could not restore {out_dir!r}: {'; '.join(problems)}", file=sys.stderr, flush=True)
        raise
    out.commit(keep={e["name"] for entries in splits.values() for e in entries})
    if progress:
        elapsed = time.time() - t_start
        _print_summary(reader.stats, splits, text_field, elapsed, _stream_tokens(packers), manifest_path)
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
