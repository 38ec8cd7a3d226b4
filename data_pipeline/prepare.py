"""Tokenise text dumps in parallel and pack them into WebDataset token shards.

Pipeline: the main process reads documents in a fixed order (sources.py), assigns each
to a split, and hands chunks of documents to a pool of worker processes that tokenise
them with SentencePiece. Results come back in submission order (a bounded window of
chunks in flight), so the output does not depend on the number of workers or on timing.
The main process packs each split's token stream — a separator token before every
document — into samples of ``seq_len + 1`` tokens (sample i covers stream positions
[i*seq_len, (i+1)*seq_len], so consecutive samples share one token and no token is
wasted as a target), writes shards atomically, and finally writes the manifest.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

from .files import atomic_write_bytes, is_temp
from .manifest import MANIFEST_NAME, Manifest, manifest_dict
from .shards import DTYPES, build_shard, ext_for_vocab, member_size, write_shard_atomic
from .sources import SourceStats, expand_inputs, iter_file_documents
from .tokenizer import Tokenizer, file_sha256

TOKENIZER_NAME = "tokenizer.model"
SPLITS = ("train", "val")
_SHARD_RE = re.compile(r"^(train|val)-\d{6}\.tar$")
_SHARD_TMP_RE = re.compile(r"^(train|val)-\d{6}\.tar\.tmp$")
_CHUNK_CHARS = 1 << 21  # ~2 MB of text per task sent to a worker

# Test hook: called as _after_shard_hook(path) after each shard is written.
_after_shard_hook = None

_SEGMENT_CHARS = 1000

_worker_sp = None
_worker_segment = False


def _init_worker(model_path: str) -> None:
    global _worker_sp, _worker_segment
    import sentencepiece as spm

    _worker_sp = spm.SentencePieceProcessor(model_file=model_path)
    # SentencePiece's BPE encoder slows down on very long strings (a 500 kB book encodes
    # at less than half the speed of the same text in 1 kB pieces). When no piece holds a
    # newline (true for tokenizers trained by train_tokenizer, which learns from lines),
    # no merge can cross one, so encoding newline-delimited segments and concatenating
    # gives exactly the tokens of encoding the whole document.
    _worker_segment = not any("\n" in _worker_sp.id_to_piece(i) for i in range(_worker_sp.get_piece_size()))


def _segments(text: str, size: int = _SEGMENT_CHARS) -> list[str]:
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


def _encode_chunk(args):
    """Tokenise one chunk: returns {split: uint32 array of [sep, doc..., sep, doc...]}."""
    texts, splits, sep_id = args
    if _worker_segment:
        pieces, counts = [], []
        for t in texts:
            seg = _segments(t)
            pieces += seg
            counts.append(len(seg))
        flat = _worker_sp.encode(pieces, out_type=int)
        ids, k = [], 0
        for c in counts:
            ids.append([t for part in flat[k : k + c] for t in part] if c > 1 else flat[k])
            k += c
    else:
        ids = _worker_sp.encode(texts, out_type=int)
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


class _Packer:
    """Packs one split's token stream into fixed-size samples and writes full shards."""

    def __init__(self, split: str, out_dir: str, seq_len: int, per_shard: int, ext: str):
        self.split, self.out_dir, self.seq_len, self.per_shard, self.ext = split, out_dir, seq_len, per_shard, ext
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.entries: list[dict] = []
        self.documents = 0
        self.stream_tokens = 0  # tokens including separators

    def add(self, arr: np.ndarray, ndocs: int) -> None:
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

    def _write(self, stream: np.ndarray, n: int) -> None:
        T = self.seq_len
        idx = np.arange(n)[:, None] * T + np.arange(T + 1)[None, :]
        samples = stream[idx].astype(DTYPES[self.ext])
        stem = f"{self.split}-{len(self.entries):06d}"
        name = stem + ".tar"
        path = os.path.join(self.out_dir, name)
        data = build_shard(stem, samples, self.ext)
        sha = write_shard_atomic(path, data)
        self.entries.append(
            {"name": name, "sequences": int(n), "tokens": int(n * T), "bytes": len(data), "sha256": sha}
        )
        if _after_shard_hook is not None:
            _after_shard_hook(path)


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
) -> Manifest:
    """Tokenise ``inputs`` into shards under ``out_dir``; returns the loaded manifest.

    ``val_inputs`` go entirely to the ``val`` split; otherwise a ``val_fraction`` of the
    documents (chosen by a seeded hash of their content) does. ``max_mb`` stops after that
    many MB of document text (for benchmarks and smoke runs).
    """
    from tqdm import tqdm

    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    workers = max(1, int(workers if workers is not None else (os.cpu_count() or 1)))
    t_start = time.time()
    train_files = expand_inputs(inputs)
    val_files = expand_inputs(val_inputs) if val_inputs else []
    val_set = set(val_files)
    train_files = [f for f in train_files if f not in val_set]
    files = [(f, "train") for f in train_files] + [(f, "val") for f in val_files]

    tok = Tokenizer(tokenizer)
    ext = ext_for_vocab(tok.vocab_size)
    per_shard = max(1, int(shard_size_mb * 1e6) // member_size(seq_len + 1, ext))

    os.makedirs(out_dir, exist_ok=True)
    # An old manifest would describe shards this run is about to overwrite: remove it
    # first; the new one is written only once every shard is complete.
    manifest_path = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
    for f in os.listdir(out_dir):  # leftovers of an interrupted run (only our own names)
        if _SHARD_TMP_RE.match(f) or is_temp(f):  # shards' own temporaries; the manifest's and tokenizer's
            os.unlink(os.path.join(out_dir, f))
    tok_dst = os.path.join(out_dir, TOKENIZER_NAME)
    if not (os.path.exists(tok_dst) and os.path.samefile(tok_dst, tok.model_path)):
        with open(tok.model_path, "rb") as fh:
            atomic_write_bytes(tok_dst, fh.read())
    if file_sha256(tok_dst) != tok.sha256:
        raise RuntimeError(f"copy of the tokenizer at {tok_dst!r} does not match {tok.model_path!r}")

    packers = {s: _Packer(s, out_dir, seq_len, per_shard, ext) for s in SPLITS}
    stats = SourceStats()
    sources = []
    limit = None if max_mb is None else int(max_mb * 1e6)
    n_tokens = 0

    def chunks():
        buf_texts, buf_splits, nchars = [], [], 0
        done = 0
        for path, file_split in files:
            fstats = SourceStats()
            for text in iter_file_documents(path, text_field=text_field, txt_mode=txt_mode, stats=fstats):
                if file_split == "val" or (val_fraction > 0 and _val_draw(text, seed) < val_fraction):
                    split = "val"
                else:
                    split = "train"
                buf_texts.append(text)
                buf_splits.append(split)
                nchars += len(text)
                if nchars >= _CHUNK_CHARS:
                    yield buf_texts, buf_splits
                    buf_texts, buf_splits, nchars = [], [], 0
                if limit is not None and done + fstats.bytes >= limit:
                    break
            done += fstats.bytes
            stats.add(fstats)
            sources.append(
                {
                    "path": path,
                    "split": file_split,
                    "file_bytes": os.path.getsize(path),
                    **{k: v for k, v in fstats.to_dict().items()},
                }
            )
            if limit is not None and done >= limit:
                break
        if buf_texts:
            yield buf_texts, buf_splits

    # the pool first: fork before tqdm starts its monitor thread
    pool = (
        mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn").Pool(
            workers, initializer=_init_worker, initargs=(tok.model_path,)
        )
        if workers > 1
        else None
    )
    bar = tqdm(
        desc="prepare", unit="B", unit_scale=True, disable=not progress, file=sys.stderr, smoothing=0.1, mininterval=0.5
    )
    if pool is None:
        _init_worker(tok.model_path)
    try:
        pending = collections.deque()

        def consume(item):
            nonlocal n_tokens
            (texts_bytes, splits), result = item
            out = result.get() if pool is not None else result
            for split in SPLITS:
                if split in out:
                    packers[split].add(out[split], sum(1 for s in splits if s == split))
                    n_tokens += len(out[split])
            bar.update(texts_bytes)
            el = max(1e-9, time.time() - t_start)
            bar.set_postfix_str(
                f"{n_tokens / el / 1e6:.2f}M tok/s, {sum(len(p.entries) for p in packers.values())} shards",
                refresh=False,
            )

        for texts, splits in chunks():
            nbytes = sum(len(t.encode("utf-8")) for t in texts)
            task = (texts, splits, tok.sep_id)
            result = pool.apply_async(_encode_chunk, (task,)) if pool is not None else _encode_chunk(task)
            pending.append(((nbytes, splits), result))
            while len(pending) > 2 * workers:
                consume(pending.popleft())
        while pending:
            consume(pending.popleft())
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        bar.close()
    dropped = {s: p.finish() for s, p in packers.items()}
    splits = {s: p.entries for s, p in packers.items() if p.entries or s == "train"}
    if not packers["train"].entries and not packers["val"].entries:
        raise ValueError(
            f"no complete sequence of {seq_len + 1} tokens in the input "
            f"({stats.documents} usable documents, stats {stats.to_dict()})"
        )
    # Shards a previous (larger) run left behind would be mistaken for part of this one.
    keep = {e["name"] for v in splits.values() for e in v}
    for f in os.listdir(out_dir):
        if _SHARD_RE.match(f) and f not in keep:
            os.unlink(os.path.join(out_dir, f))
    elapsed = time.time() - t_start
    run_stats = {
        **stats.to_dict(),
        "documents_per_split": {s: p.documents for s, p in packers.items()},
        "stream_tokens_per_split": {s: p.stream_tokens for s, p in packers.items()},
        "dropped_tail_tokens": dropped,
    }
    options = {
        "seq_len": seq_len,
        "shard_size_mb": shard_size_mb,
        "sequences_per_shard": per_shard,
        "val_fraction": val_fraction,
        "seed": seed,
        "text_field": text_field,
        "txt_mode": txt_mode,
        "max_mb": max_mb,
    }
    doc = manifest_dict(
        seq_len=seq_len,
        vocab_size=tok.vocab_size,
        sep_id=tok.sep_id,
        sep_piece=tok.sep_piece,
        ext=ext,
        tokenizer_name=TOKENIZER_NAME,
        tokenizer_sha256=tok.sha256,
        splits=splits,
        sources=sources,
        stats=run_stats,
        options=options,
    )
    atomic_write_bytes(manifest_path, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
    if progress:
        mb = stats.bytes / 1e6
        print(
            f"prepare: {stats.documents:,} documents ({mb:.1f} MB, skipped {stats.skipped_empty} empty, "
            f"{stats.skipped_non_utf8} non-UTF-8, {stats.skipped_bad_json} bad JSON, "
            f"{stats.skipped_missing_field} without {text_field!r}) -> "
            + ", ".join(
                f"{s}: {len(v)} shards / {sum(e['sequences'] for e in v):,} sequences" for s, v in splits.items()
            )
            + f" in {elapsed:.1f}s ({mb / max(elapsed, 1e-9):.2f} MB/s, {n_tokens / max(elapsed, 1e-9) / 1e6:.2f}M "
            f"tokens/s); manifest {manifest_path}",
            file=sys.stderr,
            flush=True,
        )
    return Manifest.load(manifest_path)
