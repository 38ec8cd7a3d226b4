"""Loss spikes: a step's loss judged against a running robust statistic of the run's losses
(docs/training.md, "Watching a run"); with train.loss_spike_action=skip the step drops each
micro-batch above the limit."""

from __future__ import annotations

import logging
import math
import statistics
from typing import TYPE_CHECKING, Any

from pretrain.training.callbacks import Callback

if TYPE_CHECKING:
    from data_pipeline.batches import TokenCount
    from pretrain.training.report.metrics import MetricsWriter
    from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")


class LossSpikes(Callback):
    """A running robust statistic of the step losses: a loss above the median of the last `window`
    steps plus `threshold` robust standard deviations (1.4826 x their median absolute deviation,
    the standard deviation for normal losses) is a spike. A step's spike is said in one line and
    flagged in TensorBoard (`train/loss_spike`); with train.loss_spike_action=skip the fit loop
    also drops each micro-batch above the limit (`limit`, fixed for the step). It judges after
    `min_history` steps; the history is saved in every checkpoint (`history`), so a resume
    judges as the run would have; a spike does not enter it. As a callback it judges each step
    trained, and flags a spike in the step's record and scalars (against `count`, the tokens trained)."""

    def __init__(
        self,
        threshold: float,
        writer: MetricsWriter,
        count: TokenCount,
        say: bool,
        window: int = 100,
        min_history: int = 20,
    ) -> None:
        self.threshold, self.writer, self.count, self.say = threshold, writer, count, say
        self.window, self.min_history = window, min_history
        self.history: list[float] = []
        self._statistic: tuple[list[float], tuple[float, float, float]] | None = None  # (of which history, it)

    def statistic(self) -> tuple[float, float, float]:
        """(limit, median, robust standard deviation) of the history; limit inf while not judging.
        Computed once per history (the step asks for the limit, then checks its loss)."""
        if self._statistic is not None and self._statistic[0] is self.history:
            return self._statistic[1]
        if self.threshold <= 0 or len(self.history) < self.min_history:
            value = (math.inf, math.nan, math.nan)
        else:
            median = statistics.median(self.history)
            spread = 1.4826 * statistics.median(abs(x - median) for x in self.history)
            value = (median + self.threshold * max(spread, 1e-6 * abs(median)), median, spread)
        self._statistic = (self.history, value)
        return value

    @classmethod
    def build(cls, run: RunContext, writer: MetricsWriter, count: TokenCount) -> LossSpikes:
        return cls(run.cfg.train.loss_spike_threshold, writer, count, say=run.rank == 0)

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        if self.check(step, record["loss"]):
            record["loss_spike"] = True
            self.writer.scalars(step, {"train/loss_spike": 1.0}, tokens=self.count.total)

    def limit(self) -> float:
        return self.statistic()[0]

    def restore(self, history: list[float]) -> None:
        """Judge on from a checkpoint's history (an empty one: a checkpoint from before it)."""
        self.history = list(history)

    def check(self, step: int, loss: float) -> bool:
        """Whether the step's loss (the same on every rank) is a spike; rank 0 (`say`) says so."""
        limit, median, spread = self.statistic()
        spike = math.isfinite(loss) and loss > limit
        if spike and self.say:
            log.warning(
                "loss spike at step %d: %.4f against a running median of %.4f over %d steps (limit %.4f: "
                "train.loss_spike_threshold=%g robust standard deviations of %.4f)",
                step,
                loss,
                median,
                len(self.history),
                limit,
                self.threshold,
                spread,
            )
        if not spike and math.isfinite(loss):
            self.history = [*self.history[-(self.window - 1) :], loss]
        return spike
