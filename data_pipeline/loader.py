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
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .epoch_plan import Batch, EpochPlan, Produced, produced
from .manifest import Manifest

STATE_VERSION = 2


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

    def draw(self) -> None:
        """One manifest draws from no other source (batches.TrainBatches: a mixture's draw)."""
        return None

    def _plan_args(self) -> dict[str, Any]:
        return dict(
            urls=[s.url for s in self.shards],
            sequences=[s.sequences for s in self.shards],
            identities=[(s.bytes, s.head_sha256) for s in self.shards],
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
            masked=self.manifest.masked,
        )

    def _plan(self) -> EpochPlan:
        return EpochPlan(**self._plan_args())

    def _epoch_source(self) -> Iterator[Produced]:
        """This epoch's batches from the position reached; looping, every later epoch's after them
        from the same workers (`Epochs`): no worker restarts at an epoch's end."""
        plan = Epochs(self._plan_args()) if self.loop else self._plan()
        return produced(plan, self.num_workers, self.pin_memory, self.prefetch_factor)

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


class Epochs:
    """A looping loader's batches from (epoch, start_batch) on, epoch after epoch, as one worker plan
    (picklable): the DataLoader's workers live for the whole iteration. The DataLoader asks its
    workers round-robin across the epochs' boundary, so in epoch e + m, m epochs on, logical worker
    j of the first epoch plays logical worker (j - m * batches) % W: batch k of every epoch still
    comes from the worker the order assigns it."""

    def __init__(self, first: dict[str, Any]) -> None:
        self.first, self.batches = first, int(first["batches"])
        self.start_batch, self.num_workers = int(first["start_batch"]), int(first["num_workers"])

    def batches_for_worker(self, j: int, report: dict[str, Any]) -> Iterator[Batch]:
        m = 0
        while True:
            args = self.first if m == 0 else {**self.first, "epoch": self.first["epoch"] + m, "start_batch": 0}
            epoch_report: dict[str, Any] = {}  # a bad shard is reported in each epoch, as by a new worker
            for batch in EpochPlan(**args).batches_for_worker((j - m * self.batches) % self.num_workers, epoch_report):
                report["new"] = report.get("new", 0) + epoch_report.pop("new", 0)
                report["bad"] = epoch_report.get("bad", set())
                yield batch
            m += 1
