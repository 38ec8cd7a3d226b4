"""A run's checkpoints at run time: the resume's load (the planned checkpoint, or where not every
rank can load it an older one, agreed: store.load_agreed), the saves, and the rollbacks of
train.loss_spike_action=rollback with their record of the data they skip (<out>/data_skips.json,
which a resume from that checkpoint follows). Every method is a collective."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from grt_common.files import atomic_write_text
from pretrain.runs.checkpoint_files import DATA_SKIPS, Fallback, find_latest, ranks_that_wrote, tag_for
from pretrain.say import say
from pretrain.training.checkpoint import store, universal
from pretrain.training.health import TrainingStopped
from pretrain.training.start.plan import StartPlan, check_fallback

if TYPE_CHECKING:
    from collections.abc import Mapping

    from deepspeed import DeepSpeedEngine

log = logging.getLogger("grt.train")


@dataclass(frozen=True)
class Loaded:
    """What a load restores besides the engine's state."""

    tag: str
    step: int
    loader: dict[str, Any]  # the data's position to go on from
    loss_history: list[float]  # the loss-spike statistic's (empty for a checkpoint from before it)
    tokens: dict[str, int] | None  # the tokens trained by source (data.RunData.trained); None: saved before them


class RunCheckpoints:
    def __init__(self, plan: StartPlan, rank: int, world: int) -> None:
        self.plan, self.rank, self.world = plan, rank, world
        self.out, self.root = Path(plan.cfg.out), plan.root
        self.rollbacks: dict[str, int] = {}  # rollbacks to each checkpoint tag
        self.pending: store.PendingSave | None = None  # train.async_save: being written

    def latest(self) -> str | None:
        return find_latest(self.root)

    def load(self, engine: DeepSpeedEngine) -> Loaded:
        """The planned checkpoint or, where it cannot be loaded on every rank, an older complete one
        (checked as the plan's: `start.check_fallback`); says what the resume passed over and changes."""
        assert self.plan.resume is not None
        notes: dict[str, tuple[str, ...]] = {}

        def precheck(tag: str) -> None:
            notes[tag] = check_fallback(self.plan, tag)

        fallback = Fallback(self.root, self.plan.resume.candidates)
        tag, state = store.load_agreed(engine, fallback, self.rank, self.world, precheck=precheck)
        step, position = state["step"], state["loader"]
        skip = self.data_skips().get(tag)
        if skip is not None:  # rolled back to: the data continues where the rollback did, the window before skipped
            position = skip["loader"]
            log.info(
                "checkpoint %s was rolled back to after the loss spike at step %d: the data continues at global "
                "position %d of epoch %d, the window before it skipped (%s)",
                tag,
                skip["spike_step"],
                position["position"],
                position["epoch"],
                self.out / DATA_SKIPS,
            )
        if not state["rng_restored"]:
            streams = np.random.SeedSequence([self.plan.cfg.train.seed, step, self.rank])
            torch.manual_seed(int(streams.generate_state(1)[0]))
            how = (
                f"through DeepSpeed's universal checkpoint ({universal.universal_dir(self.root / tag)})"
                if engine.load_universal_checkpoint()
                else "(its ZeRO stage 0 state is whole on every rank)"
            )
            log.info(
                "checkpoint %s was written by %d rank(s), loaded on %d %s; the data order continues at global "
                "position %d; the per-rank random streams (training noise) start anew from (seed, step, rank)",
                tag,
                ranks_that_wrote(self.root / tag),
                self.world,
                how,
                state["loader"].get("position", 0),
            )
        for line in self.plan.resume_lines(tag, fallback.unloadable(), notes.get(tag, ())):
            say(line)
        return Loaded(tag, step, position, list(state.get("loss_history", [])), state.get("tokens"))

    def save(
        self,
        engine: DeepSpeedEngine,
        step: int,
        *,
        config_json: str,
        loader_state: dict[str, Any],
        fit_state: dict[str, Any],
        run_files: Mapping[str, str] | None,
        wait: bool = True,
    ) -> str:
        """Checkpoint `step`, complete when this returns; with train.async_save and not `wait`, its
        files are written in the background and it is completed by `settle` (a previous one still
        being written is completed first)."""
        background = self.plan.cfg.train.async_save
        self.settle(engine, wait=True)
        how = {
            "config_json": config_json,
            "tokenizer_path": self.plan.data.tokenizer_path,
            "loader_state": loader_state,
            "keep": self.plan.cfg.train.keep_checkpoints,
            "rank": self.rank,
            "run_files": run_files,
            "fit_state": fit_state,
        }
        try:
            if not background:
                return store.save(engine, self.root, step, **how)
            self.pending = store.start_save(engine, self.root, step, **how)
        except store.CheckpointError as err:  # every rank agreed on it: stop cleanly, nothing half-written is used
            raise TrainingStopped(str(err)) from err
        if wait:
            self.settle(engine, wait=True)
        return self.pending.tag if self.pending is not None else tag_for(step)

    def settle(self, engine: DeepSpeedEngine, wait: bool = False) -> str | None:
        """Complete the checkpoint being written in the background once every rank's writes have
        ended (`wait`: after waiting for them); the tag it completed, else None (collective)."""
        pending = self.pending
        if pending is None or not (wait or store.writes_ended(pending)):
            return None
        self.pending = None
        try:
            tag = store.finish_save(pending, self.root, self.rank)
        except store.CheckpointError as err:
            raise TrainingStopped(str(err)) from err
        log.info("checkpoint %s complete (written in the background)", self.root / tag)
        return tag

    def data_skips(self) -> dict[str, Any]:
        """<out>/data_skips.json: per checkpoint tag, where a resume from it takes the data (a rollback's)."""
        path = self.out / DATA_SKIPS
        return json.loads(path.read_text()) if path.is_file() else {}

    def roll_back(self, engine: DeepSpeedEngine, spike_step: int, position: dict[str, Any]) -> Loaded:
        """A loss spike at `spike_step` with the data at `position`: record that a resume from the last
        complete checkpoint continues the data there (the window since the checkpoint, spike included,
        skipped), then load that checkpoint (model, optimizer, step, spike history, RNG) in this
        process. Too many rollbacks to one checkpoint (train.max_bad_steps) stop the run."""
        self.settle(engine, wait=True)
        tag = self.latest()
        assert tag is not None  # bad_batches raises SpikeRollback only when there is one
        self.rollbacks[tag] = self.rollbacks.get(tag, 0) + 1
        if self.rollbacks[tag] > self.plan.cfg.train.max_bad_steps:
            raise TrainingStopped(
                f"loss spike at step {spike_step}: rolled back to checkpoint {tag} {self.rollbacks[tag] - 1} times "
                "already (train.max_bad_steps); the loss level may have moved: train.loss_spike_action=log or a "
                "higher train.loss_spike_threshold"
            )
        if self.rank == 0:
            skips = self.data_skips()
            skips[tag] = {"spike_step": spike_step, "loader": position}
            atomic_write_text(self.out / DATA_SKIPS, json.dumps(skips, indent=2) + "\n")
        engine.zero_grad()  # the step's micro-batches backwarded before the spike add nothing
        state = store.load(engine, self.root, tag, self.rank, self.world)
        if self.rank == 0:
            log.warning(
                "loss spike at step %d: rolled back to checkpoint %s (step %d); the data since it is skipped, the "
                "loader goes on at global position %d of epoch %d (recorded in %s for a resume)",
                spike_step,
                tag,
                state["step"],
                position["position"],
                position["epoch"],
                self.out / DATA_SKIPS,
            )
        return Loaded(tag, state["step"], position, list(state.get("loss_history", [])), state.get("tokens"))
