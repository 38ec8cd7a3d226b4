"""train.checkpoint_mirror=s3://bucket/run: every complete checkpoint uploaded to object storage while
training goes on, and pruned there by train.keep_checkpoints (the bucket's layout, reads and writes:
pretrain/runs/checkpoint_mirror.py).

Rank 0 uploads, from a thread, each checkpoint that has become COMPLETE locally (a synchronous save's
at the next step, a train.async_save one's once its writes are done): its files, then the COMPLETE
object last, so a cut-off upload (a killed run, a dropped connection) is never taken by a resume.
Each request is retried for GRT_MIRROR_RETRY_S; an upload that still fails is said in one warning
line and in metrics.jsonl, the checkpoint stays complete locally, and training goes on. The training
thread hard-links the checkpoint's files into `<checkpoints>/.mirror-<tag>/` (a local prune cannot take
them from the upload; no bytes are copied) and hands the tag to the thread; it waits only at the run's
end, for the uploads due. Rank 0 must see every rank's files (a --out shared by
the nodes, or one node): where it does not, the checkpoint is not mirrored, and that is said.

Said in the log (rank 0) and in metrics.jsonl: the record of the step at which an upload ended
carries `"mirror": {"step", "url", "seconds", "bytes", "stall_s"}` (a failure: `"error"` instead of
`url`); one that ends after the last step is said in the log only.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from grt_common.errors import one_line
from pretrain.runs.checkpoint_files import ranks_that_wrote, step_of, tag_for
from pretrain.runs.checkpoint_mirror import Mirror, MirrorError, mirrored_files
from pretrain.training.callbacks import Callback
from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")


STAGE = ".mirror-"  # <checkpoints>/.mirror-<tag>: hard links to a checkpoint's files while it uploads


class CheckpointMirror(Callback):
    """Rank 0's uploads of train.checkpoint_mirror (module doc); `build` gives None when it is off."""

    def __init__(self, root: Path, mirror: Mirror, keep: int, world: int) -> None:
        self.root, self.mirror, self.keep, self.world = root.resolve(), mirror, keep, world
        self.due: list[str] = []  # saved (or being written), not yet complete here
        self.queued: list[str] = []  # staged, handed to the thread, not yet uploaded (oldest first)
        self.ended: list[dict[str, Any]] = []  # uploads ended since the last step record
        self.stall_s = 0.0  # the training thread's time in this callback since the last upload ended
        self.lock = threading.Condition()
        self.uploading = False  # the thread runs (set and cleared under the lock)
        for old in self.root.glob(f"{STAGE}*"):  # a killed run's: its upload never put COMPLETE
            shutil.rmtree(old, ignore_errors=True)

    @classmethod
    def build(cls, run: RunContext) -> CheckpointMirror | None:
        t = run.cfg.train
        if not t.checkpoint_mirror or run.rank != 0:
            return None
        uploads = cls(run.root, Mirror(t.checkpoint_mirror), t.keep_checkpoints, run.world)
        run.closing.callback(uploads.finish)
        return uploads

    # -- the loop's hooks (the training thread) ---------------------------------------------
    def on_save(self, step: int, files: dict[str, str]) -> None:
        began = time.perf_counter()
        self._hand_over()  # before this save can prune one that is complete here
        self.due.append(tag_for(step))
        self._stalled(began)

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        if self.due:
            began = time.perf_counter()
            self._hand_over()
            self._stalled(began)
        if self.ended:
            with self.lock:
                ended, self.ended = self.ended, []
            record["mirror"] = ended[0] if len(ended) == 1 else ended

    def finish(self) -> None:
        """The run's end (its closing stack, after the last save): every complete checkpoint due is
        uploaded (or given up) before the process ends; said in the log only."""
        self._hand_over()
        with self.lock:
            if self.queued:
                log.info("waiting for the upload of %s to the mirror %s", ", ".join(self.queued), self.mirror.url)
            self.lock.wait_for(lambda: not self.queued)

    def _stalled(self, began: float) -> None:
        with self.lock:  # the thread reads and resets it as an upload ends
            self.stall_s += time.perf_counter() - began

    # -- the handing over --------------------------------------------------------------------
    def _hand_over(self) -> None:
        """Each due checkpoint complete here is staged (its files hard-linked: a prune of the checkpoint
        leaves the upload its files) and handed to the thread; one whose folder is gone (a failed save
        removed it) is dropped."""
        for tag in list(self.due):
            if (self.root / tag / "COMPLETE").is_file():
                self.due.remove(tag)
                _stage(self.root / tag, self.root / f"{STAGE}{tag}")
                with self.lock:
                    self.queued.append(tag)
                    if not self.uploading:
                        self.uploading = True
                        threading.Thread(target=self._uploads, name="checkpoint-mirror", daemon=True).start()
            elif not (self.root / tag).is_dir():
                self.due.remove(tag)

    # -- the thread ---------------------------------------------------------------------------
    def _uploads(self) -> None:
        while True:
            with self.lock:
                if not self.queued:
                    self.uploading = False
                    return
                tag = self.queued[0]
            said = self._upload(tag, self.root / f"{STAGE}{tag}")
            shutil.rmtree(self.root / f"{STAGE}{tag}", ignore_errors=True)
            with self.lock:
                self.queued.remove(tag)
                said["stall_s"] = round(self.stall_s, 4)
                self.stall_s = 0.0
                self.ended.append(said)
                self.lock.notify_all()

    def _upload(self, tag: str, staged: Path) -> dict[str, Any]:
        began = time.monotonic()
        said: dict[str, Any] = {"step": step_of(tag)}
        wrote = ranks_that_wrote(staged)
        try:
            if wrote != self.world:
                raise MirrorError(
                    f"rank 0 sees the files of {wrote} of the {self.world} ranks in {self.root / tag}: the mirror "
                    "needs every rank's files where rank 0 can read them (a --out shared by the nodes)"
                )
            sent = self.mirror.upload(staged, tag)
        except Exception as err:  # the checkpoint itself is complete here: training goes on, the failure is said
            said["error"] = one_line(err)
            said["seconds"] = round(time.monotonic() - began, 2)
            log.warning(
                "checkpoint %s was not mirrored to %s (training goes on; it is complete here): %s",
                tag,
                self.mirror.tag_url(tag),
                said["error"],
            )
            return said
        said.update(url=self.mirror.tag_url(tag), seconds=round(time.monotonic() - began, 2), bytes=sent)
        log.info(
            "mirrored checkpoint %s to %s (%.1f MB in %.1f s, off the training thread)",
            tag,
            said["url"],
            sent / 1e6,
            said["seconds"],
        )
        try:
            removed = self.mirror.prune(tag, self.keep)
        except Exception as err:
            log.warning("the mirror %s was not pruned (training goes on): %s", self.mirror.url, one_line(err))
        else:
            if removed:
                log.info("pruned %s from the mirror (train.keep_checkpoints=%d)", ", ".join(removed), self.keep)
        return said


def _stage(step_dir: Path, stage: Path) -> None:
    """Hard links to `step_dir`'s mirrored files in `stage` (a copy where the file system has no links)."""
    shutil.rmtree(stage, ignore_errors=True)
    for path in mirrored_files(step_dir):
        dest = stage / path.relative_to(step_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)
