"""train.export_every=N: the `grt export` copy of every Nth step's checkpoint (with its Hugging Face
folder, hf/), written into the checkpoint as `<checkpoints>/stepNNNNNNNN/export/` while training goes on.

The export is `grt export` itself (pretrain/infer/export.py), run by rank 0 in a child process at a
lower CPU priority once the checkpoint is COMPLETE, from the checkpoint's files: DeepSpeed's
zero_to_fp32 reader joins every rank's partition on the host, so under ZeRO-3 the full weights are
gathered once, from the files the save wrote, with no collective and no device work (nothing on the
GPU to wait for beyond the save's own copies). A child rather than a thread: the consolidation, the
safetensors and the tokenizer conversion hold the GIL for seconds, and the reader redirects the
process's stdout and stderr while it runs. The training thread only starts the child and asks
whether it ended (a stat and a poll per step while one is due), and waits for it in two places: a
save that would prune the checkpoint being exported (train.keep_checkpoints), and the run's end.

An export is kept as long as its checkpoint: inside its folder, it is pruned with it. It is said in
the log (rank 0) and in metrics.jsonl: the record of the step at which it ended carries
`"export": {"step", "path", "seconds", "stall_s"}` (a failure: `"error"` instead of `path`); one
that ends after the last step is said in the log only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pretrain.distributed.error_boundary import VERDICTS_ENV
from pretrain.runs.checkpoint_files import step_of, tag_dirs, tag_for
from pretrain.training.callbacks import Callback
from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")

EXPORT_DIR = "export"  # inside the checkpoint's folder: pruned with it
NICE = 10  # the child's CPU priority below training's (its data workers, the host side of the step)


@dataclass
class _Running:
    tag: str
    proc: subprocess.Popen
    errors: IO[bytes]  # the child's stderr (a file: a pipe could fill and block it)
    started: float


class ExportDuring(Callback):
    """Rank 0's exports of train.export_every (module doc); `build` gives None when it is off."""

    def __init__(self, root: Path, every: int, keep: int) -> None:
        self.root, self.every, self.keep = root.resolve(), every, keep
        self.due: list[str] = []  # checkpoint tags saved (or being written) whose export is to start
        self.running: _Running | None = None
        self.ended: list[dict[str, Any]] = []  # exports ended since the last step record
        self.stall_s = 0.0  # the training thread's time in this callback since the last export ended

    @classmethod
    def build(cls, run: RunContext) -> ExportDuring | None:
        t = run.cfg.train
        if not t.export_every:
            return None
        if run.rank != 0:
            return None
        exports = cls(run.root, t.export_every, t.keep_checkpoints)
        run.closing.callback(exports.finish)
        return exports

    # -- the loop's hooks --------------------------------------------------------------------
    def on_save(self, step: int, files: dict[str, str]) -> None:
        began = time.perf_counter()
        if self.running is not None and self.running.tag in self._pruned_by(tag_for(step)):
            log.info("waiting for the export of %s: checkpoint %s prunes it", self.running.tag, tag_for(step))
            self._end(self.running.proc.wait())
        if step % self.every == 0:
            self.due.append(tag_for(step))
        self.stall_s += time.perf_counter() - began

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        if self.running is None and not self.due:
            return
        began = time.perf_counter()
        self._advance()
        self.stall_s += time.perf_counter() - began
        if self.ended:
            record["export"] = self.ended[0] if len(self.ended) == 1 else self.ended
            self.ended = []

    def finish(self) -> None:
        """The run's end (its closing stack, after the last save): the due exports of complete
        checkpoints written, one after the other; what ends here is said in the log only."""
        while self.running is not None or self._next() is not None:
            if self.running is not None:
                self._end(self.running.proc.wait())
            self._advance()

    # -- the exports -------------------------------------------------------------------------
    def _pruned_by(self, tag: str) -> list[str]:
        """The tags the completion of checkpoint `tag` may remove (store._complete's rule), counting
        every folder up to it: one train.async_save is still writing is complete by then."""
        tags = sorted({*[t for t in tag_dirs(self.root) if t <= tag], tag})
        return tags[: -self.keep]

    def _next(self) -> str | None:
        """The oldest due tag whose checkpoint is complete; due tags whose folder is gone (a failed
        save removed it, or it was pruned first) are dropped."""
        for tag in list(self.due):
            if (self.root / tag / "COMPLETE").is_file():
                return tag
            if not (self.root / tag).is_dir():
                self.due.remove(tag)
        return None

    def _advance(self) -> None:
        if self.running is not None:
            code = self.running.proc.poll()
            if code is None:
                return
            self._end(code)
        tag = self._next()
        if tag is not None:
            self.due.remove(tag)
            self._start(tag)

    def _start(self, tag: str) -> None:
        step_dir = self.root / tag
        errors = tempfile.TemporaryFile()
        env = {k: v for k, v in os.environ.items() if k != VERDICTS_ENV}  # grt launch's verdict is the rank's
        env["CUDA_VISIBLE_DEVICES"] = ""  # the reader is host-only: no CUDA context
        command = [sys.executable, "-m", "pretrain.cli", "export", "--checkpoint", str(step_dir)]
        command += ["--out", str(step_dir / EXPORT_DIR), "--overwrite"]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=env)
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)
        except OSError:  # it ended already, or the platform has no priorities: it runs as it is
            pass
        self.running = _Running(tag, proc, errors, time.monotonic())

    def _end(self, code: int) -> None:
        assert self.running is not None
        run, self.running = self.running, None
        seconds = round(time.monotonic() - run.started, 2)
        said: dict[str, Any] = {"step": step_of(run.tag), "seconds": seconds, "stall_s": round(self.stall_s, 4)}
        self.stall_s = 0.0
        run.errors.seek(0)
        lines = [ln for ln in run.errors.read().decode(errors="replace").splitlines() if ln.strip()]
        run.errors.close()
        if code == 0:
            said["path"] = str(self.root / run.tag / EXPORT_DIR)
            log.info(
                "exported checkpoint %s to %s (Hugging Face copy in hf/; %.1f s off the training thread, which "
                "waited %.3f s)",
                run.tag,
                said["path"],
                seconds,
                said["stall_s"],
            )
        else:  # the checkpoint itself is complete: training goes on, the failure is said
            said["error"] = lines[-1] if lines else f"exit status {code}"
            log.warning("the export of checkpoint %s failed (training goes on): %s", run.tag, said["error"])
        self.ended.append(said)
