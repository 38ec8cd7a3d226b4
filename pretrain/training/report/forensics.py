"""Hang forensics: what every live rank was doing, written into `<out>/hangs/<time>/` when a
collective fails or times out (a rank stopped answering), when the user sends SIGUSR2 to any rank, or
(with `stall_s`: under NCCL) when this rank's loop has not moved for that long.

Each live rank writes `rank<R>.txt` (for a person: the step, the loop depth and the phase of the
loop, the Python stack of every thread, its last collectives), `rank<R>.json` (the same for
`grt hangs`, pretrain/distributed/hangs.py) and `fr_trace_rank_<R>` (torch's flight recorder
dump, the pickle torch's own analyzer reads: `python -m torch.distributed.flight_recorder.fr_trace DIR
--prefix fr_trace_rank_`), the json last: a rank whose json is there has written all three.

The flight recorder keeps the last TORCH_FR_BUFFER_SIZE collectives of every process group (NCCL,
and gloo in torch >= 2.10): the process group's start sets it (pretrain/distributed/rendezvous.py)
unless the user did (0 turns it off). A rank frozen or dead writes nothing: its file is missing,
which is what names it.

The ranks meet on one folder through the rendezvous store: the rank that asks writes
`grt/hangdump` = "<unix time> <folder name>", and a watcher thread on every rank (`Watcher`, one
store read a second, beside the heartbeat's write) dumps into it. The thread also wakes on SIGUSR2
at once, through the signal's wakeup fd: a Python handler would wait for the main thread, which may
be the one stuck in a collective. The loop's position is `MARK`, plain attribute writes (no sync).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grt_common.files import atomic_path, atomic_write_text
from pretrain.distributed.hangs import FR_PREFIX

log = logging.getLogger("grt.train")

HANG_SIGNAL = signal.SIGUSR2  # SIGTERM and SIGUSR1 stop with a checkpoint (failures.StopSignal)
KEY = "grt/hangdump"
JOIN_S = 5.0  # a request this recent is joined (ranks timing out together, a signal to all) rather than a new folder


@dataclass
class Mark:
    """Where this rank's loop is: written by the loop (plain attribute writes), read by a dump."""

    step: int = 0  # the training step running, or last run (1-based, as the logs count them)
    depth: int = 0  # its loop depth
    phase: str = "start"  # start, data, forward, backward, optimizer, after step, eval, save, end
    moves: int = 0  # bumped by every mark: a loop that stopped moving is one that hangs


MARK = Mark()


def flight_recorder() -> tuple[dict[str, Any] | None, bytes | None]:
    """This process's flight recorder (its JSON, its pickle), or (None, None) without one."""
    try:
        import torch._C._distributed_c10d as c10d

        return json.loads(c10d._dump_fr_trace_json()), c10d._dump_fr_trace()  # type: ignore[attr-defined]
    except Exception:  # an older torch, a backend without one, or the recorder off
        return None, None


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} (id {ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def collective_lines(fr: dict[str, Any] | None, last: int = 20) -> list[str]:
    if fr is None:
        return ["(no flight recorder: torch.distributed has none for this backend, or TORCH_FR_BUFFER_SIZE=0)"]
    lines = [
        f"process group {pg}: last enqueued {s.get('last_enqueued_collective')}, started "
        f"{s.get('last_started_collective')}, completed {s.get('last_completed_collective')}"
        for pg, s in sorted(fr.get("pg_status", {}).items())
    ]
    for e in fr.get("entries", [])[-last:]:
        lines.append(
            f"pg {e.get('pg_id')} collective {e.get('collective_seq_id')} {e.get('profiling_name')} "
            f"in {e.get('input_sizes')} state {e.get('state')}{' retired' if e.get('retired') else ''}"
        )
    return lines


def dump(folder: Path, rank: int, world: int, reason: str, detail: str = "") -> Path:
    """Write this rank's files into `folder` (module doc); each complete or absent. `detail`: the
    failed collective's traceback (where the main thread called it), when one failed here."""
    folder.mkdir(parents=True, exist_ok=True)
    fr, raw = flight_recorder()
    head = {
        "rank": rank,
        "world": world,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "reason": reason,
        **asdict(MARK),
    }
    stacks = thread_stacks()
    text = [
        f"rank {rank} of {world} on host {head['host']}, pid {head['pid']}, at {head['time']}",
        f"reason: {reason}",
        f"step {MARK.step}, loop depth {MARK.depth}, phase {MARK.phase}",
        "",
        "--- the last collectives (torch's flight recorder) ---",
        *collective_lines(fr),
        "",
        "--- Python stacks of every thread ---",
        stacks,
        *(
            ["--- the failed collective's traceback (the main thread's, before it was caught) ---", detail]
            if detail
            else []
        ),
    ]
    if raw is not None:
        with atomic_path(folder / f"{FR_PREFIX}{rank}") as tmp:
            tmp.write_bytes(raw)
    atomic_write_text(folder / f"rank{rank}.txt", "\n".join(text) + "\n")
    # last: the json is what `grt hangs` counts a rank's dump by, so a rank seen there has all its files
    atomic_write_text(folder / f"rank{rank}.json", json.dumps({**head, "flight_recorder": fr}) + "\n")
    return folder


class Watcher:
    """The dumps of one rank (module doc): `request` asks every rank for one and writes this rank's;
    a thread answers the others' requests and SIGUSR2. `store`: the rendezvous store's client (None:
    one rank, SIGUSR2 only)."""

    def __init__(
        self, hangs: Path, rank: int, world: int, store: Any | None, interval: float = 1.0, stall_s: float = 0.0
    ) -> None:
        self.hangs, self.rank, self.world, self.store, self.interval = hangs, rank, world, store, interval
        self.stall_s = stall_s  # > 0: a loop that has not moved for this long asks for a dump itself
        self._moves, self._since = MARK.moves, time.monotonic()
        self.done: set[str] = set()  # the folders this rank has written into
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._write_end: socket.socket | None = None
        self._old_handler: Any = signal.SIG_DFL
        self._seen = self._current()  # a request from before this process (an elastic restart's) is not ours
        self._wake = self._wakeup_socket()
        threading.Thread(target=self._run, name="grt-hang-watch", daemon=True).start()

    def _wakeup_socket(self) -> socket.socket | None:
        """SIGUSR2 written to a socket this thread selects on (the main thread sets it up)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = socket.socketpair()
        write.setblocking(False)
        old = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        if old != -1:  # someone else's (an event loop): kept, and the dump waits for the main thread
            signal.set_wakeup_fd(old)
            signal.signal(HANG_SIGNAL, lambda *_: self.request(f"{HANG_SIGNAL.name} (a user asked)"))
            return None
        self._old_handler = signal.signal(HANG_SIGNAL, lambda *_: None)  # so that the wakeup byte is written
        self._write_end = write
        return read

    def _current(self) -> str:
        if self.store is None:
            return ""
        try:
            return self.store.get(KEY).decode() if self.store.check([KEY]) else ""
        except Exception:
            return ""

    def request(self, reason: str, detail: str = "") -> Path:
        """Ask every rank for a dump (joining one asked for within JOIN_S) and write this rank's."""
        name = self._fresh_name()
        if self.store is not None:
            try:
                old = self._current()
                if not old or time.time() - float(old.partition(" ")[0]) > JOIN_S:
                    new = f"{time.time():.3f} {name}"
                    old = self.store.compare_set(KEY, old, new).decode()  # the winner's, if another rank raced
                name = old.partition(" ")[2] or name
            except Exception:  # the store is gone (rank 0's host): this rank's own folder
                pass
        return self._dump(name, reason, detail)

    def _fresh_name(self) -> str:
        """The time, to the second (a folder already there that second: -2, -3, ...)."""
        base = name = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        n = 1
        while name in self.done or (self.hangs / name).exists():
            n += 1
            name = f"{base}-{n}"
        return name

    def _dump(self, name: str, reason: str, detail: str = "") -> Path:
        with self._lock:
            folder = self.hangs / name
            if name not in self.done:
                self.done.add(name)
                try:
                    dump(folder, self.rank, self.world, reason, detail)
                    log.warning(
                        "hang forensics: rank %d wrote its stacks and last collectives into %s", self.rank, folder
                    )
                except OSError as err:
                    log.warning("hang forensics: rank %d could not write into %s: %s", self.rank, folder, err)
            return folder

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake is not None:
                ready, _, _ = select.select([self._wake], [], [], self.interval)
                if ready and HANG_SIGNAL in self._wake.recv(64):
                    self.request(f"{HANG_SIGNAL.name} (a user asked)")
            else:
                self._stop.wait(self.interval)
            now = self._current()
            if now and now != self._seen:
                self._seen = now
                self._dump(now.partition(" ")[2], "another rank asked (a failed collective or SIGUSR2 there)")
            self._check_stall()
        if self._wake is not None:
            self._wake.close()

    def _check_stall(self) -> None:
        """Under NCCL a collective that times out aborts the process from torch's watchdog, before
        Python sees an error: the dump is asked for when the loop has not moved for `stall_s`."""
        if MARK.moves != self._moves:
            self._moves, self._since = MARK.moves, time.monotonic()
        elif self.stall_s and time.monotonic() - self._since >= self.stall_s:
            self._since = float("inf")  # once per stall
            self.request(f"this rank's loop has not moved for {self.stall_s:g} s (step {MARK.step}, {MARK.phase})")

    def close(self) -> None:
        self._stop.set()
        if self._write_end is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            signal.signal(HANG_SIGNAL, self._old_handler)
            self._write_end.close()  # the thread's end: closed by the thread, which it wakes
