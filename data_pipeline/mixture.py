"""Training on a mixture of corpora: weighted manifests, stages, a repetition cap.

A run's ``data`` is one manifest path, or a mixture written ``name=weight:path`` per source,
comma-separated (``web=0.7:web/manifest.json,books=0.3:books/manifest.json``; on the command
line one ``--data`` per source). Every source must have the tokenizer and sequence length of
the first (refused in one line naming the source).

This module is the mixture's description: its sources and stages parsed and checked
(`DataMixture`), and the stage in force at a point of the run. The draws of its order are in
``data_pipeline.mixture_draws``, the per-rank loader in ``data_pipeline.mixture_loader``.

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
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .manifest import Manifest

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


def stage_at(stages: Sequence[Stage], tokens_read: int) -> int:
    """The stage in force at a global batch with `tokens_read` training tokens read before it: 0
    (the mixture's own weights) or i, the i-th stage, the last whose token count they have reached
    (tokens read, not batches: a changed global batch on resume moves no stage)."""
    return sum(1 for st in stages if tokens_read >= st.tokens)


def stage_start(tokens: float, tokens_per_sample: int, global_batch: int) -> int:
    """The first sample of the first global batch with `tokens` read before it (a run of one global batch)."""
    return math.ceil(tokens / (tokens_per_sample * global_batch)) * global_batch
