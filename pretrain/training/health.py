"""Run health: who failed, stop signals, failure explanations, memory.

Everything here is set up once at start-up; nothing in the training loop reads the
environment or the rendezvous store (the heartbeat publishes from its own thread).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from grt_common.errors import Stopped, one_line
from pretrain.training.callbacks import Callback

log = logging.getLogger("grt.train")


class TrainingStopped(Stopped):
    """The run stopped on purpose (too many bad steps, a failed save, a full disk mid-run); the last
    good checkpoint is intact: exit 3 (the error boundary's)."""


class RankFailure(TrainingStopped):
    """A rank died, hung or failed: every surviving rank stops with a message naming it."""


class Heartbeat(Callback):
    """Who failed, when a collective breaks (docs/reliability.md).

    A daemon thread on every rank bumps a counter and publishes this rank's step in the
    rendezvous TCP store (its own client connection, short timeout) every `interval` s.
    A rank that fails records its error there before exiting. When a collective raises
    (a peer's connection reset, or gloo/NCCL's dist_timeout_s passed), `diagnose()` reads
    the store twice, 3 intervals apart: a rank that recorded an error, or whose counter did
    not move (killed, crashed, frozen), is named; an unreachable store means rank 0's host
    (which serves it) is gone. Each rank also publishes its hostname once, so that a lost
    rank is named with its node.
    """

    def __init__(self, rank: int, world: int, interval: float = 1.0) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        self.prefix = "grt/"  # the store is this worker group's own (distributed._round_store under torchrun)
        self.step, self.beats = 0, 0
        self.store: dist.TCPStore | None = None
        # hang forensics: asks every live rank for a dump, returns its folder (report/hang_watch.py)
        self.ask_dump: Callable[[str, str], Path] | None = None
        self._stop = threading.Event()
        if world < 2:
            return
        try:
            self.store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=max(2.0, 5 * interval)),
                wait_for_workers=False,
            )
            self.store.set(f"{self.prefix}host/{rank}", socket.gethostname())
            self._beat()
        except Exception as err:  # no store to reach: fall back to the bare collective errors
            log.warning("heartbeat disabled (rendezvous store unreachable: %s)", err)
            self.store = None
            return
        threading.Thread(target=self._run, name="grt-heartbeat", daemon=True).start()

    def on_step_begin(self, step: int) -> None:
        """The step this rank is training now (published with its next beat)."""
        self.step = step

    def _beat(self) -> None:
        self.beats += 1
        assert self.store is not None  # only called once the store is connected
        self.store.set(f"{self.prefix}hb/{self.rank}", f"{self.beats} {self.step}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:
                return

    def close(self) -> None:
        self._stop.set()

    def mark_failed(self, message: str, comm: bool = False) -> None:
        """Record this rank's error; comm=True: it is a failed collective (a symptom, not a cause)."""
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}failed/{self.rank}", ("comm|" if comm else "own|") + message[:2000])
            except Exception:
                pass

    def _read(self, what: str) -> dict[int, str]:
        keys = {r: f"{self.prefix}{what}/{r}" for r in range(self.world) if r != self.rank}
        store = self.store
        assert store is not None  # diagnose() returns early without a store
        return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}

    def diagnose(self) -> list[str]:
        """Descriptions of the other ranks that failed (empty: none found)."""
        if self.store is None:
            return []
        try:
            before = self._read("hb")
            time.sleep(3 * self.interval)
            after, failed = self._read("hb"), self._read("failed")
        except Exception:
            if self.rank == 0:
                return []
            return [
                f"rank 0 is unreachable on host {os.environ.get('MASTER_ADDR')} (it serves the rendezvous store: "
                "it exited, was killed or its host is down)"
            ]
        try:
            hosts = self._read("host")
        except Exception:
            hosts = {}

        def on_host(r: int) -> str:
            return f" on host {hosts[r]}" if r in hosts else ""

        notes: list[str] = []
        comm: list[int] = []
        for r in range(self.world):
            if r == self.rank:
                continue
            kind, _, text = failed.get(r, "|").partition("|")
            if kind == "own":
                notes.append(f"rank {r} failed: {text}")
            elif kind == "comm" and before.get(r) != after.get(r):
                comm.append(r)
            elif r not in after:
                notes.append(f"rank {r} never reported (it did not start or died at start-up){on_host(r)}")
            elif before.get(r) == after[r]:
                notes.append(
                    f"rank {r} stopped responding after step {after[r].split()[1]} "
                    "(killed, crashed or frozen: no heartbeat for "
                    f"{round(3 * self.interval, 1):g} s){on_host(r)}"
                )
        if not notes:
            lagging = [r for r, v in after.items() if int(v.split()[1]) < self.step and r not in comm]
            notes = [
                f"rank {r} is alive but stuck at step {after[r].split()[1]} (this rank reached step {self.step})"
                f"{on_host(r)}"
                for r in lagging
            ]
        if not notes and comm:
            notes = [
                f"no rank died or reported an error of its own; rank(s) {', '.join(map(str, comm))} saw a "
                "failed collective too (ranks waiting for each other: a hang or mismatched collectives; "
                "see the traceback in each rank's log)"
            ]
        return notes


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm's --signal) ask for a checkpoint and a clean exit."""

    def __init__(self) -> None:
        self.received: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name


def is_comm_error(err: BaseException) -> bool:
    """A failed collective (peer gone, timeout): a symptom of another rank's failure."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        k in text
        for k in ("gloo", "NCCL", "Connection reset", "Connection closed", "pair closure", "Timed out", "timed out")
    )


def explain_failure(err: Exception, heartbeat: Heartbeat | None) -> Exception:
    """The exception to raise for `err`: RankFailure naming the failed rank, when known."""
    from data_pipeline.shards import ShardError

    own = one_line(err)
    if isinstance(err, ShardError):
        own += " (set train.skip_corrupt_shards=true to skip unreadable shards with a warning)"
    if heartbeat is None or heartbeat.store is None:
        return TrainingStopped(f"data error: {own}") if isinstance(err, ShardError) else err
    comm = is_comm_error(err)
    heartbeat.mark_failed(own, comm=comm)
    # a failed collective: every live rank writes what it was doing, before the diagnosis's wait (which
    # also keeps rank 0's store up while the others read the request)
    dumped = None
    if comm and heartbeat.ask_dump is not None:
        dumped = heartbeat.ask_dump(f"a collective failed: {own[:300]}", "".join(traceback.format_exception(err)))
    others = heartbeat.diagnose()
    if comm and others:  # a collective failed here: the cause is elsewhere
        message = f"rank {heartbeat.rank} stopping: " + "; ".join(others) + f" [this rank saw {own[:300]}]"
    else:
        message = f"rank {heartbeat.rank} failed: {own}" + (f"; also: {'; '.join(others)}" if others else "")
    if dumped is not None:
        message += f"; each live rank's stacks and last collectives: {dumped} (grt hangs {dumped})"
    log.error("%s", message, exc_info=err)
    return RankFailure(message)
