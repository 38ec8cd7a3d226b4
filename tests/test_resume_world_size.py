"""Resume on another world size (issue 28): a checkpoint written by 2 ranks continues on 1, and
one written by 1 on 2, under ZeRO-1/2 and ZeRO-3, with the global batch kept (grad_accum
follows) and the global data order re-split, so that every step's loss equals the
uninterrupted 2-rank run's to fp32 round-off and every step reads the same samples
(`data_digest`, summed over the ranks). The model's training noise is drawn per rank
(docs/reliability.md, "Resume on another world size"), so these runs train without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faults import build_data, records, run_job, train_args

from data_pipeline.loader import DIGEST_MOD

STEPS, STOP = 12, 6
NO_NOISE = ("model.state_noise_std=0", "model.gate_noise_std=0", f"train.schedule_steps={STEPS}")
STAGES = {"zero2": "ds_configs/zero2.json", "zero3": "ds_configs/zero3.json"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("world_size_data"))


def per_step(out: Path) -> dict[int, tuple[float, int]]:
    """step -> (loss, the step's data digest summed over the ranks that ran it), from every
    rank's metrics file; within a file the last record of a step wins (a resumed run appends)."""
    steps: dict[int, tuple[float, int]] = {}
    for path in sorted(out.glob("metrics*.jsonl")):  # rank 0's first: metrics.jsonl holds the loss
        mine = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            mine[rec["step"]] = rec
        for step, rec in mine.items():
            loss, digest = steps.get(step, (rec["loss"], 0))
            steps[step] = (loss, (digest + rec["data_digest"]) % DIGEST_MOD)
    return steps


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
    [("zero3", 2, 1), ("zero3", 1, 2), ("zero2", 2, 1)],
    ids=["zero3-2-to-1", "zero3-1-to-2", "zero2-2-to-1"],
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
