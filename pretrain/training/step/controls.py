"""The control vector: what every rank must agree on about a micro-batch, in one small tensor.

Each micro-batch packs its loss, whether that loss is finite, the stop signal and the previous
step's gradient-norm check into one float64 tensor on the communication device; one all-reduce
sums it over the ranks, so that every rank skips, stops and saves together. The host reads the
vectors of a step all at once (`MicroBatchControls.read`: the step's one host sync); until then
only device-side ops look at them (`GradientMask`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch


class MicroBatchControls(NamedTuple):
    """One micro-batch's control vector on the host, each field summed over the ranks."""

    loss_sum: float  # the micro-batch's loss
    non_finite_ranks: float  # ranks whose loss is not finite
    stopping_ranks: float  # ranks that received SIGTERM/SIGUSR1
    bad_grad_norm_ranks: float  # ranks whose previous step's gradient norm is not finite

    @staticmethod
    def pack(
        loss: torch.Tensor, stop_flag: torch.Tensor, grad_norm_bad: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """This rank's vector on `device`, in field order; no host sync. `stop_flag` and
        `grad_norm_bad` are 0-d float64 tensors on `device`."""
        loss = loss.detach().double().to(device)
        return torch.stack([loss, (~torch.isfinite(loss)).double(), stop_flag, grad_norm_bad])

    @staticmethod
    def kept(packed: torch.Tensor, max_loss_sum: float) -> torch.Tensor:
        """A device flag, before the read: no rank's loss is non-finite and their sum is at most
        `max_loss_sum` (inf: no limit; a loss spike's limit times the ranks otherwise)."""
        return (packed[_NON_FINITE] == 0) & (packed[_LOSS] <= max_loss_sum)

    @classmethod
    def read(cls, packed: list[torch.Tensor]) -> list[MicroBatchControls]:
        """The all-reduced vectors on the host, in one host sync."""
        return [cls(*row) for row in torch.stack(packed).tolist()]

    @property
    def dropped(self) -> bool:
        """Some rank saw a non-finite loss: every rank drops the micro-batch."""
        return self.non_finite_ranks > 0

    @property
    def stop_requested(self) -> bool:
        return self.stopping_ranks > 0

    @property
    def grad_norm_bad(self) -> bool:
        return self.bad_grad_norm_ranks > 0


_NON_FINITE = MicroBatchControls._fields.index("non_finite_ranks")
_LOSS = MicroBatchControls._fields.index("loss_sum")


@dataclass
class StepTally:
    """What the micro-batches of one optimizer step read so far add up to."""

    good: int = 0
    loss_sum: float = 0.0  # over the good micro-batches, each the mean over the ranks
    stop_requested: bool = False


class GradientMask:
    """Zeroes a backward's gradients on the device when a device flag is false, before
    DeepSpeed accumulates or reduces them: a micro-batch whose non-finite check is not read
    yet runs its backward under `keep_if(flag)`, and adds nothing if it turns out bad (a
    non-finite gradient times zero would still be NaN, hence `where`). One hook per
    parameter, a no-op outside `keep_if`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.keep: torch.Tensor | None = None
        self.handles = [p.register_hook(self.mask) for p in module.parameters() if p.requires_grad]

    def mask(self, grad: torch.Tensor) -> torch.Tensor | None:
        return None if self.keep is None else torch.where(self.keep.to(grad.device), grad, 0.0)

    @contextmanager
    def keep_if(self, flag: torch.Tensor) -> Iterator[None]:
        self.keep = flag
        try:
            yield
        finally:
            self.keep = None
