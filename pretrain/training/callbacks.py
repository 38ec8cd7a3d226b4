"""The one extension point of the fit loop: a `Callback` for each concern that runs no collective
(throughput, the step log, loss spikes, the profiler, W&B, the heartbeat, the data-starved check).

`Trainer.build` makes the run's list of them (trainer.py) and `fit` calls each hook on every
callback, in list order, at one fixed point of the loop, on every rank at the same steps. A hook
never runs a collective: a collective needs every rank at the same point in the same order, and
those of the loop (each step's, the slow-rank gather of a logging step, validation, the tasks, a
save) stay written out in `fit`, where their order can be read in one place. A new concern of this
kind is a subclass in its own module, and one entry in that list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Callback:
    """Hook points of the fit loop; each does nothing unless overridden. `step` is always the
    number of steps trained so far."""

    def on_fit_start(self, step: int) -> None:
        """The loop starts, after the build (a resume's load, the validation data, compile's wait)."""

    def on_step_begin(self, step: int) -> None:
        """Step `step` + 1 is about to train."""

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        """Step `step` has trained, before its logging, evaluation and save; `record` is its JSON
        line so far (loss, depth, ...), which the callback may add to."""

    def log_values(self, step: int) -> dict[str, float]:
        """A logging step: the values this concern adds to the step's (`on_log`)."""
        return {}

    def on_log(self, step: int, values: Mapping[str, float]) -> None:
        """A logging step's values, the step's own and every callback's `log_values`."""

    def on_validation(self, step: int) -> None:
        """Validation or the zero-shot tasks ran at `step`, and the model trains again."""

    def on_save(self, step: int, files: dict[str, str]) -> None:
        """Checkpoint `step` is about to be saved: `files` ({name: text}, rank 0 writes them into
        it) may take this concern's own."""

    def on_rollback(self, step: int) -> None:
        """A loss-spike rollback took the run back to checkpoint `step`."""
