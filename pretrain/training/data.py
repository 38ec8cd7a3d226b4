"""The data of a run, through data_pipeline's one interface (data_pipeline/batches.py): the
training stream (one manifest's or a mixture's, in one global order whatever the ranks), each
source's validation batches, the tokens trained (in all and per source: the one count, saved with
every checkpoint, restored by a resume and a rollback), and what a mixture's draw looks like so far."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from data_pipeline.batches import TokenCount, open_train_batches, sources_of, with_split
from data_pipeline.epoch_plan import Batch
from data_pipeline.loader import TokenBatchLoader
from pretrain.runs.train_config import loader_workers
from pretrain.training.start.plan import allow_data_change

if TYPE_CHECKING:
    from data_pipeline.batches import TrainBatches
    from pretrain.training.start.plan import StartPlan

log = logging.getLogger("grt.train")


class RunData:
    def __init__(self, plan: StartPlan, rank: int, world: int, device: torch.device) -> None:
        self.plan, self.rank, self.world = plan, rank, world
        t, cuda = plan.cfg.train, device.type == "cuda"  # the rank's compute device
        self.loader = open_train_batches(
            plan.data,
            micro_batch_size=t.micro_batch_size,
            rank=rank,
            world_size=world,
            num_workers=loader_workers(t.num_workers, cuda),
            pin_memory=cuda,  # the workers' batches pinned: the step's copy is asynchronous
            seed=t.seed,
            global_batch=plan.global_batch,
            shuffle_buffer=t.shuffle_buffer,
            skip_corrupt=t.skip_corrupt_shards,
            stages=list(plan.stages),
            max_repeats=t.max_repeats,
        )
        self.weights = {s.name: s.weight for s in sources_of(plan.data)}  # one manifest: {"": 1.0}
        self.trained = TokenCount()  # the step runner counts each kept micro-batch's round into it
        self.capped_said: set[str] = set()  # the sources whose cap was said
        self.stage_said = 0  # the stage last said

    def continue_from(self, state: dict[str, Any]) -> None:
        """Go on where a checkpoint's loader state (or a rollback's record) says."""
        self.loader.load_state_dict(state, strict=not allow_data_change(self.plan.cfg))

    def restore_count(self, tokens: dict[str, int] | None, step: int, loader: dict[str, Any]) -> None:
        """The tokens trained by the checkpoint loaded (a resume's or a rollback's; `TokenCount.saved`)."""
        saved = TokenCount.saved(tokens, loader, step, self.plan.tokens_per_step, self.plan.data.seq_len)
        self.trained.restore(saved.state())

    def validation_batches(self) -> dict[str, list[Batch]] | None:
        """Each source's first train.eval_batches validation batches per rank ("" for a run on one
        manifest), read once: the batches `grt eval --data <that manifest>` scores. None: no source
        has a validation split."""
        t = self.plan.cfg.train
        by_source = {}
        for source in with_split(self.plan.data, "val"):
            loader = TokenBatchLoader(
                source.manifest,
                split="val",
                micro_batch_size=t.micro_batch_size,
                rank=self.rank,
                world_size=self.world,
                num_workers=0,
                seed=t.seed,
                shuffle_buffer=0,
                skip_corrupt=t.skip_corrupt_shards,
                expected_seq_len=source.manifest.seq_len,
                loop=False,
            )
            by_source[source.name] = list(itertools.islice(loader, t.eval_batches))
        return by_source or None

    def draw_scalars(self) -> dict[str, float]:
        """A mixture's realised draw: each source's training tokens so far and share of them
        (data/<source>/tokens, data/<source>/share); the sources that reached their cap and the
        stage in force said once. Nothing for one manifest."""
        draw = self.loader.draw()
        if draw is None:
            return {}
        for name, g in draw.at_cap.items():
            if name not in self.capped_said:
                self.capped_said.add(name)
                log.warning(
                    "mixture source %r reached train.max_repeats=%g at global batch %d: it is not drawn from there, "
                    "its weight shared among the other sources",
                    name,
                    self.plan.cfg.train.max_repeats,
                    g,
                )
        if draw.stage != self.stage_said:
            self.stage_said = draw.stage
            log.info(
                "mixture stage %d (train.data_stages) in force from global batch %d: weights %s",
                draw.stage,
                draw.stage_start,
                " ".join(f"{n}={w:g}" for n, w in draw.weights.items()),
            )
        trained = {n: self.trained.by_source.get(n, 0) for n in draw.tokens}
        total = max(sum(trained.values()), 1)
        values = {f"data/{n}/tokens": float(v) for n, v in trained.items()}
        values.update({f"data/{n}/share": v / total for n, v in trained.items()})
        values.update({f"data/{n}/at_cap": float(n in draw.at_cap) for n in draw.tokens})
        values["data/stage"] = float(draw.stage)
        return values

    def summary(self) -> dict[str, Any]:
        """What summary.json says of the data: the shards skipped, the tokens trained; a mixture's
        tokens trained by source."""
        out: dict[str, Any] = {"skipped_shards": self.loader.skipped_shards, "tokens": self.trained.total}
        draw = self.loader.draw()
        if draw is not None:
            by_source = {n: self.trained.by_source.get(n, 0) for n in draw.tokens}
            out.update(tokens_by_source=by_source, sources_at_cap=draw.at_cap)
        return out


def warn_on_skipped_shards(loader: TrainBatches, rank: int) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches, with a warning whenever it has skipped another unreadable shard."""
    seen = loader.skipped_shards
    for batch in loader:
        if loader.skipped_shards != seen:
            log.warning(
                "rank %d skipped %d unreadable shard(s) so far (train.skip_corrupt_shards): %s",
                rank,
                loader.skipped_shards,
                ", ".join(loader.bad_shards),
            )
            seen = loader.skipped_shards
        yield batch
