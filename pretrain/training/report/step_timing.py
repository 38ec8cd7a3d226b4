"""Where a logged step's time goes, which rank is slow, and loss spikes (docs/training.md,
"Watching a run").

On logging steps only (a step that is not logged gets no event, timer or sync), the fit loop
times four spans of the step: waiting for data (`next(batches)`, on the host, where loading
happens), forward, backward (DeepSpeed's, with its gradient collectives), and the optimizer step
(`engine.step()`); "other" is the rest of the step's wall time (the control vector's reduction,
the host sync, checkpoint-free bookkeeping). On CUDA the device spans come from CUDA events,
read once at the end of the step (the logging step syncs there anyway); on the CPU from timers.

A rank's own time is its data wait plus its forwards: under ZeRO-1 and -2 no collective runs
in them, so a rank that is slow (a slow disk, a throttled GPU, a noisy neighbour) shows there
while the others wait for it at the first collective after the forward (the control vector's
reduction), which equalises every later span. Under ZeRO-3 the forward also gathers parameters,
which waits for the slowest rank: the comparison then sees less. Each logging step gathers every
rank's own time (one collective, `distributed.gather_floats`); each rank is measured against the
median of the OTHER ranks (with two ranks: the other one; the median of all would be their
mean, and a rank five times slower would read 1.7x), and a rank above `slow_rank_factor` times
that on `slow_rank_windows` logging steps in a row is named, with its host, in one warning line.
The time a rank waited for the slowest one at that collective (the slowest own time less its
own, at most its "other") is "waiting" in the breakdown, out of "other". A rank that waits for
data more than train.data_starved_share of a timed step says so once (`DataStarved`).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from pretrain.distributed import gather_floats, gather_text
from pretrain.runs.train_config import loader_workers
from pretrain.training.callbacks import Callback

if TYPE_CHECKING:
    from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")

SPANS = ("data", "forward", "backward", "optimizer")
BREAKDOWN = (*SPANS, "waiting", "other")  # a timed step's parts, in the log line's order


class StepTimer:
    """Times the spans of a logged step (`start(active=True)` ... `finish()`); inactive steps
    pass through `span` untouched."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda, self.enabled = device.type == "cuda", enabled
        self.active = False
        self.started = 0.0
        self.host: dict[str, float] = {}
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    def start(self, active: bool) -> None:
        self.active = active and self.enabled
        if self.active:
            self.host = dict.fromkeys(SPANS, 0.0)
            self.events = {name: [] for name in SPANS}
            self.started = time.perf_counter()

    @contextmanager
    def span(self, name: str, on_device: bool = True) -> Iterator[None]:
        """Time the block as span `name`: on CUDA with events when `on_device`, else on the host."""
        if not self.active:
            yield
            return
        if self.cuda and on_device:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self.events[name].append((begin, end))
            return
        t0 = time.perf_counter()
        yield
        self.host[name] += time.perf_counter() - t0

    def finish(self) -> dict[str, float]:
        """The logged step's seconds per span, `other` and `step` (its wall time); {} when the step
        was not timed. On CUDA: one synchronisation, then the events' times."""
        if not self.active:
            return {}
        self.active = False
        if self.cuda:
            torch.cuda.synchronize()
        seconds = dict(self.host)
        for name, pairs in self.events.items():
            seconds[name] += sum(begin.elapsed_time(end) for begin, end in pairs) / 1000.0
        step = time.perf_counter() - self.started
        seconds["other"] = max(0.0, step - sum(seconds[name] for name in SPANS))
        seconds["step"] = step
        return seconds


def breakdown_scalars(seconds: dict[str, float]) -> dict[str, float]:
    """The scalars of a timed step (`SlowRanks.observe`'s breakdown): seconds per part and the share
    of the step each took."""
    step = seconds["step"] or 1e-12
    values = {f"time/{name}_s": seconds[name] for name in (*BREAKDOWN, "step")}
    values.update({f"time/{name}_share": seconds[name] / step for name in BREAKDOWN})
    return values


def median_of_others(times: list[float]) -> list[float]:
    """Each rank's yardstick: the median of the other ranks' times (one rank: its own)."""
    if len(times) == 1:
        return list(times)
    return [statistics.median(times[:r] + times[r + 1 :]) for r in range(len(times))]


class SlowRanks:
    """Gathers each rank's own time on logging steps and names a rank that stays slow."""

    def __init__(self, rank: int, hosts: list[str], factor: float, windows: int) -> None:
        self.rank, self.hosts, self.factor, self.windows = rank, hosts, factor, windows
        self.streak = [0] * len(hosts)  # logging steps in a row each rank was above the factor
        self.named: set[int] = set()  # warned about, until it is no longer slow

    @classmethod
    def build(cls, run: RunContext) -> SlowRanks:
        """Every rank's host, gathered once (a collective)."""
        t = run.cfg.train
        return cls(run.rank, gather_text(socket.gethostname(), 64), t.slow_rank_factor, t.slow_rank_windows)

    def scalars(self, step: int, seconds: dict[str, float]) -> dict[str, float]:
        """A logging step's time/* and ranks/* scalars from its `StepTimer.finish()`: a collective
        on every rank at the same logging steps; an untimed step ({}) gathers nothing."""
        if not seconds:
            return {}
        breakdown, ranks = self.observe(seconds, step)
        return {**breakdown_scalars(breakdown), **ranks}

    def observe(self, seconds: dict[str, float], step: int) -> tuple[dict[str, float], dict[str, float]]:
        """Every rank calls it on the same logging step (a collective) with its `StepTimer.finish()`;
        returns the step's breakdown with "waiting" split off "other", and the ranks' scalars."""
        own = seconds["data"] + seconds["forward"]
        times = gather_floats(own)
        for r, (t, yardstick) in enumerate(zip(times, median_of_others(times))):
            slow = yardstick > 0 and t > self.factor * yardstick
            self.streak[r] = self.streak[r] + 1 if slow else 0
            if not slow:
                self.named.discard(r)
            elif self.streak[r] >= self.windows and r not in self.named:
                self.named.add(r)
                if self.rank == 0:
                    log.warning(
                        "slow rank: rank %d on %s took %.3f s of its own time per step at step %d, %.1fx the "
                        "median of the other ranks' %.3f s, on %d logging steps in a row (train.slow_rank_factor=%g)",
                        r,
                        self.hosts[r],
                        t,
                        step,
                        t / yardstick,
                        yardstick,
                        self.streak[r],
                        self.factor,
                    )
        waiting = min(seconds["other"], max(0.0, max(times) - own))
        breakdown = {**seconds, "waiting": waiting, "other": seconds["other"] - waiting}
        scalars = {
            "ranks/own_time_min_s": min(times),
            "ranks/own_time_median_s": statistics.median(times),
            "ranks/own_time_max_s": max(times),
            "ranks/slowest": float(max(range(len(times)), key=times.__getitem__)),
        }
        return breakdown, scalars


class DataStarved(Callback):
    """One line the first time this rank waits for data more than train.data_starved_share of a
    timed logging step (its time/* values)."""

    def __init__(self, rank: int, share: float, num_workers: int) -> None:
        self.rank, self.share, self.num_workers = rank, share, num_workers
        self.said = False

    @classmethod
    def build(cls, run: RunContext) -> DataStarved:
        workers = loader_workers(run.cfg.train.num_workers, run.device.type == "cuda")  # as RunData's loader
        return cls(run.rank, run.cfg.train.data_starved_share, workers)

    def on_log(self, step: int, values: Mapping[str, float]) -> None:
        if self.said or "time/step_s" not in values:
            return
        data, total = values["time/data_s"], values["time/step_s"]
        share = data / total if total > 0 else 0.0
        if share > self.share:
            self.said = True
            log.warning(
                "data-starved: rank %d waited for data %.0f%% of step %d (%.3f of %.3f s; train.data_starved_share="
                "%g): more loader workers (train.num_workers=%d) or faster storage",
                self.rank,
                100 * share,
                step,
                data,
                total,
                self.share,
                self.num_workers,
            )
