"""Resume on another world size (issue 28): a checkpoint written by 2 ranks continues on 1, and
one written by 1 on 2, under ZeRO-1/2 and ZeRO-3, with the global batch kept (grad_accum
follows) and the global data order re-split, so that every step's loss equals the
uninterrupted 2-rank run's to fp32 round-off and every step reads the same samples
(`data_digest`, summed over the ranks). The model's training noise is drawn per rank
(docs/reliability.md, "Resume on another world size"), so these runs train without it.
From 1 rank to 2 under ZeRO-3, the same end to end: tests/training/test_muon.py (its AdamW half
too), and each state bit for bit: tests/training/test_universal_checkpoint.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from train_jobs import build_data, per_step, records, run_job, train_args

from grt_common.errors import ConfigError
from pretrain.runs.run_config import RunConfig
from pretrain.training.start.resume_check import keep_global_batch

STEPS, STOP = 12, 6
NO_NOISE = ("model.state_noise_std=0", "model.gate_noise_std=0", f"train.schedule_steps={STEPS}")
STAGES = {"zero2": "ds_configs/zero2.json", "zero3": "ds_configs/zero3.json"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("world_size_data"))


def train(data: Path, out: Path, world: int, steps: int, stage: str, resume: bool = False) -> str:
    """A run on `world` ranks; a fresh one with the reference's global batch (4 x 2 ranks), a
    resume with what the checkpoint asks (grad_accum follows)."""
    batch = () if resume else (f"train.grad_accum={2 // world}",)
    args = train_args(data, out, steps, *NO_NOISE, *batch, resume=resume, ds_config=STAGES[stage])
    rcs, job = run_job(args, out.parent / f"logs-{out.name}", world=world, timeout=300)
    assert rcs == [0] * world, job.output()
    return job.output(0)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[int, tuple[float, int]]:
    """The uninterrupted 2-rank ZeRO-3 run. ZeRO-1/2 runs are compared with it too: the stages
    compute the same steps (their per-step losses agree to fp32 round-off; measured: identical)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(data, out, 2, STEPS, "zero3")
    return per_step(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,before,after",
    [("zero3", 2, 1), ("zero2", 2, 1)],
    ids=["zero3-2-to-1", "zero2-2-to-1"],
)
def test_resume_on_another_world_size_continues_the_run(data, reference, tmp_path, stage, before, after):
    out = tmp_path / "run"
    train(data, out, before, STOP, stage)
    log = train(data, out, after, STEPS, stage, resume=True)
    assert f"on {after} rank(s) instead of {before}" in log, log
    assert "universal checkpoint" in log, log
    got = per_step(out)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    worst = max(abs(got[s][0] - reference[s][0]) for s in reference)
    print(f"\nWORLD-SIZE RESUME {stage} {before} -> {after} ranks: max |loss - reference| = {worst:.2e}")
    assert [got[s][1] for s in reference] == [reference[s][1] for s in reference], "a step read other samples"
    assert worst < 2e-5, {s: (got[s][0], reference[s][0]) for s in reference}
    assert len(records(out)) == STEPS  # no step recorded twice (the stopped run ended at its checkpoint)


def _cfg(micro: int, accum: int, **train) -> RunConfig:
    cfg = RunConfig(data="d", out="o")
    cfg.train.micro_batch_size, cfg.train.grad_accum = micro, accum
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


SAVED = {"micro_batch_size": 4, "grad_accum": 3}  # x 2 ranks: a global batch of 24


@pytest.mark.parametrize(
    "micro,accum,world,want",
    [
        (4, 3, 2, 3),  # the same world: unchanged
        (4, 3, 1, 6),  # 2 -> 1 rank: twice the accumulation
        (4, 3, 6, 1),  # 2 -> 6 ranks: one micro-batch each
        (2, 3, 3, 4),  # micro-batch 2 on 3 ranks: 24 / 6
        (4, 6, 1, 6),  # grad_accum given as the one that keeps it: accepted
    ],
)
def test_the_global_batch_is_kept_by_grad_accum(micro, accum, world, want):
    cfg = _cfg(micro, accum)
    note = keep_global_batch(cfg, SAVED, 2, world, "checkpoint step00000006")
    assert cfg.train.grad_accum == want
    assert cfg.train.micro_batch_size * cfg.train.grad_accum * world == 24
    assert ("keeps the global batch of 24" in note) == (world != 2)


@pytest.mark.parametrize(
    "micro,accum,world,want",
    [
        (
            4,
            3,
            4,
            "world sizes that can, with micro-batch 4: 1, 2, 3, 6; micro-batch sizes that can, on 4 rank(s): "
            "1, 2, 3, 6",
        ),
        (5, 3, 2, "cannot split into whole micro-batches"),
        (4, 2, 2, "train.grad_accum 2 would change the global batch of 24 sequences"),
    ],
)
def test_a_split_that_cannot_keep_the_global_batch_is_refused_naming_those_that_can(micro, accum, world, want):
    with pytest.raises(ConfigError, match=re.escape(want)) as err:
        keep_global_batch(_cfg(micro, accum), SAVED, 2, world, "checkpoint step00000006")
    assert "train.allow_batch_change=true" in str(err.value)


def test_allow_batch_change_takes_the_given_sizes():
    cfg = _cfg(4, 2, allow_batch_change=True)
    note = keep_global_batch(cfg, SAVED, 2, 4, "checkpoint step00000006")
    assert cfg.train.grad_accum == 2 and "the global batch changes 24 -> 32" in note
