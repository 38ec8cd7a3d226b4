"""Evaluation during training: the validation loss at every exit depth (of each source and, for a
mixture, their mean under its weights), and the zero-shot tasks (task_eval.py). Both are
collectives: every rank runs them at the same steps."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from data_pipeline.epoch_plan import Batch
from pretrain.distributed import all_reduce, comm_device
from pretrain.training.metrics import MetricsWriter
from pretrain.training.step import move
from pretrain.training.task_eval import TaskEval

if TYPE_CHECKING:
    from pretrain.model.gpt import GPT

log = logging.getLogger("grt.train")


@torch.no_grad()
def evaluate_depths(
    model: torch.nn.Module, batches: Iterable[Batch], depths: list[int], device: torch.device, doc_mask: bool = False
) -> dict[int, float]:
    """Mean loss at each depth over the given batches, averaged over ranks (sum / count)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(depths) + 1, dtype=torch.float64, device=device)  # loss sums, then the count
    for batch in batches:
        idx, targets, doc_ids = move(batch, device, doc_mask)
        for i, r in enumerate(depths):
            totals[i] += model(idx, targets, n_loops=r, doc_ids=doc_ids, return_logits=False).loss.double()
        totals[-1] += 1
    values = all_reduce(totals.to(comm_device())).tolist()
    model.train(was_training)
    n = max(values[-1], 1.0)
    return {r: values[i] / n for i, r in enumerate(depths)}


class Validation:
    """The validation batches of each source ("" for a run on one manifest), scored every
    train.eval_every steps and at the last."""

    def __init__(
        self,
        batches: dict[str, list[Batch]],
        weights: dict[str, float],
        max_loops: int,
        every: int,
        doc_mask: bool,
        writer: MetricsWriter,
        device: torch.device,
    ) -> None:
        self.batches, self.weights, self.max_r, self.every = batches, weights, max_loops, every
        self.doc_mask, self.writer, self.device = doc_mask, writer, device

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

    def run(self, model: torch.nn.Module, step: int, tokens_seen: int, record: dict[str, Any]) -> dict[int, float]:
        """The loss at every exit depth: of each source (val/<source>/...) and, for a mixture, their
        mean under the mixture's weights (val/loss...), in TensorBoard and in the step's `record`
        (metrics.jsonl, under "val"). Returns the latter."""
        max_r = self.max_r
        depths = list(range(max_r + 1))
        per_source = {n: evaluate_depths(model, b, depths, self.device, self.doc_mask) for n, b in self.batches.items()}
        total = sum(self.weights[name] for name in per_source)
        by_depth = {k: sum(self.weights[n] * v[k] for n, v in per_source.items()) / total for k in depths}
        full = by_depth[max_r]
        values = {"val/loss": full, **{f"val/loss_depth_{k}": v for k, v in by_depth.items()}}
        for name, losses in per_source.items():
            if name:
                values[f"val/{name}/loss"] = losses[max_r]
                values.update({f"val/{name}/loss_depth_{k}": v for k, v in losses.items()})
        self.writer.scalars(step, values, tokens=tokens_seen)  # each also against tokens (by_tokens/)
        record["val"] = values
        for name, losses in [*((n, v) for n, v in per_source.items() if n), ("", by_depth)]:
            log.info(
                "validation at step %d%s: loss %.4f at full depth; by exit depth: %s",
                step,
                f", source {name}" if name else (" (the mixture's weighted mean)" if len(per_source) > 1 else ""),
                losses[max_r],
                " ".join(f"{k}:{v:.3f}" for k, v in losses.items()),
            )
        return by_depth


def score_tasks(
    tasks: TaskEval,
    model: GPT,
    step: int,
    tokens_seen: int,
    rank: int,
    world: int,
    device: torch.device,
    writer: MetricsWriter,
) -> None:
    """The zero-shot tasks at this step (train.eval_tasks_every, task_eval.py), on every rank:
    TensorBoard tasks/<task>/<metric>_depth_<d>, <out>/tasks.jsonl, one log line with the cost."""
    scores = tasks.score(model, step, rank, world, device)
    log.info("%s", tasks.report(scores, tokens_seen, writer, writer.out, rank))
