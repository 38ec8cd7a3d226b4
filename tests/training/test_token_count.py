"""One count of what was trained (issue 40, class 5): the tokens trained, in all and per source,
counted from the micro-batches a step kept (data_pipeline/batches.py `TokenCount`), saved with
every checkpoint and read alike by the budget, the stages, the repetition cap and summary.json,
so that a changed batch, a skipped window or a rollback cannot make them disagree."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from train_jobs import run_job, train_args

from data_pipeline.batches import plan_stages
from data_pipeline.mixture import DataMixture, MixtureError, parse_stages
from data_pipeline.mixture_loader import MixtureLoader
from pretrain.runs.data_spec import load_manifest

SEQ = 64  # the shards fixture's sequence length


def mixture_of(shards: Path, *names: str) -> DataMixture:
    """The fixture's manifest as a source of each name, weight 1 (a mixture whose draws are counted)."""
    data = load_manifest(",".join(f"{n}=1:{shards}" for n in names))
    assert isinstance(data, DataMixture)
    return data


def budget_args(data: str, out: Path, tokens: int, *sets: str, micro: int = 4) -> list[str]:
    args = train_args(Path(data), out, 1, f"train.tokens={tokens}", *sets, micro_batch_size=micro)
    del args[args.index("--steps") : args.index("--steps") + 2]  # the budget sets the length
    return args


def test_a_resume_with_a_changed_batch_trains_the_budget_in_tokens(shards, tmp_path):
    """4 steps of 256 tokens, then train.tokens=3072 resumed at 512 tokens a step: 4 more steps (8 in
    all: the 1,024 trained, then 2,048 at the new batch), said as such, not '6 steps of 512 tokens'."""
    out = tmp_path / "run"
    rcs, job = run_job(budget_args(str(shards), out, 1024, "train.save_every=4"), tmp_path / "logs", world=1)
    assert rcs == [0], job.output()
    resumed = [*budget_args(str(shards), out, 3072, "train.allow_batch_change=true", micro=8), "--resume"]
    rcs, job = run_job([*resumed, "--dry-run"], tmp_path / "logs", world=1)
    assert rcs == [0], job.output()
    said = job.output(0)
    assert "train.tokens=3072: 8 steps (4 trained, 1024 tokens; then 4 of 512 tokens) (3072 tokens)" in said, said
    assert "for 8 steps" in said
    assert "train.steps 4 -> 6" not in said  # the fresh run's count of the budget is not what trains
    state = torch.load(out / "checkpoints" / "step00000004" / "rank0_state.pt", weights_only=False)
    assert state["tokens"] == {"": 1024}  # the count the budget went on from, saved with the checkpoint


def test_a_stage_starts_at_its_tokens_read_whatever_the_global_batch(shards):
    """A stage at 2,048 tokens: after 2 global batches of 8 samples (1,024 tokens) resumed with global
    batches of 16, the mixture's own weights hold for one more batch, then only b is drawn."""
    data = mixture_of(shards, "a", "b")
    stages = parse_stages(f"{32 * SEQ}:b=1", data.names)
    before = MixtureLoader(data, micro_batch_size=8, global_batch=8, stages=stages)
    it = iter(before)
    for _ in range(2):
        next(it)
    after = MixtureLoader(data, micro_batch_size=16, global_batch=16, stages=stages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the changed global batch, said once
        after.load_state_dict(before.state_dict())
    assert after.stage()[0] == 0  # 1,024 tokens read, not 2 batches x 16 x 64
    it = iter(after)
    next(it)
    assert after.stage() == (1, 3, {"a": 0.0, "b": 1.0})  # 2,048 read before global batch 3
    a_drawn = int(after.cursors[0])
    next(it)
    assert int(after.cursors[0]) == a_drawn and after.round_tokens == {"a": 0, "b": 16 * SEQ}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_run_that_exhausts_its_cap_exactly_trains_to_its_end(shards, workers):
    """The cap check passes a run that reads every sample its cap allows; the loader's read-ahead
    (a chunk of draws past the run's last batch) does not end it: only a batch past the cap would."""
    data = mixture_of(shards, "only")
    size = data.source_sequences("train")["only"]
    steps = 37
    max_repeats = (steps * 8 + 0.5) / size  # the cap is the run's 37 global batches of 8 exactly
    loader = MixtureLoader(data, micro_batch_size=4, global_batch=8, max_repeats=max_repeats, num_workers=workers)
    it = iter(loader)
    trained = [next(it) for _ in range(2 * steps)]
    assert len(trained) == 2 * steps and loader.exhausted == {"only": steps}
    plan_stages(data, "", max_repeats, steps * 8, "mixture", 8)  # the plan's check: it fits
    with pytest.raises(MixtureError, match="the sources give at most 296"):
        plan_stages(data, "", max_repeats, steps * 8 + 8, "mixture", 8)


def test_the_cap_check_counts_a_source_only_where_its_stage_draws_it(shards):
    """a and c, each capped at N samples; from N/2 samples on a stage draws only a: the run can read
    N/2 + 3N/4 samples (c's cap unused after the stage), not 2N."""
    data = mixture_of(shards, "a", "c")
    n = data.source_sequences("train")["a"]
    stage = f"{(n // 2) * SEQ}:a=1"
    plan_stages(data, stage, 1.0, int(1.2 * n), "mixture")
    with pytest.raises(MixtureError, match=r"the sources drawn \(stage 1, a=1 c=0\) running out there"):
        plan_stages(data, stage, 1.0, int(1.5 * n), "mixture")


def test_a_rollback_restores_the_token_count_of_its_checkpoint(shards, tmp_path):
    """A loss spike at step 26 rolls back to step 20 and the data skips the window since: summary.json
    counts the 30 steps trained (tokens_by_source too), not the window read and thrown away."""
    out = tmp_path / "run"
    data = f"a=1:{shards},b=1:{shards}"
    sets = ["train.loss_spike_action=rollback", "train.save_every=20", "train.save_final=false"]
    args = train_args(Path(data), out, 30, *sets, ds_config="ds_configs/zero2.json", micro_batch_size=2)
    spike = {"GRT_INJECT_NAN_STEPS": "26", "GRT_INJECT_LOSS_FACTOR": "20"}
    rcs, job = run_job(args, tmp_path / "logs", world=1, env=spike)
    assert rcs == [0], job.output()
    assert "rolled back to checkpoint step00000020" in (out / "train.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    per_step = 2 * SEQ
    assert summary["steps"] == 30 and sum(summary["tokens_by_source"].values()) == 30 * per_step, summary
    assert summary["tokens"] == 30 * per_step, summary
    skip = json.loads((out / "data_skips.json").read_text())["step00000020"]["loader"]
    assert sum(skip["cursors"].values()) >= 26 * 2  # the window read before the spike is not counted
