"""The one data interface of training: a run's data is one manifest or a mixture of them
(mixture.py), and both give the same things under the same names, so that nothing outside
this package asks which it has.

- `sources_of(data)`: the data as a list of weighted sources; one manifest is a one-source
  mixture whose source has no name ("") and weight 1;
- `open_train_batches(data, ...)`: the training stream of either, a `TrainBatches`
  (loader.TokenBatchLoader for one manifest, whose checkpointed state it keeps; mixture.MixtureLoader);
- `plan_stages(...)`: the stages a run draws under and the repetition cap checked against its length;
- `TokenCount`: the training tokens a run has trained, in all and per source (`round_tokens`: each
  round's, from the loader, on the host), saved with every checkpoint: the one count budgets,
  summaries and a rollback read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .epoch_plan import Batch
from .loader import TokenBatchLoader
from .manifest import Manifest
from .mixture import DataMixture, Draw, MixtureError, SourceSpec, Stage, parse_stages
from .mixture_loader import MixtureLoader


@dataclass(frozen=True)
class Source:
    name: str  # "" for a run on one manifest
    weight: float
    manifest: Manifest


class TrainBatches(Protocol):
    """The training stream of a run, in one global order whatever the ranks; its state resumes it
    on any number of ranks. `epoch` and `batch_in_epoch` are the position after the batches handed
    out (a mixture's epoch is always 0, its batches counted from the start of the run)."""

    epoch: int
    batch_in_epoch: int
    skipped_shards: int
    bad_shards: list[str]
    num_workers: int  # its loader processes on this rank (0: read in the training process)
    pin_memory: bool  # their batches in pinned host memory

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None: ...

    def draw(self) -> Draw | None:
        """A mixture's draw so far; None for one manifest (nothing is drawn between sources)."""
        ...


def sources_of(data: Manifest | DataMixture) -> list[Source]:
    """Every source of the data, in order: a mixture's by name and weight, one manifest's as the
    unnamed source ("", 1.0)."""
    if isinstance(data, DataMixture):
        return [Source(s.name, s.weight, m) for s, m in zip(data.sources, data.manifests, strict=True)]
    return [Source("", 1.0, data)]


def with_split(data: Manifest | DataMixture, split: str) -> list[Source]:
    """The sources that have `split` (per-source validation)."""
    return [s for s in sources_of(data) if s.manifest.splits.get(split)]


def plan_stages(
    data: Manifest | DataMixture, stages: str, max_repeats: float, samples: int, where: str, global_batch: int = 1
) -> list[Stage]:
    """The stages of `stages` (train.data_stages) for the data, and the run of `samples` training
    samples (global batches of `global_batch`) against the repetition cap: MixtureError (one line)
    when the sources cannot fill it, or stages are asked of one manifest (`where`: how the run names
    its data). The loader reads ahead of the run, but past a cap only for a batch that is trained
    (mixture_draws.AllCapped), so the run's own samples are what the cap must give."""
    if not isinstance(data, DataMixture):
        if stages:
            raise MixtureError(
                f"train.data_stages={stages!r} needs a mixture of sources (data=name=weight:path,...), "
                f"not one manifest ({where!r})"
            )
        data = DataMixture([SourceSpec("data", 1.0, where)], [data])
    parsed = parse_stages(stages, data.names)
    data.check_budget(samples, max_repeats, parsed, data.seq_len, global_batch)
    return parsed


def open_train_batches(
    data: Manifest | DataMixture,
    *,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int,
    seed: int,
    global_batch: int,
    shuffle_buffer: int,
    skip_corrupt: bool,
    stages: list[Stage],
    max_repeats: float,
    pin_memory: bool = False,
) -> TrainBatches:
    """The training stream: one manifest's train split, or a mixture's draws from its sources
    (`pin_memory`: the loader workers' batches in pinned host memory)."""
    common: dict[str, Any] = dict(
        micro_batch_size=micro_batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        seed=seed,
        global_batch=global_batch,
        shuffle_buffer=shuffle_buffer,
        skip_corrupt=skip_corrupt,
    )
    if isinstance(data, DataMixture):
        return MixtureLoader(data, stages=stages, max_repeats=max_repeats, **common)
    return TokenBatchLoader(data, split="train", expected_seq_len=data.seq_len, **common)


def round_tokens(loader: TrainBatches, world_size: int, micro_batch_size: int, seq_len: int) -> dict[str, int]:
    """Each source's tokens in the round (every rank's micro-batch) the loader last handed out, known
    on the host without reading the batch: one manifest's are its shape's, a mixture's its draw's."""
    if isinstance(loader, MixtureLoader):
        return dict(loader.round_tokens)
    return {"": world_size * micro_batch_size * seq_len}


@dataclass
class TokenCount:
    """The training tokens trained (the micro-batches a step kept, not those dropped or rolled back),
    per source ("" for one manifest). Its `state` travels with every checkpoint."""

    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_source.values())

    def add(self, tokens: dict[str, int]) -> None:
        for name, n in tokens.items():
            self.by_source[name] = self.by_source.get(name, 0) + n

    def state(self) -> dict[str, int]:
        return dict(self.by_source)

    def restore(self, state: dict[str, int]) -> None:
        self.by_source = {str(k): int(v) for k, v in state.items()}

    @classmethod
    def saved(
        cls, state: dict[str, int] | None, loader: dict[str, Any], step: int, per_step: int, seq_len: int
    ) -> TokenCount:
        """A checkpoint's count (`state`); one saved before the count: its loader's draws (a mixture's
        `loader` state), else its `step` steps of `per_step` tokens."""
        if state is None:
            cursors = loader.get("cursors")
            state = {n: int(c) * seq_len for n, c in cursors.items()} if cursors else {"": step * per_step}
        count = cls()
        count.restore(state)
        return count
