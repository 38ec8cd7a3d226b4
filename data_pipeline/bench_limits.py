"""What bounds `prepare` (for `grt bench data`): SentencePiece's own ``encode`` of the same text on
the same number of processes (the limit), reading the documents, and writing the shards.

The limit: the documents are read first, then each of ``workers`` forked processes encodes every
``workers``-th one with ``SentencePieceProcessor.encode`` and returns only its token count; nothing
is read, sent, packed or written while the clock runs. Two figures, text MB per second per process:
the documents cut as prepare cuts them (~1000-character pieces before newlines, the same tokens:
the limit), and whole documents, as a plain call would pass them (slower on long documents).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from typing import Any

from .manifest import Manifest
from .prepare_encode import segments
from .shards import DTYPES, build_shard, iter_shard, write_shard_atomic
from .sources import iter_documents

_docs: list[str] = []  # the text every encoding process shares (inherited by fork)


def read_documents(files: list[str], text_field: str, text_bytes: int) -> tuple[list[str], float]:
    """The first `text_bytes` of document text of `files` (what `prepare --max-mb` reads), and the
    seconds reading them took (decompression, JSON decoding, UTF-8 checks)."""
    t0 = time.perf_counter()
    docs, size = [], 0
    for text in iter_documents(files, text_field=text_field):
        if size >= text_bytes:
            break
        docs.append(text)
        size += len(text.encode("utf-8"))
    return docs, time.perf_counter() - t0


def _encode_share(job: tuple[str, int, int, bool]) -> tuple[int, float]:
    import sentencepiece as spm

    model, index, step, cut = job
    sp = spm.SentencePieceProcessor(model_file=model)
    share = [piece for d in _docs[index::step] for piece in segments(d)] if cut else _docs[index::step]
    t0 = time.perf_counter()
    tokens = sum(len(ids) for ids in sp.encode(share, out_type=int))
    return tokens, time.perf_counter() - t0


def encode_limit(docs: list[str], model: str, workers: int) -> dict[str, Any]:
    """SentencePiece's encode of `docs` on `workers` processes, cut as prepare cuts them (the
    limit) and whole: the wall time of evenly loaded processes, and MB/s per process."""
    global _docs
    _docs = docs
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    out: dict[str, Any] = {}
    try:
        context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with context.Pool(workers) as pool:
            for name, cut in (("encode_limit", True), ("encode_whole_docs", False)):
                results = pool.map(_encode_share, [(model, i, workers, cut) for i in range(workers)])
                busy = sum(s for _, s in results)  # per core: MB per second of encoding, however the shares fall
                out[f"{name}_s"] = round(busy / workers, 2)
                out[f"{name}_mb_per_s_per_core"] = round(mb / busy, 3)
                out[f"{name}_tokens"] = sum(t for t, _ in results)
    finally:
        _docs = []
    return out


def shard_write(m: Manifest, work: str) -> dict[str, Any]:
    """The shard write alone: the prepared train samples built into tars and written (fsynced,
    renamed) again, in this process."""
    import numpy as np

    out = os.path.join(work, "shard-write")
    os.makedirs(out, exist_ok=True)
    seconds, nbytes = 0.0, 0
    try:
        for s in m.shards("train"):
            payloads = [d for _, d in iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext)]
            samples = np.frombuffer(b"".join(payloads), DTYPES[m.ext]).reshape(len(payloads), m.seq_len + 1)
            t0 = time.perf_counter()
            data = build_shard(os.path.basename(s.url)[: -len(".tar")], samples, m.ext)
            write_shard_atomic(os.path.join(out, os.path.basename(s.url)), data)
            seconds += time.perf_counter() - t0
            nbytes += len(data)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"shard_write_s": round(seconds, 3), "shard_write_mb_per_s": round(nbytes / 1e6 / max(seconds, 1e-9), 1)}
