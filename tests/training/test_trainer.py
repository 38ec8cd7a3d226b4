"""The DeepSpeed trainer: gradient correctness under ZeRO, multi-rank training, exact resume,
identical depths across ranks, TensorBoard scalars."""

import json
import math
import subprocess
import sys

import pytest
from commands import train_command
from multiproc import REPO, grt, run_ranks

from pretrain.presets import PRESETS
from pretrain.training.depth import sample_depth

pytestmark = pytest.mark.filterwarnings("ignore")


def test_sampled_depth_is_a_function_of_seed_and_step():
    draws = [sample_depth("uniform", 6, seed=7, step=s) for s in range(200)]
    assert draws == [sample_depth("uniform", 6, seed=7, step=s) for s in range(200)]
    assert set(draws) == set(range(1, 7))
    assert draws != [sample_depth("uniform", 6, seed=8, step=s) for s in range(200)]
    assert {sample_depth("fixed", 6, 0, s) for s in range(10)} == {6}
    poisson = [sample_depth("poisson", 32, 0, s, poisson_mean=32) for s in range(300)]
    assert min(poisson) >= 1 and 20 < sum(poisson) / len(poisson) < 45
    logu = [sample_depth("loguniform", 32, 0, s) for s in range(4000)]
    assert set(logu) == set(range(1, 33))  # every depth up to the maximum is trained
    assert logu.count(1) > 4 * logu.count(8) > 0  # short depths most: P(r) ~ log((r+1)/r)


def test_max_train_depth_sets_the_sampled_range():
    from pretrain.runs.train_config import TrainConfig
    from pretrain.training.depth import depth_for_step

    t = TrainConfig(depth_sampling="loguniform", max_train_depth=24)
    assert max(depth_for_step(t, 4, s) for s in range(2000)) == 24
    assert {depth_for_step(TrainConfig(), 4, s) for s in range(200)} == {1, 2, 3, 4}  # 0: the layout's R
    assert depth_for_step(t, 0, 5) == 0  # a dense model has no loop


@pytest.mark.slow
@pytest.mark.parametrize("stage,world", [(2, 2), (3, 2), (3, 1)])
@pytest.mark.parametrize("preset", ["micro-grt", "micro-dense"])
def test_zero_gradients_equal_single_process_reference(tmp_path, stage, world, preset):
    """Gradients equal a single-process reference over depths 3, 1, 0, 2 in a row. Under ZeRO-3
    the pinned modules run without ZeRO-3's module hooks (2 ranks: the loop; 1 rank: the whole
    model), and the recorded module order survives every change of depth."""
    report_path = tmp_path / "report.json"
    depths = "3,1,0,2" if "grt" in preset else "0,0"
    results = run_ranks(
        [str(REPO / "tests" / "dist_scripts" / "grad_check.py"), str(stage), preset, str(report_path), depths],
        world=world,
        timeout=300,
    )
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    report = json.loads(report_path.read_text())
    assert len(report["steps"]) == len(depths.split(","))
    for step in report["steps"]:
        for name, g in step["grads"].items():
            assert g["max_abs_diff"] <= 1e-5 + 1e-4 * g["ref_max"], (step["depth"], name, g)
        assert step["unused_with_nonzero_grad"] == []
    if stage == 3:
        assert report["trace_invalidations"] == 0


def train_args(manifest, out, steps=30, *extra):
    sets = (
        "train.log_every=1",
        "train.save_every=10",
        "train.eval_every=10",
        "train.eval_batches=2",
        "train.warmup_steps=3",
        "train.lr=3e-3",
        "train.activation_checkpointing=loop_step",
    )
    zero3 = str(REPO / "ds_configs" / "zero3.json")
    command = train_command("micro-grt", manifest, out, steps, 4, zero3, sets, *extra, grad_accum=2)
    return ["-m", "pretrain.cli", *command]


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    results = run_ranks(train_args(shards, out), world=2, timeout=600)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    return out


@pytest.mark.slow
def test_two_ranks_zero3_train_and_the_loss_falls(two_rank_run):
    records = read_records(two_rank_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 0.5, (first, last)
    summary = json.loads((two_rank_run / "summary.json").read_text())
    # the table by value: the last validation's loss at each depth (metrics.jsonl), depths that differ
    val = next(r["val"] for r in reversed(records) if "val" in r)
    table = {str(d): val[f"val/loss_depth_{d}"] for d in range(4)}
    assert summary["val_loss_by_depth"] == table and len(set(table.values())) > 1, (summary, val)
    assert all(math.isfinite(v) and v > 0 for v in table.values()), table


@pytest.mark.slow
def test_depths_are_identical_on_every_rank(two_rank_run):
    rank0 = [r["depth"] for r in read_records(two_rank_run / "metrics.jsonl")]
    rank1 = [r["depth"] for r in read_records(two_rank_run / "metrics.rank1.jsonl")]
    assert rank0 == rank1 and len(set(rank0)) > 1


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_losses_exactly(two_rank_run, shards, tmp_path):
    import shutil

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(two_rank_run / "checkpoints" / "step00000010", resumed / "checkpoints" / "step00000010")
    (resumed / "checkpoints" / "latest").write_text("step00000010\n")
    results = run_ranks(train_args(shards, resumed, 30, "--resume"), world=2, timeout=600)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    full = {r["step"]: r["loss"] for r in read_records(two_rank_run / "metrics.jsonl")}
    again = {r["step"]: r["loss"] for r in read_records(resumed / "metrics.jsonl")}
    assert sorted(again) == list(range(11, 31))
    assert all(again[s] == full[s] for s in again), [(s, full[s], again[s]) for s in again if again[s] != full[s]]


@pytest.mark.slow
def test_tensorboard_holds_the_training_scalars(two_rank_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(two_rank_run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/depth",
        "perf/tokens_per_s",
        "perf/mfu",
        "memory/peak_bytes",
        "gate/mean_step_1",
        "val/loss",
        "val/loss_depth_0",
        "val/loss_depth_3",
        "zero3/trace_invalidations",
    }
    assert expected <= tags, expected - tags
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 30
    start = 1 / (1 + math.exp(-PRESETS["micro-grt"].gate_bias_init))  # the gate's mean at initialisation
    assert all(abs(e.value - start) < 0.3 for e in events.Scalars("gate/mean_step_1"))


@pytest.mark.slow
def test_every_validation_states_the_loops_health(two_rank_run):
    """The loop's health at each validation (pretrain/infer/loop_health.py): one line in train.log, a
    record in metrics.jsonl, loop/ scalars in TensorBoard, and in summary.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = {r["step"]: r for r in read_records(two_rank_run / "metrics.jsonl")}
    for step in (10, 20, 30):
        loop = records[step]["loop"]
        val = records[step]["val"]
        # from the trained depths 1..R: depth 0 is never trained
        assert loop["gain_after_first"] == pytest.approx(val["val/loss_depth_1"] - val["val/loss_depth_3"])
        assert loop["drop_by_step"]["2"] == pytest.approx(val["val/loss_depth_1"] - val["val/loss_depth_2"])
        assert len(loop["gate_mean_by_step"]) == 3 and all(0 < g < 1 for g in loop["gate_mean_by_step"])
        assert 0 < loop["core_grad_share"] < 1
        assert loop["used"] == (loop["gain_after_first"] >= 0.02)
    log_text = (two_rank_run / "train.log").read_text()
    assert log_text.count("steps after the first add") >= 3, log_text[-2000:]  # and the warning's, once
    events = EventAccumulator(str(two_rank_run / "tb"))
    events.Reload()
    scalars = {"loop/gain_after_first", "loop/drop_step_2", "loop/drop_step_3", "loop/gate_mean_step_3"}
    assert scalars | {"loop/core_grad_share"} <= set(events.Tags()["scalars"])
    summary = json.loads((two_rank_run / "summary.json").read_text())
    assert summary["loop"] == records[30]["loop"]


@pytest.mark.slow
def test_compiled_loop_step_is_not_recompiled_per_depth(shards, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "compiled"
    r = grt(
        *train_args(shards, out, 8)[2:],
        "--set",
        "train.compile=true",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.log_every=2",
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    graphs = [e.value for e in events.Scalars("compile/unique_graphs")]
    depths = {e.value for e in events.Scalars("train/depth")}
    assert len(depths) > 1 and graphs[0] > 0
    assert len(set(graphs)) == 1, graphs  # new depths after the first logged step compiled nothing new
    # one graph for the prelude/coda blocks, one for the loop step: nothing breaks them (ZeRO-3's
    # module hooks on one rank, and the attention backend's log line, each did: 22 graphs)
    assert graphs[0] == 2, graphs


SYNC_SETS = ("train.log_every=4", "train.eval_every=0", "train.save_every=0")


@pytest.mark.slow
@pytest.mark.parametrize("grad_accum", [1, 4])
def test_one_host_sync_per_step_outside_logging_steps(shards, tmp_path, grad_accum):
    """A real `grt train` (ZeRO-3, 1 or 4 micro-batches per step) with every host sync counted
    by its caller: the trainer and model read the device once per optimizer step, except on
    logging and saving steps, however many micro-batches the step has. DeepSpeed's own syncs
    are counted apart (docs/performance.md): a few per step once its module trace is recorded
    (step 2), with the depth changing every step. The run's output has none of torch's
    FutureWarnings about DeepSpeed's collectives, and still shows real warnings."""
    report = tmp_path / "syncs.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "dist_scripts" / "count_syncs.py"),
            str(report),
            *train_command("micro-grt", shards, tmp_path / "run", 9, 2, None, SYNC_SETS, grad_accum=grad_accum)[1:],
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-3000:]
    steps = {s["step"]: s for s in json.loads(report.read_text())}
    assert sorted(steps) == list(range(1, 10))
    quiet = [s for s in steps.values() if s["step"] not in (1, 4, 8, 9)]  # 1: start-up; 4, 8: logging; 9: last, saved
    assert all(s["project"] <= 1 for s in quiet), steps
    assert all(s["project"] >= 1 for s in quiet), "the loss must still be read once per step"
    assert all(s["deepspeed"] <= 1 for s in quiet if s["step"] > 2), steps  # was 4, and 300-560 when the depth changed
    print("\nSYNCS per step (project, deepspeed):", [(s["step"], s["project"], s["deepspeed"]) for s in steps.values()])
    assert "is deprecated" not in output, [line for line in output.splitlines() if "is deprecated" in line]
    assert "UserWarning: GRT-TEST a real UserWarning" in output
    assert "FutureWarning: GRT-TEST a FutureWarning of another kind" in output
    log_line = next(line for line in output.splitlines() if "step 4/9 |" in line)
    assert f"| tokens {512 * grad_accum / 1000:.2f}k |" in log_line if grad_accum > 1 else "| tokens 512 |" in log_line
    assert "| ETA " in log_line, log_line


@pytest.mark.slow
def test_non_finite_micro_batches_are_dropped_with_gradient_accumulation(shards, tmp_path):
    """grad_accum 4 reads the non-finite checks once per step, after the backward of the
    earlier micro-batches: two NaN micro-batches at step 3 (their backward already ran) must
    add nothing and be replaced by the next two. Without the device-side gradient mask their
    NaN gradients reach the optimizer and the run stops on a non-finite gradient norm."""
    import os

    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.cli",
            *train_args(shards, out, 5)[2:],
            "--grad-accum",
            "4",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.save_every=5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GRT_INJECT_NAN_STEPS": "3,3"},
    )
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-3000:]
    assert output.count("non-finite loss at step 3 (depth") == 2, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_microbatches"] == 2 and summary["steps"] == 5
    records = read_records(out / "metrics.jsonl")
    assert [rec["step"] for rec in records] == [1, 2, 3, 4, 5]
    assert all(rec["loss"] == rec["loss"] and rec["loss"] < 10 for rec in records), records
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    norms = [e.value for e in events.Scalars("train/grad_norm")]
    assert len(norms) == 5 and all(0 < v < 100 for v in norms), norms
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step00000005")
    assert state and all(bool(v.isfinite().all()) for v in state.values())


@pytest.mark.parametrize("preset", ["micro-grt", "micro-dense", "micro-huginn", "micro-rrt", "micro-ouro", "micro-mor"])
def test_mfu_sums_the_executed_flops_of_each_step_at_its_own_depth(preset, monkeypatch):
    """MFU over a logging window = (sum over its steps of 3 x tokens x the variant's executed
    FLOPs per token at that step's depth) / time / peak, never the last step's depth for all."""
    from pretrain.model.flops import flops_per_token
    from pretrain.presets import get_preset
    from pretrain.training.report import metrics

    cfg, seq, tokens, peak = get_preset(preset), 64, 4096, 1e12
    asked = []
    monkeypatch.setattr(
        metrics,
        "flops_per_token",
        lambda c, s, n_loops, executed: (
            asked.append((c.variant, s, n_loops, executed)) or flops_per_token(c, s, n_loops=n_loops, executed=executed)
        ),
    )
    now = [100.0]
    meter = metrics.Throughput(cfg, seq, peak, clock=lambda: now[0])
    depths = [3, 1, 2, 3] if cfg.max_loops else [0, 0, 0, 0]
    for r in depths:
        meter.add(tokens, r)
    now[0] += 2.0
    perf = meter.read()
    executed = sum(3 * tokens * flops_per_token(cfg, seq, n_loops=r, executed=True) for r in depths)
    assert perf["perf/mfu"] == pytest.approx(executed / 2.0 / peak, rel=1e-12)
    assert perf["perf/tokens_per_s"] == pytest.approx(4 * tokens / 2.0)
    assert perf["perf/step_time_s"] == pytest.approx(0.5) and perf["perf/samples_per_s"] == pytest.approx(
        4 * tokens / seq / 2
    )
    assert {a[2] for a in asked} == set(depths) and all(a[:2] == (cfg.variant, seq) and a[3] for a in asked)
    if cfg.max_loops:  # the old formula (the window's tokens/s x the last step's FLOPs) differs
        last_only = 3 * 4 * tokens * flops_per_token(cfg, seq, n_loops=depths[-1], executed=True) / 2.0 / peak
        assert perf["perf/mfu"] != pytest.approx(last_only, rel=1e-3)
    now[0] += 1.0
    assert meter.read()["perf/tokens_per_s"] == 0  # each read starts a new window


def test_deepspeed_internals_missing_name_is_one_line_naming_the_version(monkeypatch):
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from grt_common.errors import ConfigError
    from pretrain.training.engine import deepspeed_internals

    deepspeed_internals.check()  # the installed DeepSpeed has every name
    monkeypatch.delattr(PartitionedParameterCoordinator, "_invalidate_trace")
    with pytest.raises(ConfigError) as err:
        deepspeed_internals.check()
    message = str(err.value)
    assert "\n" not in message and f"DeepSpeed {deepspeed.__version__} lacks " in message
    assert "PartitionedParameterCoordinator._invalidate_trace" in message and "pip install 'deepspeed>=" in message


def test_tested_deepspeed_range_is_pinned_in_setup_and_holds_the_installed_version():
    import deepspeed
    from packaging.specifiers import SpecifierSet

    from pretrain.training.engine.deepspeed_internals import TESTED

    assert f'"{TESTED}"' in (REPO / "setup.py").read_text()
    assert deepspeed.__version__ in SpecifierSet(TESTED.removeprefix("deepspeed"))


@pytest.mark.slow
def test_tensorboard_holds_throughput_tokens_norms_and_the_deepspeed_config(two_rank_run):
    """ZeRO-3 on 2 ranks: the per-block gradient norms, from each rank's partition with no
    gather, make up DeepSpeed's global gradient norm; tokens seen is a scalar and the x-axis
    of the by_tokens/ series; the merged DeepSpeed config is in the run's text."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(two_rank_run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    blocks = ("prelude", "core", "gate", "coda")
    expected = {
        "perf/step_time_s",
        "perf/samples_per_s",
        "train/tokens_seen",
        "train/param_norm",
        "by_tokens/train/loss",
        "by_tokens/val/loss",
        *(f"grad_norm/{b}" for b in blocks),
    }
    assert expected <= tags, expected - tags
    tokens_per_step = 4 * 2 * 2 * 64  # micro-batch x grad_accum x ranks x seq_len
    assert [(e.step, e.value) for e in events.Scalars("train/tokens_seen")] == [
        (s, s * tokens_per_step) for s in range(1, 31)
    ]
    assert [e.step for e in events.Scalars("by_tokens/train/loss")] == [s * tokens_per_step for s in range(1, 31)]
    total = {e.step: e.value for e in events.Scalars("train/grad_norm")}
    by_block = {b: {e.step: e.value for e in events.Scalars(f"grad_norm/{b}")} for b in blocks}
    for step, norm in total.items():
        assert math.sqrt(sum(by_block[b][step] ** 2 for b in blocks)) == pytest.approx(norm, rel=1e-4), step
    assert all(by_block[b][1] > 0 for b in blocks)
    assert all(e.value > 1.0 for e in events.Scalars("train/param_norm"))
    text = events.Tensors("deepspeed_config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"stage": 3' in text and '"train_batch_size": 16' in text


def test_deprecated_collective_warnings_are_hidden_and_others_shown():
    import warnings

    from pretrain.training.engine.deepspeed_internals import quiet_deprecated_collectives

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_deprecated_collectives()
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):  # torch's words, as DeepSpeed triggers them
            warnings.warn(
                f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed.x` instead.",
                FutureWarning,
                stacklevel=1,
            )
        warnings.warn("`torch.distributed.all_reduce_coalesced` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated.", UserWarning, stacklevel=1)
        warnings.warn("a real problem", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == [
        "`torch.distributed.all_reduce_coalesced` is deprecated.",
        "`torch.distributed.reduce_scatter_tensor` is deprecated.",
        "a real problem",
    ]


def test_loaders_built_from_one_manifest_hash_the_tokenizer_once(shards, monkeypatch):
    """The trainer loads the manifest once and builds its train and val loaders from it:
    the tokenizer file is hashed once, not once per loader."""
    import data_pipeline.tokenizer as tokenizer
    from data_pipeline.loader import TokenBatchLoader
    from data_pipeline.manifest import Manifest

    hashed = []
    original = tokenizer.file_sha256
    monkeypatch.setattr(tokenizer, "file_sha256", lambda path: hashed.append(path) or original(path))
    manifest = Manifest.load(str(shards))
    for split in ("train", "val", "train"):
        TokenBatchLoader(manifest, split=split, micro_batch_size=2, loop=split == "train")
    assert len(hashed) == 1
    TokenBatchLoader(str(shards), split="val", micro_batch_size=2, loop=False)  # a path: its own manifest, checked
    assert len(hashed) == 2


def test_zero3_on_one_rank_keeps_every_parameter_gathered_unless_the_file_says():
    """One rank: a ZeRO-3 partition is the whole parameter, so the shipped zero3.json leaves
    stage3_param_persistence_threshold to the trainer, which keeps every parameter resident;
    with more ranks DeepSpeed's default applies; a value in the file (or "auto") wins."""
    from pretrain.runs.train_config import TrainConfig
    from pretrain.training.engine.ds_config import ALL_PERSISTENT, build_ds_config, load_ds_json

    shipped, t = load_ds_json("ds_configs/zero3.json"), TrainConfig(micro_batch_size=2)
    assert "stage3_param_persistence_threshold" not in shipped["zero_optimization"]
    zero = build_ds_config(shipped, t, 1, True)["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == ALL_PERSISTENT
    assert "stage3_param_persistence_threshold" not in build_ds_config(shipped, t, 2, True)["zero_optimization"]
    for theirs, expected in ((1000, 1000), ("auto", None)):
        base = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": theirs}}
        zero = build_ds_config(base, t, 1, True)["zero_optimization"]
        assert zero.get("stage3_param_persistence_threshold") == expected
