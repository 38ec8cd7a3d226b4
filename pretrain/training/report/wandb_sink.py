"""Optional Weights & Biases logging (train.wandb=true, the [wandb] extra), rank 0 only.

The same scalars as TensorBoard go to one W&B run (a sink of `MetricsWriter.scalars`), with the
training step as W&B's step. The run's id is saved in every checkpoint (`WANDB_FILE`, beside
config.json), so a resume from a checkpoint continues the same W&B run (`resume="allow"`)
rather than starting a new one. `wandb` is imported only when a run asks for it.

A loss-spike rollback (`MetricsWriter.rewind`) rewinds the W&B run too, with W&B's own
"rewind a run" (`wandb.init(resume_from="<id>?_step=<step>")`): the run keeps its id and step
axis, its history after the step is dropped, and the steps trained again are logged at their own
step numbers, as TensorBoard and metrics.jsonl show them. Chosen over a W&B step of its own
(monotonic, with the training step as a field and `define_metric`): that keeps the abandoned
points in every chart, beside the re-trained ones, and W&B's rewind does not work with it. In
offline mode the rewind is recorded in the new segment (its branch point) and `wandb sync`
applies it. Where the server refuses it (rewind is a preview feature of W&B), one warning, and
the run resumes as it would without: W&B ignores the steps at or below its last one. A resume
whose W&B run has logged past the checkpoint (online, W&B knows the run's last step; offline it
does not) is rewound the same way, so the re-trained steps are kept.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grt_common.errors import ConfigError, one_line
from pretrain.runs.checkpoint_files import TAG_RE
from pretrain.training.callbacks import Callback

if TYPE_CHECKING:
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.report.metrics import MetricsWriter
    from pretrain.training.run_context import RunContext

log = logging.getLogger("grt.train")

WANDB_FILE = "wandb.json"  # in a checkpoint tag directory: {"id", "project", "entity"} of the run's W&B run
INSTALL_HINT = "pip install 'grt-pretrain[wandb]'"


def import_wandb() -> Any:
    """The wandb module; ConfigError of one line where it is not installed."""
    try:
        import wandb
    except ImportError:  # also sys.modules["wandb"] = None
        raise ConfigError(f"train.wandb=true needs the wandb package: {INSTALL_HINT}") from None
    return wandb


def check_available(cfg: RunConfig) -> None:
    """For the start-up checks (before any process group, nothing written yet): refuse train.wandb=true
    without wandb, or, unless W&B runs offline (WANDB_MODE=offline or disabled), without a W&B login
    (an API key in WANDB_API_KEY or from `wandb login`; checked without the network)."""
    if not cfg.train.wandb:
        return
    wandb = import_wandb()
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return
    try:
        wandb.login(verify=False)  # raises where no API key is configured; never prompts without a terminal
    except Exception as err:  # wandb's UsageError, or whatever its settings raise
        raise ConfigError(
            f"train.wandb=true: not logged in to W&B ({one_line(err)[:200]}): log in (`wandb login` or "
            "WANDB_API_KEY), or set WANDB_MODE=offline and `wandb sync` later"
        ) from None


def new_id() -> str:
    """A new W&B run id: 8 random lowercase letters and digits, W&B's own form (wandb 0.31 has
    no public generator: `wandb.util.generate_id` is gone, `wandb.sdk.lib.runid` is private)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def saved_id(tag_dir: Path | None) -> str | None:
    """The W&B run id saved in checkpoint `tag_dir` (None: no checkpoint, or none saved in it)."""
    if tag_dir is None:
        return None
    path = tag_dir / WANDB_FILE
    try:
        run_id = json.loads(path.read_text())["id"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("%s cannot be read (%s): W&B logs to a new run", path, one_line(err))
        return None
    return run_id if isinstance(run_id, str) and run_id else None


class WandbRun(Callback):
    """One W&B run of a training run (rank 0): `log` is the MetricsWriter sink, `files` goes
    into every checkpoint (`on_save`), `finish` at the end."""

    def __init__(self, run: Any, project: str, entity: str, reopen: Callable[..., Any] | None = None) -> None:
        self.run, self.project, self.entity = run, project, entity
        self.reopen = reopen  # wandb.init with the run's own arguments, plus those given (`rewind`)
        self.failed = False  # a log call failed: W&B is off for the rest of the run

    @classmethod
    def build(cls, run: RunContext, writer: MetricsWriter, resumed_from: Path | None) -> WandbRun | None:
        """`open` on rank 0 (None elsewhere, or with train.wandb off), as a sink of `writer` that
        follows its rewinds (a rollback), finished when the run closes (before the writer)."""
        opened = cls.open(run.out, run.cfg, resumed_from) if run.rank == 0 else None
        if opened is not None:
            writer.add_sink(opened.log, opened.rewind)
            run.closing.callback(opened.finish)
        return opened

    @classmethod
    def open(cls, out: Path, cfg: RunConfig, resumed_from: Path | None) -> WandbRun | None:
        """None where train.wandb is off. Otherwise the W&B run, in `out`/wandb: the one whose id
        checkpoint `resumed_from` (a tag directory) saved, else a new one. ConfigError (one
        line) without the wandb package, or where W&B cannot start (no login, no network)."""
        t = cfg.train
        if not t.wandb:
            return None
        wandb = import_wandb()
        run_id = saved_id(resumed_from) or new_id()
        reopen = functools.partial(
            wandb.init,
            project=t.wandb_project,
            entity=t.wandb_entity or None,
            dir=str(out),
            config=cfg.to_dict(),
            name=out.name,
        )
        try:
            run = reopen(id=run_id, resume="allow")
        except Exception as err:  # wandb's errors (login, network, settings) have no common base
            raise ConfigError(
                f"train.wandb=true: W&B could not start ({one_line(err)[:300]}); log in (`wandb login` or "
                "WANDB_API_KEY), or set WANDB_MODE=offline and `wandb sync` later"
            ) from None
        if getattr(run, "offline", False):
            where = out / "wandb" / f"offline-run-*-{run_id}"  # one directory per segment (start, resume)
            log.info("W&B run %s (project %s), offline: `wandb sync %s` uploads it", run_id, t.wandb_project, where)
        else:
            log.info("W&B run %s (project %s): %s", run_id, t.wandb_project, getattr(run, "url", None))
        opened = cls(run, t.wandb_project, t.wandb_entity, reopen)
        tag = TAG_RE.match(resumed_from.name) if resumed_from is not None else None
        if tag is not None and int(getattr(run, "step", 0) or 0) > int(tag.group(1)) + 1:
            opened.rewind(int(tag.group(1)))  # W&B logged past the checkpoint (a kill after it): as a rollback
        return opened

    @property
    def id(self) -> str:
        return str(self.run.id)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """`values` at W&B step `step`. A failure here (the W&B service gone, a full disk in
        offline mode) is one warning and W&B is off from then on: losing the W&B copy of the
        curves must not stop a training run (TensorBoard and metrics.jsonl still have them)."""
        if self.failed:
            return
        try:
            self.run.log(dict(values), step=step)
        except Exception as err:
            self.failed = True
            log.warning("W&B logging failed at step %d (%s): training goes on without W&B", step, one_line(err))

    def rewind(self, step: int) -> None:
        """Back to training step `step` (a rollback): the run is closed and opened again rewound to
        it (module doc). Never raises: a failure is one warning, and W&B is off if it cannot reopen."""
        if self.failed or self.reopen is None:
            return
        run_id = self.id
        try:
            self.run.finish()
            try:
                self.run = self.reopen(resume_from=f"{run_id}?_step={step}")
            except Exception as err:
                log.warning(
                    "W&B could not rewind run %s to step %d (%s): it resumes, and ignores the steps up to its last",
                    run_id,
                    step,
                    one_line(err)[:300],
                )
                self.run = self.reopen(id=run_id, resume="allow")
        except Exception as err:
            self.failed = True
            log.warning("W&B could not reopen run %s (%s): training goes on without W&B", run_id, one_line(err))

    def files(self) -> dict[str, str]:
        """{file name: text} to write into every checkpoint: the id a resume continues."""
        return {WANDB_FILE: json.dumps({"id": self.id, "project": self.project, "entity": self.entity}) + "\n"}

    def on_save(self, step: int, files: dict[str, str]) -> None:
        files.update(self.files())

    def finish(self) -> None:
        """Close the run (uploads what is left; offline: closes the local files). Never raises,
        for the same reason as `log`."""
        try:
            self.run.finish()
        except Exception as err:
            log.warning("W&B could not finish run %s (%s)", self.id, one_line(err))
