"""Streaming token batches from WebDataset shards: equal per-rank counts, exact resume.

How an epoch is laid out (see docs/data.md for the full description):

1. The split's shards are put in an order permuted by ``(seed, epoch)`` and seen as one
   virtual stream of N samples.
2. Every rank gets ``batches_per_epoch = N // (world_size * micro_batch_size)`` batches:
   rank r owns the contiguous range ``[r * K * B, (r + 1) * K * B)`` of the stream
   (K = batches_per_epoch, B = micro batch size). The few samples past the last range are
   dropped for this epoch (a different few each epoch, as the shard order changes).
   The count depends only on N, B and world_size — never on the shard count — so every
   rank runs the same number of steps and distributed training cannot hang on data.
3. Inside a rank, logical worker j (of W) produces the batches k with k % W == j, i.e.
   ``ceil((K - j) / W)`` batches from its own contiguous sub-range; the DataLoader hands
   them out round-robin, so the batch order is fixed and independent of timing. Each
   worker opens only the shards its range overlaps (with webdataset, so local paths,
   ``file:``, ``pipe:`` and ``http(s)://`` URLs all work).
4. Shuffling is a bounded block shuffle: a worker reads ``shuffle_buffer`` consecutive
   samples of its range and emits them in a permutation seeded by
   ``(seed, epoch, rank, worker, block)``; memory is bounded by the buffer.
5. Because every batch is a pure function of ``(seed, epoch, batch index)``, resuming
   needs only ``(epoch, batches consumed)``: each worker skips directly to the block that
   holds its next batch (whole shards before it are never opened).
"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .manifest import Manifest
from .shards import DTYPES, ShardError, iter_shard

STATE_VERSION = 1

_Batch = dict[str, torch.Tensor]
_Produced = tuple[_Batch, int, list[str]]  # a batch, the shards found bad since the last one, and their URLs


class _EpochPlan:
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

    def worker_range(self, j: int) -> tuple[int, int, int]:
        """(first stream position, number of batches, batches already consumed) for worker j."""
        W, K, B = self.num_workers, self.batches, self.batch_size
        counts = [K // W + (1 if i < K % W else 0) for i in range(W)]
        first = self.rank * K * B + B * sum(counts[:j])
        done = max(0, -(-(self.start_batch - j) // W)) if self.start_batch > j else 0
        return first, counts[j], min(done, counts[j])

    def read(self, pos: int, count: int, report: dict[str, Any]) -> Generator[bytes, None, None]:
        """Exactly ``count`` sample payloads from stream position ``pos`` on.

        A corrupt or missing shard raises ShardError, or — with skip_corrupt — is reported
        and its lost samples are replaced by the samples that follow in the stream
        (wrapping around), so the number of batches never changes.
        """
        N = self.total
        remaining = count
        bad = report.setdefault("bad", set())
        travelled = 0
        while remaining > 0:
            if travelled > 2 * N:
                raise RuntimeError(f"every shard of the split is unreadable ({sorted(bad)})")
            p = pos % N
            s = int(np.searchsorted(self.starts, p, side="right") - 1)
            shard = int(self.order[s])
            off = p - int(self.starts[s])
            n_in = self.sequences[shard] - off
            url = self.urls[shard]
            if url in bad:
                pos += n_in
                travelled += n_in
                continue
            take = min(remaining, n_in)
            got = 0
            it = iter_shard(
                url, self.sequences[shard], self.seq_len + 1, self.ext, start=off, vocab_size=self.vocab_size
            )
            try:
                for _, data in it:
                    yield data
                    got += 1
                    if got == take:
                        break
            except ShardError as exc:
                if not self.skip_corrupt:
                    raise
                warnings.warn(f"skipping {exc} (skip_corrupt=True)", RuntimeWarning, stacklevel=2)
                bad.add(url)
                report["new"] = report.get("new", 0) + 1
                remaining -= got
                pos += n_in
                travelled += n_in
                continue
            finally:
                it.close()
            remaining -= take
            pos += take
            travelled += take

    def batches_for_worker(self, j: int, report: dict[str, Any]) -> Iterator[_Batch]:
        first, nb, done = self.worker_range(j)
        B = self.batch_size
        length = nb * B
        out_start = done * B
        if out_start >= length:
            return
        M = self.shuffle_buffer if self.shuffle_buffer > 1 else max(B, 256)
        block0 = out_start // M
        reader = self.read(first + block0 * M, length - block0 * M, report)
        skip = out_start - block0 * M
        batch: list[bytes] = []
        nblocks = -(-length // M)
        for b in range(block0, nblocks):
            n = min(M, length - b * M)
            window = [next(reader) for _ in range(n)]
            order: Iterable[int]
            if self.shuffle_buffer > 1:
                rng = np.random.default_rng([self.seed, self.epoch, self.rank, j, b, 0xB10C])
                order = rng.permutation(n)[skip:].tolist()
            else:
                order = range(skip, n)
            skip = 0
            for i in order:
                batch.append(window[i])
                if len(batch) == B:
                    yield self.collate(batch)
                    batch = []
        reader.close()

    def collate(self, payloads: list[bytes]) -> _Batch:
        arr = np.frombuffer(b"".join(payloads), dtype=DTYPES[self.ext]).reshape(len(payloads), self.seq_len + 1)
        x = torch.from_numpy(arr.astype(np.int64))
        inp = x[:, :-1].contiguous()
        tgt = x[:, 1:].contiguous()
        doc = torch.cumsum(inp == self.sep_id, dim=1, dtype=torch.int32)
        doc -= doc[:, :1].clone()
        return {"input_ids": inp, "targets": tgt, "doc_ids": doc}


class _EpochDataset(torch.utils.data.IterableDataset):
    def __init__(self, plan: _EpochPlan) -> None:
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
        self.batches_per_epoch = self.num_sequences // (world_size * micro_batch_size)
        if self.batches_per_epoch == 0:
            msg = (
                f"split {split!r} of {self.manifest.path!r} has {self.num_sequences} sequences, fewer than one "
                f"batch per rank (world_size {world_size} x micro_batch_size {micro_batch_size}); prepare more "
                f"data or use smaller batches"
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

    def _plan(self) -> _EpochPlan:
        return _EpochPlan(
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
        dataset = _EpochDataset(self._plan())
        if self.num_workers == 0:
            return iter(dataset)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=False,
            worker_init_fn=_ignore_stop_signals,
        )
        return iter(loader)

    def __iter__(self) -> Iterator[_Batch]:
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
        """Position after the batches already handed to the caller (JSON-serialisable)."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": self.micro_batch_size,
            "shuffle_buffer": self.shuffle_buffer,
            "batches_per_epoch": self.batches_per_epoch,
            "skipped_shards": self.skipped_shards,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue exactly where ``state`` was taken.

        The shard list must be the same (fingerprint), else ValueError (strict) or a
        warning. If world_size, num_workers, micro_batch_size or shuffle_buffer differ, the
        exact sequence cannot be reproduced: the loader warns and resumes in the same epoch
        at the same fraction of samples consumed.
        """
        if int(state.get("version", 0)) != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
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
        self.samples_consumed = int(state.get("samples_consumed", 0))
        self.skipped_shards = int(state.get("skipped_shards", 0))
        layout = ("world_size", "num_workers", "micro_batch_size", "shuffle_buffer")
        same = all(state.get(k) == getattr(self, k) for k in layout)
        if same:
            self.batch_in_epoch = int(state["batch_in_epoch"])
        else:
            old = {k: state.get(k) for k in layout}
            new = {k: getattr(self, k) for k in layout}
            done = int(state["batch_in_epoch"]) * int(state["micro_batch_size"]) * int(state["world_size"])
            self.batch_in_epoch = min(self.batches_per_epoch, done // (self.micro_batch_size * self.world_size))
            warnings.warn(
                f"loader layout changed {old} -> {new}: resuming epoch {self.epoch} at batch "
                f"{self.batch_in_epoch}, not the exact sequence of the original run",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.loop and self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
