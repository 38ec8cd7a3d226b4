"""The one entry to a run's start: a run config (a `grt train` command line's, command_line.py, or
a saved one) to what the run starts with: its `StartPlan` (plan.py: the resume or branch chosen,
every refusal, the merged DeepSpeed config) where the start can be planned here, else the run
config and its DeepSpeed config as far as this host can resolve them.

Called by `grt train` (the trainer's start, `--dry-run`, `--print-config`, `--print-ds-config`; a
decay branch's `--branch-from` is planned against its source checkpoint) and by `grt launch`,
which resolves the command line once for every rank (launcher/cli.py).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Literal

from pretrain.distributed import discover
from pretrain.runs.run_config import RunConfig, check_out, resolve
from pretrain.training.start.plan import StartPlan, checked_ds_config, plan_start

# Where the ranks start, against what this host can read:
#   "here": on this host: planned (the data must be readable here);
#   "if readable": planned where the data can be read here, else the config as given (said);
#   "elsewhere": on other hosts: resolved against the data where it can be read here, not planned.
Where = Literal["here", "if readable", "elsewhere"]


@dataclass(frozen=True)
class Start:
    """What a run starts with: the run config, its merged and checked DeepSpeed config, and the
    plan they come from (None where the start was not planned here: `notes` say how far it went)."""

    cfg: RunConfig
    ds: dict[str, Any]
    plan: StartPlan | None = None
    notes: tuple[str, ...] = ()

    @property
    def planned(self) -> StartPlan:
        assert self.plan is not None, "a start planned here"
        return self.plan

    def start_lines(self) -> list[str]:
        """What the start says first: the plan's lines (`StartPlan.start_lines`), else how far it went."""
        return self.plan.start_lines() if self.plan is not None else list(self.notes)


def readable_here(cfg: RunConfig) -> bool:
    """Whether the run's data (its manifests) can be read on this host."""
    return bool(cfg.data) and all(os.path.isfile(p) for p in cfg.data_spec.paths)


def run_start(
    cfg: RunConfig,
    resume: bool,
    world: int | None = None,
    use_cuda: bool | None = None,
    where: Where = "here",
) -> Start:
    """The start of a run of `cfg` on `world` ranks (default: this launch's), resuming (`resume`, or
    a decay branch) from the newest complete checkpoint in its run directory: planned (`plan_start`)
    or, where `where` allows, as far as this host can resolve it. ConfigError (one line) refuses."""
    resume = resume or bool(cfg.branch_from)
    if where == "here" or (where == "if readable" and readable_here(cfg)):
        plan = plan_start(cfg, resume, world, use_cuda)
        return Start(plan.cfg, plan.ds, plan)
    notes: list[str] = []
    if where == "elsewhere" and readable_here(cfg):  # the checks that need the data: vocabulary and context
        cfg = resolve(copy.deepcopy(cfg), cfg.data_spec.load(), notes)
    else:  # not resolved against the data here: --out's rule still holds where this host sees it
        if cfg.out and os.path.isdir(cfg.out):
            check_out(cfg)
        if where == "if readable":
            notes.append(f"data={cfg.data!r} cannot be read here: the config as given, not resolved against the data")
    if use_cuda is None:
        import torch

        use_cuda = torch.cuda.is_available()
    return Start(cfg, checked_ds_config(cfg, world or discover().world_size, use_cuda), None, tuple(notes))
