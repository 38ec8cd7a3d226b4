"""The encoding stage of `prepare`: documents tokenised in a pool of processes (in submission
order) and each split's token stream packed into shards (`Packer`)."""

from __future__ import annotations

import collections
import hashlib
import multiprocessing as mp
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from .prepare_output import OutputDir
from .shards import DTYPES, build_shard, sample_stride
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

SPLITS = ("train", "val")
_SEGMENT_CHARS = 1000

_Tokens = npt.NDArray[np.uint32]
Chunk = tuple[list[str], list[str]]  # documents and the split of each
_Task = tuple[list[str], list[str], int]  # a chunk and the separator id, as sent to a worker
_Encoded = dict[str, _Tokens]  # split -> [sep, doc..., sep, doc...] of the chunk's documents in it
Entry = dict[str, Any]  # one shard in the manifest

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


class Packer:
    """Packs one split's token stream into fixed-size samples and writes full shards. `masked`: each
    token comes with a loss-mask bit (`add`'s `mask`), written as each sample's mask member."""

    def __init__(
        self, split: str, out: OutputDir, seq_len: int, per_shard: int, ext: str, masked: bool = False
    ) -> None:
        self.split, self.out, self.seq_len, self.per_shard, self.ext = split, out, seq_len, per_shard, ext
        self.masked = masked
        self.pending: list[_Tokens] = []
        self.pending_mask: list[np.ndarray] = []  # masked: the pending tokens' bits
        self.pending_len = 0
        self.entries: list[Entry] = []
        self.documents = 0
        self.stream_tokens = 0  # tokens including separators

    def add(self, arr: _Tokens, ndocs: int, mask: np.ndarray | None = None) -> None:
        if self.masked != (mask is not None) or (mask is not None and len(mask) != len(arr)):
            raise ValueError(f"a {'masked' if self.masked else 'plain'} packer needs one mask bit per token")
        self.pending.append(arr)
        if mask is not None:
            self.pending_mask.append(mask)
        self.pending_len += len(arr)
        self.documents += ndocs
        self.stream_tokens += len(arr)
        need = self.per_shard * self.seq_len + 1
        while self.pending_len >= need:
            stream, bits = self._joined()
            self._write(stream, self.per_shard, bits)
            cut = self.per_shard * self.seq_len
            self.pending, self.pending_len = [stream[cut:]], len(stream) - cut
            self.pending_mask = [] if bits is None else [bits[cut:]]

    def _joined(self) -> tuple[_Tokens, np.ndarray | None]:
        return np.concatenate(self.pending), np.concatenate(self.pending_mask) if self.masked else None

    def finish(self) -> int:
        """Write the last (smaller) shard; returns the number of tail tokens dropped."""
        if self.pending_len == 0:
            return 0
        stream, bits = self._joined()
        n = (len(stream) - 1) // self.seq_len
        if n > 0:
            self._write(stream, n, bits)
        dropped = len(stream) - n * self.seq_len - (1 if n else 0)
        self.pending, self.pending_mask, self.pending_len = [], [], 0
        return max(0, dropped)

    def _write(self, stream: _Tokens, n: int, bits: np.ndarray | None = None) -> None:
        T = self.seq_len
        idx = np.arange(n)[:, None] * T + np.arange(T + 1)[None, :]
        samples = stream[idx].astype(DTYPES[self.ext])
        stem = f"{self.split}-{len(self.entries):06d}"
        name = stem + ".tar"
        data = build_shard(stem, samples, self.ext, None if bits is None else bits[idx])
        sha = self.out.put_shard(name, data)
        # what a reader checks (shard_reader.py): the first sample's members
        head = hashlib.sha256(data[: sample_stride(T + 1, self.ext, self.masked)]).hexdigest()
        self.entries.append(
            {
                "name": name,
                "sequences": int(n),
                "tokens": int(n * T),
                "bytes": len(data),
                "sha256": sha,
                "head_sha256": head,
            }
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
    process's to handle (it undoes the run and ends the pool), not a traceback per worker; SIGTERM
    (the pool's own end, or a scheduler's to the group) ends it, whatever handler it was forked with."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
    chunks: Iterator[Chunk], submit: Callable[[_Task], _PendingChunk], sep_id: int, window: int
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


def tokenise_and_pack(
    chunks: Iterator[Chunk], tok: Tokenizer, packers: dict[str, Packer], workers: int, progress: bool, t_start: float
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
        for nbytes, splits, result in _in_submission_order(chunks, submit, tok.sep_id, window=2 * workers):
            for split, tokens in result.get().items():
                packers[split].add(tokens, splits.count(split))
            bar.update(nbytes)
            tokens_per_s = stream_tokens(packers) / max(1e-9, time.time() - t_start)
            shards = sum(len(p.entries) for p in packers.values())
            bar.set_postfix_str(f"{tokens_per_s / 1e6:.2f}M tok/s, {shards} shards", refresh=False)


def stream_tokens(packers: dict[str, Packer]) -> int:
    return sum(p.stream_tokens for p in packers.values())
