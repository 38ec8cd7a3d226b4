"""Training on a mixture of corpora: weighted manifests, stages, a repetition cap.

A run's ``data`` is one manifest path, or a mixture written ``name=weight:path`` per source,
comma-separated (``web=0.7:web/manifest.json,books=0.3:books/manifest.json``; on the command
line one ``--data`` per source). Every source must have the tokenizer and sequence length of
the first (refused in one line naming the source).

How a mixture's order is made (docs/data.md, "Mixtures"):

1. Global batch g (G samples: every rank's micro-batches of optimizer step g) draws the source
   of each of its G positions from the weights in force at g, with a generator seeded by
   ``(seed, g)``: the weights are the stage's whose token count the data read so far has
   reached (``train.data_stages``), else the mixture's own.
2. Source s's n-th draw is sample n of the source's own endless stream: its train split in
   the single-manifest loader's global order (shard order and shuffle blocks of
   ``data_pipeline.loader``), epoch after epoch, each epoch ordered anew. So a batch is a pure
   function of ``(seed, g)`` and each source's draws before g (the *cursors*), whatever the
   number of ranks, loader workers, micro-batch size or gradient accumulation.
3. Positions are split into ranks and micro-batch rounds exactly as in the single-manifest
   loader: round k covers global positions ``[k * W * B, (k + 1) * W * B)``, rank r the r-th B.
4. ``train.max_repeats`` caps how many times a source's train split is read (a float: 1.5 =
   one and a half passes). A source at its cap is taken out of the draw, its weight shared
   among the others from that batch on, and said once (``MixtureLoader.exhausted``); the run
   is refused at the start when the sources cannot fill it (`check_budget`: each stage's span
   from the sources it draws). Reading ahead past the last batch the sources can fill is not an
   error: `AllCapped` is raised only where such a batch is asked for.

The loader state holds the position and the cursors at the start of the current global batch:
a resume, on any number of ranks, continues the same order.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .loader import Batch, EpochPlan, ShardReader, collate, produced
from .manifest import Manifest

STATE_VERSION = "mixture-1"
CHUNK_SAMPLES = 4096  # a worker reads this many of its samples at once
DRAW_WINDOW = 64  # global batches drawn at once (fewer near a source's cap)
_SOURCE = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*)=(?P<weight>[^:=]+):(?P<path>.+)$")


class MixtureError(ValueError):
    """A mixture or stage string that does not parse, or sources that do not go together."""


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float
    path: str


@dataclass(frozen=True)
class Stage:
    tokens: float  # from this many training tokens read on
    weights: dict[str, float]


def parse_sources(text: str) -> list[SourceSpec] | None:
    """The sources of a mixture string, or None for a plain manifest path. One line names
    what is wrong: an item that is not ``name=weight:path``, a repeated name, a weight that is
    not a number or is negative, or weights that are all zero."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    matches = [_SOURCE.match(item) for item in items]
    if not any(matches):
        return None
    bad = [item for item, m in zip(items, matches, strict=True) if m is None]
    if bad:
        raise MixtureError(f"data: {bad[0]!r} is not a mixture source; write each as name=weight:path/manifest.json")
    sources = []
    for m in matches:
        assert m is not None
        weight = _weight(m["name"], m["weight"], "data")
        sources.append(SourceSpec(m["name"], weight, m["path"].strip()))
    names = [s.name for s in sources]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise MixtureError(f"data: source name {repeated[0]!r} is given twice; every source needs its own name")
    _check_total({s.name: s.weight for s in sources}, "data")
    return sources


def _weight(name: str, text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise MixtureError(f"{where}: source {name!r} has weight {text!r}, not a number") from None
    if not math.isfinite(weight) or weight < 0:
        raise MixtureError(f"{where}: source {name!r} has weight {text!r}; a weight must be a finite number >= 0")
    return weight


def _check_total(weights: dict[str, float], where: str) -> None:
    if not any(weights.values()):
        raise MixtureError(f"{where}: every weight is zero ({weights}); at least one source needs a weight > 0")


def parse_stages(text: str, names: Sequence[str]) -> list[Stage]:
    """``train.data_stages``: ``TOKENS:name=w,name=w;TOKENS:...``, token counts increasing; a
    source left out of a stage gets weight 0. One line names a bad stage, an unknown source, a
    source given twice or weights all zero."""
    stages: list[Stage] = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        where = f"train.data_stages stage {part!r}"
        at, sep, rest = part.partition(":")
        try:
            tokens = float(at)
        except ValueError:
            tokens = math.nan
        if not sep or not math.isfinite(tokens) or tokens <= 0:
            raise MixtureError(f"{where}: expected TOKENS:name=weight,... with TOKENS a token count > 0 (e.g. 2e9)")
        weights, named = dict.fromkeys(names, 0.0), set()
        for item in (i.strip() for i in rest.split(",") if i.strip()):
            name, eq, value = item.partition("=")
            if not eq:
                raise MixtureError(f"{where}: {item!r} is not name=weight")
            if name.strip() not in weights:
                raise MixtureError(f"{where}: no source {name.strip()!r} in the mixture (its sources: {list(names)})")
            if name.strip() in named:
                raise MixtureError(f"{where}: source {name.strip()!r} is given twice; give each source one weight")
            named.add(name.strip())
            weights[name.strip()] = _weight(name.strip(), value.strip(), where)
        _check_total(weights, where)
        if stages and tokens <= stages[-1].tokens:
            raise MixtureError(f"{where}: stages must start at increasing token counts")
        stages.append(Stage(tokens, weights))
    return stages


@dataclass(frozen=True)
class Draw:
    """A mixture's realised draw after the completed global batches."""

    tokens: dict[str, int]  # training tokens drawn from each source
    at_cap: dict[str, int]  # the sources at train.max_repeats -> the global batch from which they are
    stage: int  # the stage in force (0: the mixture's own weights, i: the i-th of train.data_stages)
    stage_start: int  # the global batch it starts at
    weights: dict[str, float]  # its weights


@dataclass
class DataMixture:
    """The sources of a run's data, loaded and checked: each one's weight and manifest. The
    first source's manifest stands for the mixture's tokenizer and sample layout."""

    sources: list[SourceSpec]
    manifests: list[Manifest]
    text: str = ""
    _fingerprints: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, text: str, sources: list[SourceSpec]) -> DataMixture:
        """Load every source's manifest and check that they go together (one line naming the
        source that does not): the first one's tokenizer, sequence length and token width."""
        manifests = []
        for s in sources:
            try:
                manifests.append(Manifest.load(s.path))
            except (FileNotFoundError, ValueError, KeyError) as err:
                raise MixtureError(f"data: source {s.name!r}: {err}") from None
        first, head = manifests[0], sources[0]
        for s, m in zip(sources[1:], manifests[1:], strict=True):
            for what, mine, theirs in (
                ("tokenizer sha256", m.tokenizer_sha256[:16], first.tokenizer_sha256[:16]),
                ("seq_len", m.seq_len, first.seq_len),
                ("token width", m.ext, first.ext),
            ):
                if mine != theirs:
                    raise MixtureError(
                        f"data: source {s.name!r} ({s.path}) has {what} {mine}, source {head.name!r} has {theirs}: "
                        "every source of a mixture must be tokenised alike (one tokenizer, one sequence length)"
                    )
        for s, m in zip(sources, manifests, strict=True):
            if not m.splits.get("train"):
                raise MixtureError(f"data: source {s.name!r} ({m.path}) has no train split (it has {sorted(m.splits)})")
        return cls(sources, manifests, text)

    # what the trainer reads of a manifest, for the whole mixture: the first source's
    @property
    def manifest(self) -> Manifest:
        return self.manifests[0]

    @property
    def path(self) -> str:
        return self.text

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest.tokenizer_sha256

    @property
    def tokenizer_path(self) -> str:
        return self.manifest.tokenizer_path

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.sources}

    def fingerprint(self, split: str) -> str:
        """Every source's name and shard list (not the weights: a resume may change those)."""
        if split not in self._fingerprints:
            h = hashlib.sha256()
            for s, m in zip(self.sources, self.manifests, strict=True):
                h.update(f"{s.name}:{m.fingerprint(split) if split in m.splits else '-'}\n".encode())
            self._fingerprints[split] = h.hexdigest()[:16]
        return self._fingerprints[split]

    def sequences(self, split: str) -> int:
        return sum(self.source_sequences(split).values())

    def source_sequences(self, split: str) -> dict[str, int]:
        """Each source's samples in `split` (0 where it has none)."""
        return {s.name: (m.sequences(split) if split in m.splits else 0) for s, m in zip(self.sources, self.manifests)}

    def with_split(self, split: str) -> list[tuple[str, Manifest]]:
        """(name, manifest) of the sources that have `split` (per-source validation)."""
        return [(s.name, m) for s, m in zip(self.sources, self.manifests, strict=True) if m.splits.get(split)]

    def check_budget(
        self, samples: int, max_repeats: float, stages: list[Stage], tokens_per_sample: int, global_batch: int = 1
    ) -> None:
        """Refuse a run of `samples` samples (global batches of `global_batch`) that the sources cannot
        fill under the cap (one line): each stage's span drawn, in expectation, from the sources its
        weights draw (a source a stage gives weight 0 gives it nothing), a source at its cap out."""
        if not max_repeats:
            return
        have = self.source_sequences("train")
        caps = {n: int(max_repeats * have[n]) for n in self.names}
        starts = [stage_start(st.tokens, tokens_per_sample, global_batch) for st in stages]
        spans = zip([0, *starts], [*starts, math.inf], [self.weights, *(st.weights for st in stages)])
        left, filled = {n: float(c) for n, c in caps.items()}, 0.0
        for number, (start, end, weights) in enumerate(spans):
            if start >= samples:
                break
            need = min(end, samples) - max(start, filled)
            while need > 1e-6:
                live = {n: w for n, w in weights.items() if w > 0 and left[n] > 1e-6}
                if not live:
                    where = f" (stage {number}, {' '.join(f'{n}={w:g}' for n, w in weights.items())})" if number else ""
                    raise MixtureError(
                        f"the run reads {samples} samples ({samples * tokens_per_sample:.3g} tokens), but with "
                        f"train.max_repeats={max_repeats:g} the sources give at most {int(filled + 1e-6)} ({caps}), "
                        f"the sources drawn{where} running out there: raise train.max_repeats, add data, or shorten "
                        "the run"
                    )
                total = sum(live.values())
                take = min(need, *(left[n] * total / w for n, w in live.items()))
                for n, w in live.items():
                    left[n] -= take * w / total
                need, filled = need - take, filled + take


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


def stage_at(stages: Sequence[Stage], tokens_read: int) -> int:
    """The stage in force at a global batch with `tokens_read` training tokens read before it: 0
    (the mixture's own weights) or i, the i-th stage, the last whose token count they have reached
    (tokens read, not batches: a changed global batch on resume moves no stage)."""
    return sum(1 for st in stages if tokens_read >= st.tokens)


def stage_start(tokens: float, tokens_per_sample: int, global_batch: int) -> int:
    """The first sample of the first global batch with `tokens` read before it (a run of one global batch)."""
    return math.ceil(tokens / (tokens_per_sample * global_batch)) * global_batch


class _MixturePlan:
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
                        capped = err.with_traceback(None)  # kept without this frame (see __iter__ below)
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
        return ShardReader(sequences, self.seq_len + 1, self.ext, self.vocab_size, max_open=max_open)

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
            )
        return self._plans[key]

    def collate(self, payloads: list[bytes]) -> Batch:
        return collate(payloads, self.seq_len, self.ext, self.sep_id)


class MixtureLoader:
    """Per-rank iterator of ``{"input_ids", "targets", "doc_ids"}`` batches drawn from a mixture
    (module doc); batches.TrainBatches, as `TokenBatchLoader`: ``epoch`` is always 0 and
    ``batch_in_epoch`` counts the rounds since the start, so positions are global positions of
    the whole run."""

    def __init__(
        self,
        mixture: DataMixture,
        *,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 1234,
        global_batch: int | None = None,
        stages: list[Stage] | None = None,
        max_repeats: float = 0.0,
        shuffle_buffer: int = 4096,
        skip_corrupt: bool = False,
        check_token_range: bool = True,
        pin_memory: bool = False,
        prefetch_factor: int = 4,
    ) -> None:
        for m in mixture.manifests:
            m.verify_tokenizer()
        self.mixture, self.stages, self.max_repeats = mixture, list(stages or []), float(max_repeats)
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.num_workers, self.seed = max(0, int(num_workers)), int(seed)
        self.shuffle_buffer, self.skip_corrupt, self.check_token_range = (
            int(shuffle_buffer),
            skip_corrupt,
            check_token_range,
        )
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor
        round_size = world_size * micro_batch_size
        self.global_batch = int(global_batch or round_size)
        if self.global_batch % round_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of world_size {world_size} x "
                f"micro_batch_size {micro_batch_size}"
            )
        self.split = "train"
        self.seq_len = mixture.manifest.seq_len
        self.fingerprint = mixture.fingerprint("train")
        self.epoch = 0  # a mixture has no epochs: its sources have theirs
        self.batch_in_epoch = 0  # rounds handed out since the start of the run
        self.cursors = np.zeros(len(mixture.sources), dtype=np.int64)  # draws before the current global batch
        self.skipped_shards = 0
        self.bad_shards: list[str] = []
        self.exhausted: dict[str, int] = {}  # source -> the global batch from which it was at its cap
        self.round_tokens: dict[str, int] = {}  # each source's tokens in the round last handed out (every rank's)

    def _plan(self) -> _MixturePlan:
        return _MixturePlan(
            mixture=self.mixture,
            stages=self.stages,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=max(1, self.num_workers),
            batch_size=self.micro_batch_size,
            global_batch=self.global_batch,
            start_batch=self.batch_in_epoch,
            cursors=self.cursors.tolist(),
            max_repeats=self.max_repeats,
            shuffle_buffer=self.shuffle_buffer,
            skip_corrupt=self.skip_corrupt,
            check_token_range=self.check_token_range,
        )

    @property
    def global_batch_index(self) -> int:
        return self.batch_in_epoch * self.world_size * self.micro_batch_size // self.global_batch

    def stage(self) -> tuple[int, int, dict[str, float]]:
        """The stage in force at the current global batch: its number (0: the mixture's own
        weights, i: the i-th of train.data_stages), the global batch it starts at, its weights."""
        per_batch_tokens, read = self.global_batch * self.seq_len, int(self.cursors.sum()) * self.seq_len
        number = stage_at(self.stages, read)
        if number == 0:
            return 0, 0, self.mixture.weights
        stage = self.stages[number - 1]  # started at the first batch with its tokens read before it
        return number, self.global_batch_index - math.floor((read - stage.tokens) / per_batch_tokens), stage.weights

    def drawn_tokens(self) -> dict[str, int]:
        """Training tokens drawn from each source by the completed global batches."""
        return {n: int(c) * self.seq_len for n, c in zip(self.mixture.names, self.cursors, strict=True)}

    def draw(self) -> Draw:
        """The draw so far (batches.TrainBatches)."""
        stage, start, weights = self.stage()
        return Draw(self.drawn_tokens(), dict(self.exhausted), stage, start, weights)

    def __iter__(self) -> Iterator[Batch]:
        plan = self._plan()
        per_batch = plan.rounds_per_batch()
        source = produced(plan, self.num_workers, self.pin_memory, self.prefetch_factor)
        g, width, names = self.global_batch_index, self.world_size * self.micro_batch_size, self.mixture.names
        draws = plan.draws(g, self.cursors)  # the main process follows the draws, for the state and the cap
        sources, _, counts = next(draws)
        capped: AllCapped | None = None
        for batch, new_bad, urls in source:
            if capped is not None:  # a batch past the last the sources fill (the workers raise first)
                raise capped
            if new_bad:
                self.skipped_shards += new_bad
                self.bad_shards.extend(u for u in urls if u not in self.bad_shards)
            first = self.batch_in_epoch % per_batch * width
            mine = np.bincount(sources[first : first + width], minlength=len(names)) * self.seq_len
            self.round_tokens = dict(zip(names, mine.tolist(), strict=True))
            self.batch_in_epoch += 1
            if self.batch_in_epoch % per_batch == 0:
                self.cursors += counts
                g += 1
                self.note_caps(plan, g)
                try:
                    sources, _, counts = next(draws)
                except AllCapped as err:  # the run may end here: raised only if a later batch is asked for
                    # kept without its traceback, which holds this frame: frame -> capped -> frame would be a
                    # cycle, the DataLoader iterator (`source`) freed by the garbage collector after its queues'
                    # feeder threads, so its workers never hear the shutdown and the interpreter's exit waits forever
                    capped = err.with_traceback(None)
            yield batch

    def note_caps(self, plan: _MixturePlan, g: int) -> None:
        """Record each source that reached its cap (from global batch g on it is not drawn): the
        trainer says it once (`exhausted`)."""
        if not self.max_repeats:
            return
        for name, cap, cursor in zip(self.mixture.names, plan.caps, self.cursors, strict=True):
            if cap >= 0 and cursor >= cap and name not in self.exhausted:
                self.exhausted[name] = g

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "split": "train",
            "epoch": 0,
            "batch_in_epoch": self.batch_in_epoch,
            "position": self.batch_in_epoch * self.world_size * self.micro_batch_size,
            "global_batch_index": self.global_batch_index,
            "cursors": dict(zip(self.mixture.names, self.cursors.tolist(), strict=True)),
            "exhausted": dict(self.exhausted),
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "global_batch": self.global_batch,
            "shuffle_buffer": self.shuffle_buffer,
            "skipped_shards": self.skipped_shards,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue where `state` was taken, on any number of ranks. Refused (ValueError): the
        state of a single-manifest run, or of other sources (unless not strict: a warning)."""
        if state.get("version") != STATE_VERSION:
            msg = (
                f"loader state version {state.get('version')!r} is a single manifest's: a run started on one "
                "manifest does not continue its order on a mixture"
            )
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + "; the mixture starts at its beginning", RuntimeWarning, stacklevel=2)
            return
        if state.get("fingerprint") != self.fingerprint:
            msg = (
                f"loader state was saved for mixture sources {sorted(state.get('cursors', {}))} (fingerprint "
                f"{state.get('fingerprint')}), this mixture has {self.mixture.names} (fingerprint {self.fingerprint})"
            )
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + "; resuming anyway", RuntimeWarning, stacklevel=2)
        self.seed = int(state["seed"])
        self.skipped_shards = int(state.get("skipped_shards", 0))
        saved = state.get("cursors", {})
        self.cursors = np.asarray([int(saved.get(n, 0)) for n in self.mixture.names], dtype=np.int64)
        self.exhausted = {k: int(v) for k, v in state.get("exhausted", {}).items()}
        g = int(state["global_batch_index"])
        position = int(state["position"])
        round_size = self.world_size * self.micro_batch_size
        if int(state["global_batch"]) != self.global_batch:
            warnings.warn(
                f"loader order changed: the state was saved with global_batch {state['global_batch']}, this loader has "
                f"{self.global_batch}: the mixture goes on from its sources' positions with new draws",
                RuntimeWarning,
                stacklevel=2,
            )
            self.batch_in_epoch = g * self.global_batch // round_size
            return
        within = position - g * self.global_batch  # positions of global batch g already read
        if within % round_size:
            warnings.warn(
                f"loader state is at global position {position}, not a whole number of batch rounds of {round_size}: "
                f"resuming at position {position - within % round_size}",
                RuntimeWarning,
                stacklevel=2,
            )
        self.batch_in_epoch = (g * self.global_batch + within - within % round_size) // round_size
