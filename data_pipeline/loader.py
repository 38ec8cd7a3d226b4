"""Streaming token batches from WebDataset shards: one global order, whatever the ranks.

How an epoch is laid out (see docs/data.md for the full description):

1. The split's shards are put in an order permuted by ``(seed, epoch)`` and seen as one
   virtual stream of N samples.
2. The stream is shuffled in blocks of ``shuffle_buffer`` samples (block b's permutation
   is seeded by ``(seed, epoch, b)``), which gives the epoch's *global order*: global
   position p is one stream sample. The order depends on the seed, the epoch, the shards
   and ``shuffle_buffer`` only: not on the number of ranks, loader workers, the
   micro-batch size or gradient accumulation.
3. Optimizer step g takes the global batch G = ``global_batch`` samples at global
   positions ``[g * G, (g + 1) * G)``; an epoch has ``N // G`` steps (the few samples
   past the last step are left out, a different few each epoch). Micro-batch round k
   (every rank's k-th batch of the epoch) covers positions ``[k * W * B, (k + 1) * W * B)``
   (W ranks, B micro-batch size) and rank r takes the r-th B of them. So a step's samples
   are the same set on any split of G into ranks x micro-batch x accumulation, and a
   resume on another world size continues the same global order (`load_state_dict`).
   Every rank has the same number of batches, so distributed training cannot hang on data.
4. Inside a rank, logical worker j (of Wk) produces the batches k with k % Wk == j; the
   DataLoader hands them out round-robin, so the batch order is fixed and independent of
   timing. A worker reads only its own samples: a local shard is read by seeking to its
   fixed-size members (the shard format makes member i's offset ``i * member_size``), a
   shard behind an ``http(s)://``, ``s3://`` or ``gs://`` URL by ranged requests for just
   those members (data_pipeline/remote.py); a ``pipe:`` or ``file:`` URL is streamed through
   webdataset, each worker reading the shuffle blocks that hold its samples.
5. Because every batch is a pure function of ``(seed, epoch, batch round)``, resuming needs
   only ``(epoch, samples consumed in the epoch)``: each worker goes straight to its next
   samples (nothing before them is read).
"""

from __future__ import annotations

import functools
import os
import signal
import tarfile
import warnings
from collections.abc import Generator, Iterator, Sequence
from typing import IO, Any, Protocol

import numpy as np
import torch

from .manifest import Manifest
from .remote import RandomAccess, RangedReader, is_ranged
from .shards import DTYPES, MEMBER_NAME, MissingShardError, ShardError, iter_shard, member_size

STATE_VERSION = 2

Batch = dict[str, torch.Tensor]
_Produced = tuple[Batch, int, list[str]]  # a batch, the shards found bad since the last one, and their URLs


DIGEST_MOD = (1 << 61) - 1


def sample_digest(input_ids: torch.Tensor) -> int:
    """An order-free digest of a batch's samples (the sum of a hash of each row, mod 2**61 - 1):
    the digests of a step's micro-batches, summed over the ranks, are the same on any split of
    the step into ranks and micro-batches, so runs can be compared sample set by sample set."""
    rows = input_ids.to(torch.int64)
    hashed = (rows * _digest_weights(rows.shape[1])).sum(dim=1) % DIGEST_MOD  # int64 wraps: the same everywhere
    return int(hashed.sum()) % DIGEST_MOD


@functools.cache
def _digest_weights(length: int) -> torch.Tensor:
    """Each position's multiplier in a row's hash: made once per sequence length, not per batch."""
    return torch.arange(1, length + 1, dtype=torch.int64) * 0x9E3779B1


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith(("pipe:", "file:"))


class ShardReader:
    """One worker's reads: samples of a shard by their index, seeking in a local file with the
    fixed-size member layout, else streaming forward through webdataset (one open stream,
    reused while the indices grow). Every member is checked as `iter_shard` checks it."""

    def __init__(
        self, sequences: Sequence[int], sample_tokens: int, ext: str, vocab_size: int | None, max_open: int = 1
    ) -> None:
        self.sequences, self.sample_tokens, self.ext, self.vocab_size = sequences, sample_tokens, ext, vocab_size
        self.nbytes = sample_tokens * DTYPES[ext].itemsize
        self.stride = member_size(sample_tokens, ext)
        self.seekable: dict[int, bool] = {}  # shard -> read by seeking (a local file of fixed-size members)
        # the local shards open now, least recently used first: a worker moves through the stream in
        # order, so it needs one at a time (a mixture's reader jumps between a few); never all of an
        # epoch's, which may be thousands
        self.files: dict[int, IO[bytes]] = {}
        self.max_open = max_open
        self.stream: tuple[int, Generator[tuple[int, bytes], None, None], int] | None = None  # shard, samples, next
        self.ranged = RangedReader()  # http(s)://, s3://, gs:// shards

    def read(self, shard: int, url: str, indices: list[int]) -> list[bytes]:
        """The payloads of samples `indices` (increasing) of shard number `shard`; ShardError."""
        if is_ranged(url):  # behind a URL: only these members, by ranged requests
            fetched = self.ranged.fetch(url, self.sequences[shard] * self.stride + 1024, self.stride, indices)
            return [self._member(fetched, url, i) for i in indices]
        fh = self._local(shard, url)
        if fh is None:
            return self._streamed(shard, url, indices)
        return [self._member(fh, url, i) for i in indices]

    def _local(self, shard: int, url: str) -> IO[bytes] | None:
        """The open file of shard `shard` when it is read by seeking, None when it is streamed;
        its size and first member are checked when it is first opened."""
        if shard in self.files:
            self.files[shard] = self.files.pop(shard)  # now the most recently used
            return self.files[shard]
        if not self.seekable.get(shard, _is_local(url)):
            return None
        while len(self.files) >= self.max_open:
            self.files.pop(next(iter(self.files))).close()
        first_open = shard not in self.seekable
        if first_open:
            if not os.path.exists(url):
                raise MissingShardError(url, "no such file")
            need = self.sequences[shard] * self.stride + 1024  # the members, then tar's two end blocks
            size = os.path.getsize(url)
            if size < need:
                raise ShardError(url, f"truncated: {size} bytes, the {self.sequences[shard]} samples need {need}")
        try:
            fh = open(url, "rb")  # noqa: SIM115 (kept open while the worker reads this shard, closed by _close_file)
        except OSError as exc:  # gone since it was first opened, or unreadable
            raise MissingShardError(url, f"{type(exc).__name__}: {exc}") from None
        if first_open:
            self.seekable[shard] = self._fixed_layout(fh)
            if not self.seekable[shard]:  # written by another tar writer (e.g. extended headers): streamed instead
                fh.close()
                return None
        self.files[shard] = fh
        return fh

    def _fixed_layout(self, fh: IO[bytes]) -> bool:
        try:
            info = tarfile.TarInfo.frombuf(fh.read(512), "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return False
        m = MEMBER_NAME.match(info.name)
        return info.size == self.nbytes and m is not None and int(m.group("idx")) == 0 and info.type == tarfile.REGTYPE

    def _member(self, fh: RandomAccess, url: str, index: int) -> bytes:
        fh.seek(index * self.stride)
        header = fh.read(512)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise ShardError(url, f"member {index} has a bad tar header ({type(exc).__name__}: {exc})") from None
        m = MEMBER_NAME.match(info.name)
        if m is None or m.group("ext") != self.ext or int(m.group("idx")) != index:
            raise ShardError(url, f"unexpected member {info.name!r} at position {index} (want index {index:07d})")
        if info.size != self.nbytes:
            raise ShardError(url, f"member {info.name!r} has {info.size} bytes, want {self.nbytes}")
        data = fh.read(self.nbytes)
        if len(data) != self.nbytes:
            raise ShardError(url, f"member {info.name!r} is cut off after {len(data)} of {self.nbytes} bytes")
        dtype = DTYPES[self.ext]
        if self.vocab_size is not None and int(np.frombuffer(data, dtype).max()) >= self.vocab_size:
            raise ShardError(url, f"member {info.name!r} holds a token id >= vocab size {self.vocab_size}")
        return data

    def _streamed(self, shard: int, url: str, indices: list[int]) -> list[bytes]:
        if self.stream is None or self.stream[0] != shard or self.stream[2] > indices[0]:
            self._close_stream()
            samples = iter_shard(
                url, self.sequences[shard], self.sample_tokens, self.ext, start=indices[0], vocab_size=self.vocab_size
            )
            self.stream = (shard, samples, indices[0])
        _, samples, _ = self.stream
        wanted, out = set(indices), []
        try:
            for i, data in samples:
                if i in wanted:
                    out.append(data)
                if i >= indices[-1]:
                    self.stream = (shard, samples, i + 1)
                    return out
        except ShardError:
            self._close_stream()
            raise
        self._close_stream()
        raise ShardError(url, f"ended before sample {indices[-1]}")

    def _close_stream(self) -> None:
        if self.stream is not None:
            self.stream[1].close()
            self.stream = None

    def _close_file(self) -> None:
        for fh in self.files.values():
            fh.close()
        self.files.clear()

    def close(self) -> None:
        self._close_stream()
        self._close_file()
        self.ranged.close()


class EpochPlan:
    """Everything a worker needs to produce its batches of one epoch (picklable)."""

    def __init__(
        self,
        *,
        urls: Sequence[str],
        sequences: Sequence[int],
        epoch: int,
        seed: int,
        rank: int,
        world_size: int,
        num_workers: int,
        batch_size: int,
        batches: int,
        start_batch: int,
        shuffle_buffer: int,
        shuffle_shards: bool,
        seq_len: int,
        ext: str,
        sep_id: int,
        vocab_size: int | None,
        skip_corrupt: bool,
    ) -> None:
        self.urls, self.sequences, self.epoch, self.seed = list(urls), list(sequences), epoch, seed
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.batch_size, self.batches, self.start_batch = batch_size, batches, start_batch
        self.shuffle_buffer, self.shuffle_shards, self.skip_corrupt = shuffle_buffer, shuffle_shards, skip_corrupt
        self.seq_len, self.ext, self.sep_id, self.vocab_size = seq_len, ext, sep_id, vocab_size
        n = len(urls)
        if shuffle_shards:
            order = np.random.default_rng([seed, epoch, 0x5A4D]).permutation(n)
        else:
            order = np.arange(n)
        self.order = order
        counts = np.asarray(sequences, dtype=np.int64)[order]
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.total = int(self.starts[-1])
        # the unit of reading: a shuffle block, or (no shuffle) a window of the same bound
        self.block = shuffle_buffer if shuffle_buffer > 1 else max(batch_size, 256)

    def worker_batches(self, j: int) -> range:
        """The batch rounds worker j produces: k % num_workers == j, from start_batch on."""
        W = self.num_workers
        first = self.start_batch + (j - self.start_batch) % W
        return range(first, self.batches, W)

    def positions(self, k: int) -> range:
        """The global positions of this rank's batch in round k."""
        B = self.batch_size
        first = k * self.world_size * B + self.rank * B
        return range(first, first + B)

    def stream_positions(self, block: int, offsets: np.ndarray) -> np.ndarray:
        """Where the global positions `block * self.block + offsets` lie in the stream."""
        base = block * self.block
        if self.shuffle_buffer <= 1:
            return base + offsets
        size = min(self.block, self.total - base)
        perm = np.random.default_rng([self.seed, self.epoch, block, 0xB10C]).permutation(size)
        return base + perm[offsets]

    def batches_for_worker(self, j: int, report: dict[str, Any]) -> Iterator[Batch]:
        """Worker j's batches in order: for each shuffle block its samples are read at once
        (sorted by stream position), then handed out batch by batch."""
        reader = ShardReader(self.sequences, self.seq_len + 1, self.ext, self.vocab_size)
        rounds = self.worker_batches(j)
        try:
            loaded: dict[int, bytes] = {}
            loaded_block = -1
            for k in rounds:
                batch = []
                for p in self.positions(k):
                    block = p // self.block
                    if block != loaded_block:
                        loaded = self._read_block(reader, block, rounds, k, report)
                        loaded_block = block
                    batch.append(loaded.pop(p))
                yield self.collate(batch)
        finally:
            reader.close()

    def _read_block(
        self, reader: ShardReader, block: int, rounds: range, k: int, report: dict[str, Any]
    ) -> dict[int, bytes]:
        """The payloads of every global position of block `block` that this worker's rounds
        from `k` on need, by global position."""
        lo, hi = block * self.block, (block + 1) * self.block
        wanted: list[int] = []
        for later in rounds[rounds.index(k) :]:
            span = self.positions(later)
            if span.start >= hi:
                break
            wanted.extend(p for p in span if lo <= p < hi)
        where = self.stream_positions(block, np.asarray(wanted, dtype=np.int64) - lo)
        payloads = self.read_stream(reader, where.tolist(), report)
        return dict(zip(wanted, payloads, strict=True))

    def read_stream(self, reader: ShardReader, positions: list[int], report: dict[str, Any]) -> list[bytes]:
        """The payloads at stream `positions`. A corrupt or missing shard raises ShardError,
        or, with skip_corrupt, is reported and each of its samples is replaced by the sample one
        shard length further on in the stream (wrapping around), so the number of batches
        never changes."""
        bad = report.setdefault("bad", set())
        out: dict[int, bytes] = {}
        todo = {i: p for i, p in enumerate(positions)}
        moved = dict.fromkeys(todo, 0)
        while todo:
            by_shard: dict[int, list[tuple[int, int]]] = {}
            for i, p in todo.items():
                s = int(np.searchsorted(self.starts, p, side="right") - 1)
                by_shard.setdefault(s, []).append((p - int(self.starts[s]), i))
            retry: dict[int, int] = {}
            for s, wants in sorted(by_shard.items()):
                shard = int(self.order[s])
                url = self.urls[shard]
                wants.sort()
                if url not in bad:
                    try:
                        for (_, i), data in zip(wants, reader.read(shard, url, [o for o, _ in wants]), strict=True):
                            out[i] = data
                        continue
                    except ShardError as exc:
                        if not self.skip_corrupt:
                            raise
                        warnings.warn(f"skipping {exc} (skip_corrupt=True)", RuntimeWarning, stacklevel=2)
                        bad.add(url)
                        report["new"] = report.get("new", 0) + 1
                for _, i in wants:
                    moved[i] += self.sequences[shard]
                    if moved[i] > 2 * self.total:
                        raise RuntimeError(f"every shard of the split is unreadable ({sorted(bad)})")
                    retry[i] = (positions[i] + moved[i]) % self.total
            todo = retry
        return [out[i] for i in range(len(positions))]

    def collate(self, payloads: list[bytes]) -> Batch:
        return collate(payloads, self.seq_len, self.ext, self.sep_id)


def collate(payloads: list[bytes], seq_len: int, ext: str, sep_id: int) -> Batch:
    """A batch of stored samples (seq_len + 1 tokens each): inputs, targets shifted by one, and
    each position's document within its row."""
    arr = np.frombuffer(b"".join(payloads), dtype=DTYPES[ext]).reshape(len(payloads), seq_len + 1)
    x = torch.from_numpy(arr.astype(np.int64))
    inp = x[:, :-1].contiguous()
    tgt = x[:, 1:].contiguous()
    doc = torch.cumsum(inp == sep_id, dim=1, dtype=torch.int32)
    doc -= doc[:, :1].clone()
    return {"input_ids": inp, "targets": tgt, "doc_ids": doc}


class WorkerPlan(Protocol):
    """What `_EpochDataset` runs in each loader worker: an epoch's plan, or a mixture's."""

    start_batch: int
    num_workers: int

    def batches_for_worker(self, j: int, report: dict[str, Any]) -> Iterator[Batch]: ...


class _EpochDataset(torch.utils.data.IterableDataset):
    def __init__(self, plan: WorkerPlan) -> None:
        super().__init__()
        self.plan = plan

    def __iter__(self) -> Iterator[_Produced]:
        info = torch.utils.data.get_worker_info()
        # The DataLoader asks its workers round-robin starting with worker 0, and the next
        # batch due is number start_batch: worker i plays logical worker
        # (start_batch + i) % W so that batch k always comes from logical worker k % W.
        i = 0 if info is None else info.id
        j = (self.plan.start_batch + i) % self.plan.num_workers
        report: dict[str, Any] = {}
        for batch in self.plan.batches_for_worker(j, report):
            new = report.pop("new", 0)
            yield batch, new, sorted(report.get("bad", ())) if new else []


def produced(plan: WorkerPlan, num_workers: int, pin_memory: bool, prefetch_factor: int) -> Iterator[_Produced]:
    """The plan's batches in order: made here (num_workers 0) or by a DataLoader's workers."""
    dataset = _EpochDataset(plan)
    if num_workers == 0:
        return iter(dataset)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=False,
        worker_init_fn=_ignore_stop_signals,
    )
    return iter(loader)


def _ignore_stop_signals(_worker_id: int) -> None:
    """Slurm and the deepspeed launcher signal every process of a job: the trainer saves a
    checkpoint on SIGTERM/SIGUSR1, so its loader workers must not die first (they exit with
    their parent)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class TokenBatchLoader:
    """Per-rank iterator of ``{"input_ids", "targets", "doc_ids"}`` batches; see module doc.

    ``input_ids``/``targets``: LongTensor [B, seq_len] (targets = inputs shifted by one,
    both cut from one stored sample of seq_len + 1 tokens). ``doc_ids``: IntTensor
    [B, seq_len], the index of the document each position belongs to within its row
    (a separator starts a new document; the first position is document 0). Attention
    restricted to ``doc_ids[q] == doc_ids[k]`` keeps documents apart.
    """

    def __init__(
        self,
        manifest: str | Manifest,
        split: str = "train",
        micro_batch_size: int = 8,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 1234,
        shuffle_buffer: int = 4096,
        skip_corrupt: bool = False,
        expected_seq_len: int | None = None,
        expected_tokenizer_sha256: str | None = None,
        loop: bool = True,
        shuffle_shards: bool = True,
        pin_memory: bool = False,
        prefetch_factor: int = 4,
        check_token_range: bool = True,
        global_batch: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        # a Manifest object: loaded (and its tokenizer hashed) once by the caller, shared by its loaders
        self.manifest = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
        self.manifest.check(expected_seq_len, expected_tokenizer_sha256)
        # Manifest.load refuses a missing tokenizer; a Manifest built by hand may lack one
        if os.path.isfile(self.manifest.tokenizer_path):
            self.manifest.verify_tokenizer()
        self.split = split
        self.shards = self.manifest.shards(split)
        if not self.shards:
            raise ValueError(f"split {split!r} of {self.manifest.path!r} has no shards")
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.num_workers = max(0, int(num_workers))
        self.seed, self.shuffle_buffer = int(seed), int(shuffle_buffer)
        self.skip_corrupt, self.loop, self.shuffle_shards = skip_corrupt, loop, shuffle_shards
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor
        self.check_token_range = check_token_range
        self.seq_len = self.manifest.seq_len
        self.num_sequences = sum(s.sequences for s in self.shards)
        round_size = world_size * micro_batch_size  # the samples of one batch round over the ranks
        self.global_batch = int(global_batch or round_size)
        if self.global_batch % round_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of world_size {world_size} x "
                f"micro_batch_size {micro_batch_size}"
            )
        steps = self.num_sequences // self.global_batch
        self.batches_per_epoch = steps * (self.global_batch // round_size)
        if self.batches_per_epoch == 0:
            msg = (
                f"split {split!r} of {self.manifest.path!r} has {self.num_sequences} sequences, fewer than one "
                f"batch per rank (world_size {world_size} x micro_batch_size {micro_batch_size}"
                + (f", global batch {self.global_batch}" if self.global_batch != round_size else "")
                + "); prepare more data or use smaller batches"
            )
            if loop:
                raise ValueError(msg)
            warnings.warn(msg + "; every rank gets 0 batches", RuntimeWarning, stacklevel=2)
        self.fingerprint = self.manifest.fingerprint(split)
        self.epoch = 0
        self.batch_in_epoch = 0
        self.samples_consumed = 0
        self.skipped_shards = 0
        self.bad_shards: list[str] = []

    # -- iteration -------------------------------------------------------------------
    def __len__(self) -> int:
        return self.batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.batch_in_epoch = int(epoch), 0

    def draw(self) -> None:
        """One manifest draws from no other source (batches.TrainBatches: a mixture's draw)."""
        return None

    def _plan(self) -> EpochPlan:
        return EpochPlan(
            urls=[s.url for s in self.shards],
            sequences=[s.sequences for s in self.shards],
            epoch=self.epoch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=max(1, self.num_workers),
            batch_size=self.micro_batch_size,
            batches=self.batches_per_epoch,
            start_batch=self.batch_in_epoch,
            shuffle_buffer=self.shuffle_buffer,
            shuffle_shards=self.shuffle_shards,
            seq_len=self.seq_len,
            ext=self.manifest.ext,
            sep_id=self.manifest.sep_id,
            vocab_size=self.manifest.vocab_size if self.check_token_range else None,
            skip_corrupt=self.skip_corrupt,
        )

    def _epoch_source(self) -> Iterator[_Produced]:
        return produced(self._plan(), self.num_workers, self.pin_memory, self.prefetch_factor)

    def __iter__(self) -> Iterator[Batch]:
        if not self.loop and self.batch_in_epoch >= self.batches_per_epoch:
            self.batch_in_epoch = 0  # a new pass over the same (validation) epoch
        if self.batches_per_epoch == 0:
            return
        while True:
            if self.batch_in_epoch < self.batches_per_epoch:
                source = self._epoch_source()
                try:
                    for batch, new_bad, urls in source:
                        if new_bad:
                            self.skipped_shards += new_bad
                            self.bad_shards.extend(u for u in urls if u not in self.bad_shards)
                        self.batch_in_epoch += 1
                        self.samples_consumed += self.micro_batch_size
                        if self.loop and self.batch_in_epoch >= self.batches_per_epoch:
                            self.epoch += 1
                            self.batch_in_epoch = 0
                        yield batch
                        if self.batch_in_epoch == 0:
                            break  # epoch finished (loop=True): start the next one
                    else:
                        if self.loop:
                            raise RuntimeError(
                                f"rank {self.rank}: epoch {self.epoch} ended after "
                                f"{self.batch_in_epoch} of {self.batches_per_epoch} batches"
                            )
                finally:
                    del source
                if not self.loop:
                    if self.batch_in_epoch < self.batches_per_epoch:
                        raise RuntimeError(
                            f"rank {self.rank}: epoch {self.epoch} ended after {self.batch_in_epoch} "
                            f"of {self.batches_per_epoch} batches"
                        )
                    return
            elif self.loop:
                self.epoch += 1
                self.batch_in_epoch = 0
            else:
                return

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position after the batches already handed to the caller (JSON-serialisable):
        ``position`` is the global position reached in the epoch (samples consumed by every
        rank together), the same whatever the split into ranks."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "position": self.batch_in_epoch * self.world_size * self.micro_batch_size,
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": self.micro_batch_size,
            "global_batch": self.global_batch,
            "shuffle_buffer": self.shuffle_buffer,
            "batches_per_epoch": self.batches_per_epoch,
            "skipped_shards": self.skipped_shards,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue exactly where ``state`` was taken, on any number of ranks and workers.

        The shard list must be the same (fingerprint), else ValueError (strict) or a
        warning. The global order depends on the seed, the shards, ``global_batch`` and
        ``shuffle_buffer`` only: with those unchanged the loader continues at the saved
        global position, re-split over this loader's ranks (exact when the position is a
        whole number of this loader's batch rounds, as it is at every optimizer step). Any
        other change cannot continue the same order: the loader warns and resumes in the
        same epoch at the same fraction of samples consumed. A state of the previous
        loader version (each rank owning a contiguous range) resumes the same way.
        """
        version = int(state.get("version", 0))
        if version not in (1, STATE_VERSION):
            raise ValueError(f"loader state version {state.get('version')} is not one of 1, {STATE_VERSION}")
        if state.get("fingerprint") != self.fingerprint:
            msg = (
                f"loader state was saved for shard list {state.get('fingerprint')} but split {self.split!r} of "
                f"{self.manifest.path!r} has fingerprint {self.fingerprint}"
            )
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + "; resuming anyway", RuntimeWarning, stacklevel=2)
        if int(state["seed"]) != self.seed:
            warnings.warn(
                f"loader state has seed {state['seed']}, constructor seed {self.seed}: using the state's",
                RuntimeWarning,
                stacklevel=2,
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.skipped_shards = int(state.get("skipped_shards", 0))
        old_world = int(state["world_size"])
        position = int(state["batch_in_epoch"]) * int(state["micro_batch_size"]) * old_world
        round_size = self.world_size * self.micro_batch_size
        # a rank's count, from the global count: the same on the same world size
        self.samples_consumed = int(state.get("samples_consumed", 0)) * old_world // self.world_size
        order = ("global_batch", "shuffle_buffer")
        saved_order = {"global_batch": state.get("global_batch"), "shuffle_buffer": state.get("shuffle_buffer")}
        same_order = version == STATE_VERSION and all(saved_order[k] == getattr(self, k) for k in order)
        self.batch_in_epoch = min(self.batches_per_epoch, position // round_size)
        if not same_order:
            now = {k: getattr(self, k) for k in order}
            what = "by an older loader version" if version != STATE_VERSION else f"with {saved_order}"
            warnings.warn(
                f"loader order changed: the state was saved {what}, this loader has {now}: resuming epoch "
                f"{self.epoch} at batch "
                f"{self.batch_in_epoch}, the same fraction of the epoch, not the exact sequence of the original run",
                RuntimeWarning,
                stacklevel=2,
            )
        elif position % round_size:
            warnings.warn(
                f"loader state is at global position {position} of epoch {self.epoch}, not a whole number of batch "
                f"rounds of {round_size} (world_size {self.world_size} x micro_batch_size {self.micro_batch_size}): "
                f"resuming at position {self.batch_in_epoch * round_size}",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.loop and self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
