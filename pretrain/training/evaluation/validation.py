"""Evaluation during training: the validation loss at every exit depth (of each source and, for a
mixture, their mean under its weights), and the zero-shot tasks (evaluation/tasks.py). Both are
collectives: every rank runs them at the same steps."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from data_pipeline.epoch_plan import Batch
from pretrain.distributed import all_reduce, comm_device
from pretrain.infer.loop_health import LoopHealth, loop_health, run_settings
from pretrain.model.loss import scored_tokens
from pretrain.training.evaluation.tasks import TaskEval
from pretrain.training.report.metrics import MetricsWriter
from pretrain.training.step.optimizer_step import move

if TYPE_CHECKING:
    from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")


@torch.no_grad()
def evaluate_depths(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    depths: list[int],
    device: torch.device,
    doc_mask: bool = False,
    gate_steps: int = 0,
) -> tuple[dict[int, float], list[float]]:
    """Mean loss at each depth over the scored targets of the given batches and of every rank (a
    batch's mean weighted by its scored targets: a loss mask's batches score different numbers);
    with gate_steps = R, also the mean gate at loop steps 1..R of the deepest forward, over the
    batches ([] without a gate). The sums stay on the device until the one all-reduce."""
    was_training = model.training
    model.eval()
    # loss sums, the mean gate's sums per loop step, the scored targets, the batches: one all-reduce
    totals = torch.zeros(len(depths) + gate_steps + 2, dtype=torch.float64, device=device)
    gated = False
    for batch in batches:
        idx, targets, doc_ids = move(batch, device, doc_mask)
        scored = scored_tokens(targets)
        for i, r in enumerate(depths):
            want_gates = gate_steps > 0 and r == depths[-1]
            out = model(idx, targets, n_loops=r, doc_ids=doc_ids, return_logits=False, return_gates=want_gates)
            totals[i] += out.loss.double() * scored  # the batch's summed loss (0 where it scores nothing)
            if want_gates and len(out.gates) == gate_steps:
                gated = True
                totals[len(depths) : len(depths) + gate_steps] += torch.stack([g.double().mean() for g in out.gates])
        totals[-2] += scored
        totals[-1] += 1
    values = all_reduce(totals.to(comm_device())).tolist()
    model.train(was_training)
    n, n_batches = max(values[-2], 1.0), max(values[-1], 1.0)
    gates = [v / n_batches for v in values[len(depths) : len(depths) + gate_steps]] if gated else []
    return {r: values[i] / n for i, r in enumerate(depths)}, gates


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
        warmup_steps: int = 0,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.batches, self.weights, self.max_r, self.every = batches, weights, max_loops, every
        self.doc_mask, self.writer, self.device = doc_mask, writer, device
        self.warmup_steps, self.warned = warmup_steps, False
        self.settings = settings  # the run's (loop_health.run_settings): the depths it trains, its start
        self.health: LoopHealth | None = None  # the loop's, at the last validation

    @classmethod
    def build(
        cls, run: RunContext, batches: dict[str, list[Batch]] | None, weights: dict[str, float], writer: MetricsWriter
    ) -> Validation | None:
        """None without validation batches (train.eval_every=0, or no source with a validation split)."""
        t = run.cfg.train
        if batches is None:
            return None
        settings = run_settings(run.cfg.model, t.depth_sampling, t.max_train_depth)
        return cls(
            batches,
            weights,
            run.cfg.model.max_loops,
            t.eval_every,
            t.doc_mask,
            writer,
            run.device,
            t.warmup_steps,
            settings,
        )

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

    def run(
        self,
        model: torch.nn.Module,
        step: int,
        tokens_seen: int,
        record: dict[str, Any],
        grad_norms: dict[str, float] | None = None,
    ) -> dict[int, float]:
        """The loss at every exit depth: of each source (val/<source>/...) and, for a mixture, their
        mean under the mixture's weights (val/loss...), in TensorBoard and in the step's `record`
        (metrics.jsonl, under "val"); a looped model's health (`check_loop`). Returns the latter.
        grad_norms: the last logging step's grad_norm/<block> scalars."""
        max_r = self.max_r
        depths = list(range(max_r + 1))
        scored = {
            n: evaluate_depths(model, b, depths, self.device, self.doc_mask, max_r) for n, b in self.batches.items()
        }
        per_source = {n: losses for n, (losses, _) in scored.items()}
        total = sum(self.weights[name] for name in per_source)
        by_depth = {k: sum(self.weights[n] * v[k] for n, v in per_source.items()) / total for k in depths}
        gated = all(g for _, g in scored.values())  # a model without a gate (dense, baselines): none
        gates = (
            [sum(self.weights[n] * g[i] for n, (_, g) in scored.items()) / total for i in range(max_r)] if gated else []
        )
        full = by_depth[max_r]
        values = {"val/loss": full, **{f"val/loss_depth_{k}": v for k, v in by_depth.items()}}
        for name, losses in per_source.items():
            if name:
                values[f"val/{name}/loss"] = losses[max_r]
                values.update({f"val/{name}/loss_depth_{k}": v for k, v in losses.items()})
        self.health = loop_health(by_depth, gates, grad_norms, max_r, self.settings)
        if self.health is not None:
            values.update(self.health.scalars())
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
        if self.health is not None:
            self.check_loop(self.health, step, record)
        return by_depth

    def check_loop(self, health: LoopHealth, step: int, record: dict[str, Any]) -> None:
        """The loop's health line and record at every validation; after warm-up, one warning the
        first time the loop's steps after the first add less than MIN_GAIN_AFTER_FIRST."""
        record["loop"] = health.record()
        log.info("validation at step %d: %s", step, health.line())
        if health.used is False and step > self.warmup_steps and not self.warned:
            self.warned = True
            log.warning("step %d: %s", step, health.warning())


def score_tasks(tasks: TaskEval, run: RunContext, step: int, tokens_seen: int, writer: MetricsWriter) -> None:
    """The zero-shot tasks at this step (train.eval_tasks_every, evaluation/tasks.py), on every rank:
    TensorBoard tasks/<task>/<metric>_depth_<d>, <out>/tasks.jsonl, one log line with the cost."""
    scores = tasks.score(run.engine.module, step, run.rank, run.world, run.device)
    log.info("%s", tasks.report(scores, tokens_seen, writer, writer.out, run.rank))
