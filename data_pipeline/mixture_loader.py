"""The per-rank loader of a mixture (`MixtureLoader`; its order: data_pipeline/mixture.py's
module doc): it hands a `mixture_draws.MixturePlan` to its workers and follows the draws itself,
for its state and the repetition cap.

The loader state holds the position and the cursors at the start of the current global batch:
a resume, on any number of ranks, continues the same order.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .epoch_plan import Batch, produced
from .mixture import DataMixture, Draw, Stage, stage_at
from .mixture_draws import AllCapped, MixturePlan

STATE_VERSION = "mixture-1"


class MixtureLoader:
    """Per-rank iterator of ``{"input_ids", "targets", "doc_ids"}`` batches drawn from a mixture
    (data_pipeline/mixture.py's module doc); batches.TrainBatches, as `TokenBatchLoader`: ``epoch``
    is always 0 and ``batch_in_epoch`` counts the rounds since the start, so positions are global
    positions of the whole run."""

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

    def _plan(self) -> MixturePlan:
        return MixturePlan(
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

    def note_caps(self, plan: MixturePlan, g: int) -> None:
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
