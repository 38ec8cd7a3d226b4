"""Exact resume with loader workers (issue 49): a run of 6 steps with `train.num_workers=2`, stopped
at step 3 and resumed, gives the uninterrupted run's per-step losses bit for bit (fp32 on CPU, the
training noise on). Before: the DataLoader's start drew its workers' base seed from the trainer's
global random stream, one draw more on a resume than in the uninterrupted run, so the state and gate
noise of every later step differed (losses up to 2.5e-4 apart)."""

from __future__ import annotations

from train_jobs import losses, run_job, train_args

STEPS, STOP = 6, 3
WORKERS = ("train.num_workers=2", "train.save_every=3", f"train.schedule_steps={STEPS}")  # one schedule for both


def test_a_resume_with_loader_workers_reproduces_the_losses(shards, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    for out, steps, resume in ((full, STEPS, False), (cut, STOP, False), (cut, STEPS, True)):
        rcs, job = run_job(
            train_args(shards, out, steps, *WORKERS, resume=resume), tmp_path / "logs", world=1, timeout=400
        )
        assert rcs == [0], job.output()
    # it resumed (a fresh start gives the same losses and rewrites metrics.jsonl: only its line tells)
    assert f"step{STOP:08d} at step {STOP}" in job.output(0, tail=10**6), job.output()
    want, got = losses(full), losses(cut)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    assert {s: got[s] for s in got if s > STOP} == {s: want[s] for s in want if s > STOP}, (want, got)
