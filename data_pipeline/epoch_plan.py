"""An epoch's batches for one rank and loader worker (the order described in data_pipeline/loader.py
and docs/data.md): `EpochPlan`, `collate`, and `produced`, which runs a plan in this process or
in a DataLoader's workers."""

from __future__ import annotations

import signal
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from .shard_reader import Identity, ShardReader
from .shards import DTYPES, ShardError, mask_bytes, unpack_masks

IGNORE_INDEX = -100  # a target the loss does not score (pretrain/model/loss.py's, which imports nothing from here)

Batch = dict[str, torch.Tensor]
Produced = tuple[Batch, int, list[str]]  # a batch, the shards found bad since the last one, and their URLs


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
        identities: Sequence[Identity] = (),
        masked: bool = False,
    ) -> None:
        self.masked = masked  # the samples carry loss masks (the manifest's loss_mask)
        self.urls, self.sequences, self.epoch, self.seed = list(urls), list(sequences), epoch, seed
        self.identities = list(identities)  # each shard's size and first member's sha256: checked when read
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
        reader = ShardReader(
            self.sequences, self.seq_len + 1, self.ext, self.vocab_size, identities=self.identities, masked=self.masked
        )
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
                    if (
                        moved[i] > 2 * self.total
                    ):  # a data error of one line, as one bad shard's (not a bug's traceback)
                        raise ShardError(
                            sorted(bad)[0],
                            f"it and every other shard of the split ({len(bad)} of {len(self.urls)}) are unreadable: "
                            "train.skip_corrupt_shards has nothing left to read; check the data "
                            "(grt data inspect --verify)",
                        )
                    retry[i] = (positions[i] + moved[i]) % self.total
            todo = retry
        return [out[i] for i in range(len(positions))]

    def collate(self, payloads: list[bytes]) -> Batch:
        return collate(payloads, self.seq_len, self.ext, self.sep_id)


def collate(payloads: list[bytes], seq_len: int, ext: str, sep_id: int) -> Batch:
    """A batch of stored samples (seq_len + 1 tokens each): inputs, targets shifted by one, and
    each position's document within its row. A payload with a loss mask after its tokens (a masked
    data set's, `ShardReader`) has the targets its mask leaves out set to IGNORE_INDEX, here on the
    host, so the mask reaches the device inside the targets: nothing more to copy or wait for."""
    T1, width = seq_len + 1, DTYPES[ext].itemsize
    nbytes = T1 * width
    masks = [p[nbytes:] for p in payloads]
    if any(masks):  # a mixture may put masked and unmasked sources' samples in one batch
        payloads = [p[:nbytes] for p in payloads]
    arr = np.frombuffer(b"".join(payloads), dtype=DTYPES[ext]).reshape(len(payloads), T1)
    x = torch.from_numpy(arr.astype(np.int64))
    inp = x[:, :-1].contiguous()
    tgt = x[:, 1:].contiguous()
    if any(masks):
        packed = np.frombuffer(b"".join(m or b"\xff" * mask_bytes(T1) for m in masks), dtype=np.uint8)
        scored = torch.from_numpy(unpack_masks(packed.reshape(len(masks), -1), T1)[:, 1:])
        tgt.masked_fill_(~scored, IGNORE_INDEX)
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

    def __iter__(self) -> Iterator[Produced]:
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


def produced(plan: WorkerPlan, num_workers: int, pin_memory: bool, prefetch_factor: int) -> Iterator[Produced]:
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
        # its workers' base seed from a generator of its own: drawn from the global stream, it took one
        # draw of the trainer's noise stream per loader start, one more on a resume than without one
        generator=torch.Generator(),
    )
    return iter(loader)


def _ignore_stop_signals(_worker_id: int) -> None:
    """Slurm and the deepspeed launcher signal every process of a job: the trainer saves a
    checkpoint on SIGTERM/SIGUSR1, so its loader workers must not die first (they exit with
    their parent)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
