"""The draws of a mixture's order (data_pipeline/mixture.py's module doc): `uniforms`, the
counter-based hash every worker and rank draws from, and `MixturePlan`, what a loader worker needs
to produce its batches (picklable). Apart from the mixture's description (data_pipeline/mixture.py),
which the run's settings read without the draws, and from the per-rank loader
(data_pipeline/mixture_loader.py) that hands the plan to its workers."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .epoch_plan import Batch, EpochPlan, collate
from .mixture import DataMixture, Stage, stage_at
from .shard_reader import ShardReader

CHUNK_SAMPLES = 4096  # a worker reads this many of its samples at once
DRAW_WINDOW = 64  # global batches drawn at once (fewer near a source's cap)


class AllCapped(RuntimeError):
    """Every source the weights in force draw from is at its cap: raised where a batch past it is needed."""


_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93], dtype=np.uint64)


def uniforms(seed: int, batches: np.ndarray, positions: np.ndarray, attempt: int) -> np.ndarray:
    """Uniforms in [0, 1), one per (global batch, position): a counter-based hash (splitmix64) of
    (seed, batch, position, attempt), so every worker and rank computes the same draw without a
    generator's state (and at a few microseconds per batch, not a seeded generator's 70).
    Shape [len(batches), len(positions)]; a batch's row is the same whatever else is asked."""
    rows = np.asarray(batches, dtype=np.uint64)[:, None]
    key = np.array([seed, attempt], dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64)[None, :] * _MIX[3] + rows * _MIX[1] + key[0] * _MIX[0] + key[1] * _MIX[2]
        for shift, mult in ((30, _MIX[1]), (27, _MIX[2])):
            z = (z ^ (z >> np.uint64(shift))) * mult
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


class MixturePlan:
    """What a worker needs to produce its batches (picklable): the draw of each global batch
    and, per source, the single-manifest epoch plans that order its stream."""

    def __init__(
        self,
        *,
        mixture: DataMixture,
        stages: list[Stage],
        seed: int,
        rank: int,
        world_size: int,
        num_workers: int,
        batch_size: int,
        global_batch: int,
        start_batch: int,
        cursors: Sequence[int],
        max_repeats: float,
        shuffle_buffer: int,
        skip_corrupt: bool,
        check_token_range: bool,
    ) -> None:
        self.seed, self.rank, self.world_size, self.num_workers = seed, rank, world_size, num_workers
        self.batch_size, self.global_batch, self.start_batch = batch_size, global_batch, start_batch
        self.start_cursors = np.asarray(cursors, dtype=np.int64)
        first = mixture.manifest
        self.seq_len, self.ext, self.sep_id = first.seq_len, first.ext, first.sep_id
        self.vocab_size = first.vocab_size if check_token_range else None
        self.shuffle_buffer, self.skip_corrupt = shuffle_buffer, skip_corrupt
        self.names = mixture.names
        self.shards = [m.shards("train") for m in mixture.manifests]
        self.masked = [m.masked for m in mixture.manifests]  # each source's: its own loss masks or none
        self.sizes = np.asarray([sum(s.sequences for s in shards) for shards in self.shards], dtype=np.int64)
        self.caps = np.floor(max_repeats * self.sizes).astype(np.int64) if max_repeats else np.full(len(self.sizes), -1)
        self.source_seeds = [
            int(np.random.SeedSequence([seed, zlib.crc32(n.encode())]).generate_state(1)[0]) for n in self.names
        ]
        self.base = np.asarray([mixture.weights[n] for n in self.names], dtype=np.float64)
        self.stages = list(stages)
        self.stage_weights = [self.base] + [np.asarray([st.weights[n] for n in self.names]) for st in stages]
        self.start_read = int(self.start_cursors.sum())  # samples read before global batch start_batch // rounds
        self._plans: dict[tuple[int, int], EpochPlan] = {}
        self._blocks: dict[tuple[int, int, int], np.ndarray] = {}

    # -- the draw ------------------------------------------------------------------------
    def weights_at(self, g: int) -> np.ndarray:
        """The weights in force at global batch g: the stage's of the tokens read before it (every
        global batch reads `global_batch` samples)."""
        read = self.start_read + (g - self.start_batch // self.rounds_per_batch()) * self.global_batch
        return self.stage_weights[stage_at(self.stages, read * self.seq_len)]

    def draw(self, g: int, cursors: np.ndarray) -> np.ndarray:
        """The source of each of global batch g's positions, given each source's draws before g:
        position i takes the source that `uniforms(seed, [g], [i], attempt)` falls in under the
        weights; a draw past a source's cap is drawn again (next attempt) from the others."""
        weights = self.weights_at(g).copy()
        capped = np.nonzero(self.caps >= 0)[0]
        left = self.caps - cursors
        weights[capped[left[capped] <= 0]] = 0.0
        out = np.empty(self.global_batch, dtype=np.int64)
        todo = np.arange(self.global_batch, dtype=np.int64)
        attempt = 0
        while todo.size:
            if not weights.any():
                raise AllCapped(
                    f"every source of the mixture is at its train.max_repeats cap at global batch {g} "
                    f"({[self.names[s] for s in capped]}): nothing left to draw"
                )
            cumulative = np.cumsum(weights)
            cumulative /= cumulative[-1]  # as `draws` computes it for a window: the same draws bit for bit
            picked = np.searchsorted(cumulative, uniforms(self.seed, np.array([g]), todo, attempt)[0], side="right")
            out[todo] = np.minimum(picked, len(weights) - 1)
            over = []
            for s in capped:
                mine = np.nonzero(out == s)[0]
                if mine.size > left[s]:
                    over.append(mine[max(left[s], 0) :])  # past the cap
                    weights[s] = 0.0
            todo = np.sort(np.concatenate(over)) if over else todo[:0]
            attempt += 1
        return out

    # -- a worker's batches --------------------------------------------------------------
    def rounds_per_batch(self) -> int:
        return self.global_batch // (self.world_size * self.batch_size)

    def worker_rounds(self, j: int) -> Iterator[int]:
        k = self.start_batch + (j - self.start_batch) % self.num_workers
        while True:
            yield k
            k += self.num_workers

    def batches_for_worker(self, j: int, report: dict[str, Any]) -> Iterator[Batch]:
        """Worker j's batches in order, read CHUNK_SAMPLES at a time: the chunk's samples of each
        source in one read (grouped by shard, as the single-manifest loader reads a block)."""
        readers = [self.reader(s) for s in range(len(self.names))]
        per_batch, B = self.rounds_per_batch(), self.batch_size
        g = self.start_batch // per_batch
        batches = self.draws(g, self.start_cursors)
        sources, draws, _ = next(batches)
        rounds = self.worker_rounds(j)
        per_chunk = max(1, CHUNK_SAMPLES // B)
        try:
            while True:
                chunk_sources, chunk_draws, capped = [], [], None
                for _ in range(per_chunk):
                    k = next(rounds)
                    try:
                        while k // per_batch > g:  # walk the draws up to this round's global batch
                            g += 1
                            sources, draws, _ = next(batches)
                    except AllCapped as err:  # read ahead past the last batch the sources fill: the rest first
                        capped = err.with_traceback(None)  # kept without this frame (see MixtureLoader.__iter__)
                        break
                    first = k * self.world_size * B + self.rank * B - g * self.global_batch
                    chunk_sources.append(sources[first : first + B])
                    chunk_draws.append(draws[first : first + B])
                if chunk_sources:
                    payloads = self.read(readers, np.concatenate(chunk_sources), np.concatenate(chunk_draws), report)
                    for i in range(len(chunk_sources)):
                        yield self.collate(payloads[i * B : (i + 1) * B])
                if capped is not None:  # only where a batch past the cap is asked for
                    raise capped
        finally:
            for reader in readers:
                reader.close()

    def draws(self, g: int, cursors: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Global batches g, g + 1, ...: each one's source at each position, which draw of that
        source it is (the source's draws before it, plus the same source's earlier positions), and
        its draws per source.
        Drawn a window of batches at once where no source can reach its cap inside the window."""
        cursors = np.array(cursors, dtype=np.int64)
        n, G = len(self.names), self.global_batch
        capped = self.caps >= 0
        while True:
            left = np.where(capped, self.caps - cursors, np.iinfo(np.int64).max)
            rows = np.arange(g, g + DRAW_WINDOW)
            weights = np.stack([self.weights_at(int(r)) for r in rows]) * (left > 0)  # a source at its cap: out
            live = (left > 0) & capped
            if (live.any() and left[live].min() < DRAW_WINDOW * G) or not weights.sum(axis=1).all():
                sources = self.draw(g, cursors)[None, :]  # near a cap: one batch at a time, the cap applied to each
            else:  # the same draws as `draw` gives one batch at a time
                cumulative = np.cumsum(weights, axis=1)
                cumulative /= cumulative[:, -1:]
                u = uniforms(self.seed, rows, np.arange(G, dtype=np.int64), 0)
                sources = np.minimum((u[:, :, None] >= cumulative[:, None, :]).sum(axis=2), n - 1)
            onehot = sources[:, :, None] == np.arange(n)
            within = np.cumsum(onehot, axis=1) - 1  # the same source's earlier positions in the batch
            counts = onehot.sum(axis=1)
            before = cursors + np.concatenate([np.zeros((1, n), np.int64), np.cumsum(counts, axis=0)[:-1]])
            numbers = np.take_along_axis(within, sources[:, :, None], axis=2)[:, :, 0] + np.take_along_axis(
                before, sources, axis=1
            )
            for row in range(sources.shape[0]):
                yield sources[row], numbers[row], counts[row]
            cursors = cursors + counts.sum(axis=0)
            g += sources.shape[0]

    def read(
        self, readers: list[ShardReader], sources: np.ndarray, draws: np.ndarray, report: dict[str, Any]
    ) -> list[bytes]:
        """The payloads of draws `draws` of sources `sources` (each source's n-th sample of its
        stream: epoch n // size, then that epoch's global order), in the order given."""
        out: list[bytes] = [b""] * len(sources)
        for s in np.unique(sources):
            slots = np.nonzero(sources == s)[0]
            epochs, within = np.divmod(draws[slots], self.sizes[s])
            for epoch in np.unique(epochs):
                plan = self.epoch_plan(int(s), int(epoch))
                in_epoch = epochs == epoch
                at = within[in_epoch]
                blocks = at // plan.block
                where = np.empty_like(at)
                for b in np.unique(blocks):
                    mine = blocks == b
                    where[mine] = self.block_order(int(s), int(epoch), int(b))[at[mine] - int(b) * plan.block]
                for slot, payload in zip(
                    slots[in_epoch], plan.read_stream(readers[s], where.tolist(), report), strict=True
                ):
                    out[int(slot)] = payload
        return out

    def reader(self, s: int) -> ShardReader:
        """Source s's reader. Its draws jump about the shards of its current shuffle block, so it
        keeps them open (a block's worth, at most 64), not one at a time as a single-manifest worker."""
        sequences = [e.sequences for e in self.shards[s]]
        block = self.epoch_plan(s, 0).block
        max_open = min(64, 2 + block // max(1, min(sequences)))
        identities = [(e.bytes, e.head_sha256) for e in self.shards[s]]
        return ShardReader(
            sequences,
            self.seq_len + 1,
            self.ext,
            self.vocab_size,
            max_open=max_open,
            identities=identities,
            masked=self.masked[s],
        )

    def block_order(self, s: int, epoch: int, block: int) -> np.ndarray:
        """Stream positions of source s's shuffle block `block` in its epoch `epoch`, in global
        order (`EpochPlan.stream_positions` of the whole block, kept while it is read)."""
        key = (s, epoch, block)
        if key not in self._blocks:
            if len(self._blocks) > 2 * len(self.names):
                self._blocks.clear()
            plan = self.epoch_plan(s, epoch)
            size = min(plan.block, plan.total - block * plan.block)
            self._blocks[key] = plan.stream_positions(block, np.arange(size))
        return self._blocks[key]

    def epoch_plan(self, s: int, epoch: int) -> EpochPlan:
        """Source s's order in its epoch `epoch` (the single-manifest loader's, a few kept)."""
        key = (s, epoch)
        if key not in self._plans:
            if len(self._plans) > 2 * len(self.names):
                self._plans.clear()
            shards = self.shards[s]
            self._plans[key] = EpochPlan(
                urls=[e.url for e in shards],
                sequences=[e.sequences for e in shards],
                epoch=epoch,
                seed=self.source_seeds[s],
                rank=0,
                world_size=1,
                num_workers=1,
                batch_size=1,
                batches=0,
                start_batch=0,
                shuffle_buffer=self.shuffle_buffer,
                shuffle_shards=True,
                seq_len=self.seq_len,
                ext=self.ext,
                sep_id=self.sep_id,
                vocab_size=self.vocab_size,
                skip_corrupt=self.skip_corrupt,
                masked=self.masked[s],
            )
        return self._plans[key]

    def collate(self, payloads: list[bytes]) -> Batch:
        return collate(payloads, self.seq_len, self.ext, self.sep_id)
