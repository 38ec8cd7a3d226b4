"""Every value checked once, at the door; a result with nothing behind it is an error, not a
number (issue 27; docs/reliability.md, "Values checked at the door").

Each refused value must end with exit 2 and exactly one line on stderr naming the key or flag
(and what is accepted), no traceback, no process group and no file written. The sweeps are
property-style: every field or flag with every bad value, plus the edge values that must stay
accepted. Everything runs in-process through the `grt` dispatcher (`pretrain.cli.main`), on a
tiny randomly initialised export (no training run), so the file takes seconds.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from commands import error_lines, grt_output, train_command
from commands import grt_in_process as grt
from trained_models import DEMO_TEXT, CharTokenizer, manifest, single_thread, small_model, write_export  # noqa: F401 (fixtures)

TRIED: Counter = Counter()  # inputs tried per class, printed at the end (-s) for docs/reliability.md
HANDLED: Counter = Counter()


def refused(kind: str, rc: int, stderr: str, *wants: str) -> str:
    """Exit 2, one line on stderr containing every one of `wants`; counted under `kind`."""
    TRIED[kind] += 1
    lines = error_lines(stderr)
    assert "Traceback" not in stderr, stderr
    assert rc == 2, f"rc {rc}: {stderr}"
    assert len(lines) == 1, stderr
    for want in wants:
        assert want in lines[0], lines[0]
    HANDLED[kind] += 1
    return lines[0]


def no_group() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group was started"


# ------------------------------------------------------------------------------- inputs, built once
@pytest.fixture(scope="module")
def models(manifest, tmp_path_factory) -> dict[str, Path]:
    """Exports of a tiny GRT of the data's vocabulary and context (random weights: the refusals
    come before any number matters), with and without its tokenizer.model."""
    root = tmp_path_factory.mktemp("values")
    tok = manifest.parents[1] / "tok.model"
    model = small_model(vocab=512)
    run_config = {"data": str(manifest)}
    with_tok = write_export(model, root / "model", tokenizer=tok, run_config=run_config)
    without = write_export(model, root / "no_tok", run_config=run_config)
    return {"model": with_tok, "no_tok": without, "tokenizer": tok}


# ------------------------------------------------------------------- 1. the run config (RunConfig.validate)
# train.<key>: values that mean nothing. Each must be refused naming the key.
TRAIN_BAD = {
    "grad_clip": ["-1", "-0.01", "nan", "inf"],
    "lr": ["0", "-3e-4", "nan", "inf"],
    "min_lr": ["-1e-5", "1.0", "nan"],
    "weight_decay": ["-0.1", "nan", "inf"],
    "betas": ["1.0,0.95", "0.9,-0.1", "0.9,1.5", "0.9", "0.9,0.95,0.99", "x", "nan,0.9"],
    "seed": ["-1"],
    "poisson_mean": ["0", "-2", "nan"],
    "poisson_sigma": ["-0.1", "inf"],
    "num_workers": ["-2"],  # -1 is auto
    "shuffle_buffer": ["-1"],
    "log_every": ["0", "-1"],
    "eval_every": ["-1"],
    "eval_batches": ["0", "-3"],
    "save_every": ["-1"],
    "keep_checkpoints": ["0"],
    "max_bad_steps": ["0", "-1"],
    "dist_timeout_s": ["0", "-5", "nan"],
    "peak_tflops": ["-1", "nan"],
    "steps": ["0"],
    "micro_batch_size": ["0"],
    "grad_accum": ["0"],
    "warmup_steps": ["-1"],
    "schedule_steps": ["-1"],
    "max_train_depth": ["-1"],
}
TRAIN_CASES = [(key, value) for key, values in TRAIN_BAD.items() for value in values]
# the edges that mean something and must stay accepted
TRAIN_GOOD = [
    "train.grad_clip=0",
    "train.weight_decay=0",
    "train.betas=0,0.999",
    "train.seed=0",
    "train.min_lr=0",
    "train.poisson_sigma=0",
    "train.num_workers=0",
    "train.num_workers=-1",
    "train.shuffle_buffer=0",
    "train.eval_every=0",
    "train.save_every=0",
    "train.peak_tflops=0",
    "train.max_bad_steps=1",
    "train.eval_batches=1",
    "train.dist_timeout_s=0.5",
]


def train_argv(manifest: Path, out: Path, *sets: str, extra: tuple[str, ...] = ()) -> list[str]:
    return train_command("micro-grt", manifest, out, None, None, None, sets, *extra, "--dry-run")


@pytest.mark.parametrize("key,value", TRAIN_CASES, ids=[f"{k}={v}" for k, v in TRAIN_CASES])
def test_meaningless_train_value_is_one_line_naming_the_key(manifest, tmp_path, capsys, key, value):
    out = tmp_path / "run"
    rc, err = grt(train_argv(manifest, out, f"train.{key}={value}"), capsys)
    line = refused("train config value", rc, err, "grt train: error: ", f"train.{key}=")
    assert any(word in line for word in ("must", "need", "two numbers", "expected")), line
    assert not out.exists(), "the run wrote into --out"
    no_group()


def given(item: str) -> tuple[str, object]:
    """`train.KEY=VALUE` -> (KEY, the number or numbers it gives)."""
    key, _, value = item.partition("=")
    return key.removeprefix("train."), tuple(map(float, value.split(","))) if "," in value else float(value)


def test_meaningful_train_edges_are_accepted():
    """Each edge is accepted and kept as given (a value silently replaced would pass `validate`)."""
    from pretrain.train import build_parser, config_from_args

    args = ["--preset", "micro-grt", "--data", "manifest.json"]
    for item in TRAIN_GOOD:
        cfg = config_from_args(build_parser().parse_args([*args, "--set", item]))
        key, value = given(item)
        assert getattr(cfg.train, key) == value, (item, getattr(cfg.train, key))
    every = [x for item in TRAIN_GOOD for x in ("--set", item)]
    cfg = config_from_args(build_parser().parse_args([*args, *every]))
    assert {key: getattr(cfg.train, key) for key, _ in map(given, TRAIN_GOOD)} == dict(map(given, TRAIN_GOOD))


MODEL_CASES = [
    ("dropout", 1.0),
    ("layer_norm_eps", 0.0),
    ("init_std", -0.02),
    ("gate_tau", float("nan")),
    ("gate_bias_init", float("inf")),
    ("state_noise_std", float("nan")),
]


@pytest.mark.parametrize("key,value", MODEL_CASES, ids=[f"{k}={v}" for k, v in MODEL_CASES])
def test_meaningless_model_value_is_one_line_naming_the_key(key, value):
    from grt_common.errors import ConfigError
    from pretrain.presets import get_preset

    with pytest.raises(ConfigError, match=f"^{key}="):
        get_preset("micro-grt").replace(**{key: value})


@pytest.mark.parametrize("item", ["out=", "ds_config=", "model.extra={not json"])
def test_empty_top_level_values_and_unparsable_overrides_are_one_line(manifest, tmp_path, capsys, item):
    rc, err = grt(train_argv(manifest, tmp_path / "run", item), capsys)
    refused("train config value", rc, err, "grt train: error: ", item.split("=")[0].rpartition(".")[2])
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------- 1. the DeepSpeed JSON (ds_config.py, at the merge)
DS_BAD = [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage=-1"),
    ({"zero_optimization": {"stage": "three"}}, 'zero_optimization.stage="three"'),
    ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage=2.5"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=true"),
    ({"zero_optimization": [3]}, "zero_optimization=[3]"),
    ({"zero_optimization": None}, "zero_optimization=null"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size=0"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}}, "stage3_max_live_parameters=-1"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "big"}}, "stage3_prefetch_bucket_size"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -5}}, "persistence_threshold=-5"),
    ({"zero_optimization": {"stage": 1, "allgather_bucket_size": -1}}, "allgather_bucket_size=-1"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "optimizer.params.eps=0"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}, "optimizer.params.eps=-1e-08"),
    ({"optimizer": ["AdamW"]}, "optimizer="),
    ({"optimizer": {"params": [1]}}, "optimizer.params="),
    ({"scheduler": {"params": 3}}, "scheduler.params=3"),
    ({"bf16": [True]}, "bf16="),
    ({"steps_per_print": 0}, "steps_per_print=0"),
]
ABSENT = object()
# each accepted file with what the merged config must then hold ("auto": the key left to DeepSpeed's default)
DS_GOOD = [
    ({"zero_optimization": {"stage": "auto"}}, {"zero_optimization.stage": ABSENT}),
    ({"zero_optimization": {"stage": 0}}, {"zero_optimization.stage": 0}),
    (
        {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 0}},
        {
            "zero_optimization.stage": 3,
            "zero_optimization.reduce_bucket_size": ABSENT,
            "zero_optimization.stage3_prefetch_bucket_size": 0,
        },
    ),
    (
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}},
        {"zero_optimization.stage": 2, "zero_optimization.reduce_bucket_size": 5e8},
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}, "steps_per_print": 1, "bf16": None},
        {"optimizer.params.eps": 1e-6, "steps_per_print": 1, "bf16.enabled": False},
    ),
]


@pytest.mark.parametrize("ds,want", DS_BAD, ids=[w for _, w in DS_BAD])
def test_impossible_deepspeed_value_is_one_line_at_the_merge(manifest, tmp_path, capsys, ds, want):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    out = tmp_path / "run"
    rc, err = grt(train_argv(manifest, out, extra=("--ds-config", str(path))), capsys)
    refused("DeepSpeed config value", rc, err, "grt train: error: DeepSpeed config ", want)
    assert not out.exists()
    no_group()


def test_impossible_deepspeed_value_is_refused_by_the_launcher_once(manifest, tmp_path, capsys):
    """`grt launch` merges the DeepSpeed file once for every rank: one line, no rank, no file."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    out = tmp_path / "run"
    rc, err = grt(
        ["launch", "--dry-run", "--procs-per-node", "2", "--"]
        + train_argv(manifest, out, extra=("--ds-config", str(path)))[1:-1],
        capsys,
    )
    refused("DeepSpeed config value", rc, err, "grt launch: run config: DeepSpeed config zero_optimization.stage=5")
    assert not out.exists()


@pytest.mark.parametrize("ds,holds", DS_GOOD, ids=[json.dumps(d) for d, _ in DS_GOOD])
def test_possible_deepspeed_values_are_accepted(ds, holds):
    """Accepted and used as written: the merged config DeepSpeed receives holds each value."""
    from pretrain.runs.train_config import TrainConfig
    from pretrain.training.engine.ds_config import build_ds_config

    merged = build_ds_config(ds, TrainConfig(), world_size=1, use_cuda=False)
    for path, want in holds.items():
        node = merged
        for key in path.split("."):
            node = node.get(key, ABSENT) if isinstance(node, dict) else ABSENT
        assert node is want if want is ABSENT else node == want, (path, node, merged)


# ------------------------------------------------------------------------ 1. grt launch's numeric flags
LAUNCH_BAD = [
    (["--nodes", "-1"], "--nodes -1"),
    (["--nodes", "0"], "--nodes 0"),
    (["--gpus-per-node", "-1"], "--gpus-per-node -1"),
    (["--procs-per-node", "0"], "--procs-per-node 0"),
    (["--procs-per-node", "-2"], "--procs-per-node -2"),
    (["--master-port", "0"], "--master-port 0"),
    (["--master-port", "65536"], "--master-port 65536"),
    (["--node-rank", "-1"], "--node-rank -1"),
    (["--launcher", "deepspeed", "--hosts", "a,b", "--no-ssh", "--node-rank", "2"], "--node-rank 2"),
    (["--launcher", "deepspeed", "--ssh-port", "0"], "--ssh-port 0"),
    (["--launcher", "slurm", "--cpu", "--cpus-per-task", "0"], "--cpus-per-task 0"),
    (["--launcher", "slurm", "--cpu", "--time", "-5"], "--time '-5'"),
    (["--launcher", "slurm", "--cpu", "--time", "soon"], "--time 'soon'"),
    (["--launcher", "slurm", "--cpu", "--mem=-1G"], "--mem '-1G'"),
    (["--launcher", "slurm", "--cpu", "--signal", "USR1@-5"], "--signal 'USR1@-5'"),
    (["--launcher", "slurm", "--cpu", "--signal", "NOPE@60"], "--signal 'NOPE@60'"),
]
# each accepted set of flags with what the dry run's plan then holds (the local launcher has no port:
# --standalone picks one, so the port is checked where it is passed on)
LAUNCH_GOOD = [
    (
        ["--nodes", "1", "--procs-per-node", "2", "--gpus-per-node", "0"],
        ["1 node(s) x 2 rank(s)", "--nproc_per_node=2"],
    ),
    (["--launcher", "deepspeed", "--master-port", "29501"], ["--master_port=29501"]),
    (
        ["--launcher", "deepspeed", "--hosts", "a,b", "--no-ssh", "--node-rank", "1"],
        ["a slots=1\nb slots=1\n", "--num_nodes=2", "--no_ssh --node_rank=1"],
    ),
    (
        [
            "--launcher",
            "slurm",
            "--cpu",
            "--nodes",
            "2",
            "--time",
            "1-00:30:00",
            "--mem",
            "0",
            "--signal",
            "B:USR1@300",
        ],
        ["#SBATCH --nodes=2\n", "#SBATCH --mem=0\n", "#SBATCH --time=1-00:30:00\n", "#SBATCH --signal=B:USR1@300\n"],
    ),
    (
        ["--launcher", "slurm", "--cpu", "--time", "90", "--mem", "64G", "--signal", "TERM", "--cpus-per-task", "4"],
        ["#SBATCH --cpus-per-task=4\n", "#SBATCH --mem=64G\n", "#SBATCH --time=90\n", "#SBATCH --signal=B:TERM\n"],
    ),
]


def launch_argv(flags: list[str], run_dir: Path) -> list[str]:
    return ["launch", *flags, "--dry-run", "--run-dir", str(run_dir), "--entry", "launcher.probe"]


@pytest.mark.parametrize("flags,want", LAUNCH_BAD, ids=[w for _, w in LAUNCH_BAD])
def test_out_of_range_launch_flag_is_one_line_before_anything(tmp_path, capsys, flags, want):
    rc, err = grt(launch_argv(flags, tmp_path / "launch"), capsys)
    refused("launch flag", rc, err, f"grt launch: {want}")
    assert not (tmp_path / "launch").exists()


def test_master_port_from_the_environment_is_checked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "port")
    rc, err = grt(launch_argv([], tmp_path / "launch"), capsys)
    refused("launch flag", rc, err, "MASTER_PORT='port'", "1..65535")


@pytest.mark.parametrize("flags,plan", LAUNCH_GOOD, ids=[" ".join(f) for f, _ in LAUNCH_GOOD])
def test_launch_flags_in_range_are_accepted(tmp_path, capsys, monkeypatch, flags, plan):
    """Accepted and used: the plan the dry run prints holds each value."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    rc, out, err = grt_output(launch_argv(flags, tmp_path / "launch"), capsys)
    assert rc == 0, err
    for want in plan:
        assert want in out, (want, out)


# ----------------------------------------------------------------------------- 1. grt generate's flags
GENERATE_BAD = [
    (["--max-new-tokens", "-1"], "--max-new-tokens -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--num-samples", "0"], "--num-samples 0"),
    (["--temperature", "-0.5"], "--temperature -0.5"),
    (["--temperature", "nan"], "--temperature nan"),
    (["--top-k", "-1"], "--top-k -1"),
    (["--top-p", "0"], "--top-p 0.0"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--top-p", "-0.1"], "--top-p -0.1"),
    (["--depth", "-1"], "--depth -1"),
    (["--exit-threshold", "-0.1"], "--exit-threshold -0.1"),
    (["--seed", "-1"], "--seed -1"),
]


@pytest.mark.parametrize("flags,want", GENERATE_BAD, ids=[w for _, w in GENERATE_BAD])
def test_meaningless_generate_flag_is_one_line(models, capsys, flags, want):
    rc, err = grt(["generate", models["model"], "--max-new-tokens", "2", *flags], capsys)
    refused("generate flag", rc, err, f"grt generate: error: {want}: must")


def test_prompt_filling_the_context_is_one_line_not_an_empty_sample(models, capsys):
    prompt = DEMO_TEXT.read_text()[:2000]  # far more than the model's 64 tokens
    rc, err = grt(["generate", models["model"], "--prompt", prompt, "--max-new-tokens", "4"], capsys)
    refused("generate flag", rc, err, "fills the model's context of 64")


def test_generate_edges_are_accepted(models, capsys):
    """Accepted and meaning what their help says: temperature 0 is greedy decoding (whatever the
    seed), top-k 0 and top-p 1 filter nothing (the same draws as without them), depth 0 is used."""

    def tokens(*flags: str) -> list[list[int]]:
        rc, out, err = grt_output(["generate", models["model"], "--max-new-tokens", "4", *flags, "--json"], capsys)
        assert rc == 0, err
        result = json.loads(out)
        assert result["depth"] == 0, result
        return result["tokens"]

    edges = ("--top-k", "0", "--top-p", "1", "--depth", "0")
    assert tokens(*edges, "--temperature", "0", "--seed", "1") == tokens("--greedy", "--depth", "0", "--seed", "2")
    assert tokens(*edges, "--seed", "3") == tokens("--depth", "0", "--seed", "3")


def test_generate_library_names_max_new_tokens():
    from grt_common.errors import ConfigError
    from pretrain.infer.generate import generate

    model = small_model()
    with pytest.raises(ConfigError, match="max_new_tokens=-1: must be >= 0"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), -1)
    with pytest.raises(ConfigError, match="prompt of 65 tokens exceeds the context of 64"):
        generate(model, torch.zeros(1, 65, dtype=torch.long), 1)
    assert generate(model, torch.zeros(1, 64, dtype=torch.long), 5).shape == (1, 0)  # as before: no room


# --------------------------------------------------------------------------------- 1. grt eval's flags
EVAL_BAD = [
    (["--batch-size", "0"], "--batch-size 0"),
    (["--batch-size", "-1"], "--batch-size -1"),
    (["--max-batches", "0"], "--max-batches 0"),
    (["--max-batches", "-2"], "--max-batches -2"),
    (["--limit", "0"], "--limit 0"),
    (["--stride", "0"], "--stride 0"),
    (["--wikitext-max-tokens", "0"], "--wikitext-max-tokens 0"),
    (["--adaptive-exit", "update", "--exit-thresholds", "x"], "--exit-thresholds 'x'"),
    (["--adaptive-exit", "update", "--exit-thresholds", "-0.1"], "--exit-thresholds '-0.1'"),
    (["--depths", "two"], "--depths 'two'"),
    (["--dtype", "fp7"], "dtype='fp7'"),
]


@pytest.mark.parametrize("flags,want", EVAL_BAD, ids=[w for _, w in EVAL_BAD])
def test_meaningless_eval_flag_is_one_line_before_the_model_loads(
    models, manifest, tmp_path, capsys, monkeypatch, flags, want
):
    from pretrain.infer import load

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(load, "load_model", not_loaded)
    out = tmp_path / "results.json"
    argv = ["eval", models["model"], "--tasks", "val", "--data", manifest, "--json-out", out, *flags]
    rc, err = grt(argv, capsys)
    refused("eval flag", rc, err, f"grt eval: error: {want}")
    assert not out.exists()


# ------------------------------------------------------------- 2. a result with nothing behind it is an error
def val_sequences(manifest: Path) -> int:
    return sum(e["sequences"] for e in json.loads(manifest.read_text())["splits"]["val"])


def test_eval_with_no_batch_to_score_is_one_line_naming_data_and_split(models, manifest, tmp_path, capsys):
    """Before: `val loss 0.0000, val ppl 1.0000` (and the loader's two-line warning), exit 0."""
    out = tmp_path / "results.json"
    batch = val_sequences(manifest) + 1
    argv = ["eval", models["model"], "--tasks", "val", "--data", manifest, "--batch-size", batch, "--json-out", out]
    rc, err = grt(argv, capsys)
    refused("nothing scored", rc, err, f"data={str(manifest)!r} split 'val'", "nothing to score", "--batch-size")
    assert not out.exists()


def test_training_on_a_split_without_one_batch_per_rank_is_one_line(manifest, tmp_path, capsys):
    """Before: the trainer's validation over no batch logged a loss of 0.0 (and the dry run passed)."""
    out = tmp_path / "run"
    too_big = ("--micro-batch-size", str(val_sequences(manifest) + 1))
    rc, err = grt(train_argv(manifest, out, "train.eval_every=10", extra=too_big), capsys)
    refused("nothing scored", rc, err, f"data={str(manifest)!r}: the val split has", "train.eval_every=0")
    rc, err = grt(train_argv(manifest, out, extra=("--micro-batch-size", "1000000")), capsys)
    refused("nothing scored", rc, err, "the train split has", "training would have no batch")
    rc, err = grt(train_argv(manifest, out, "train.eval_every=0", extra=too_big), capsys)
    assert rc == 0, err  # without validation the same batch size trains
    assert not out.exists()


def test_analyze_with_no_batch_to_score_is_one_line(models, manifest, tmp_path, capsys):
    out = tmp_path / "analysis"
    argv = ["analyze", models["model"], "--data", manifest, "--out", out, "--batch-size", val_sequences(manifest) + 1]
    rc, err = grt(argv, capsys)
    refused("nothing scored", rc, err, "split 'val'", "nothing to score")
    assert not out.exists()


def test_eval_of_an_empty_text_or_task_file_is_one_line(models, tmp_path, capsys):
    """Before: an empty WikiText-2 file was a ZeroDivisionError traceback; an empty task file an
    accuracy of 0.0 over no item."""
    from pretrain.runs.eval_tasks import TASKS

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "wikitext2_raw_test.txt").write_text("")
    (tmp_path / "eval" / TASKS["piqa"].file).write_text("\n")
    base = ["eval", models["model"], "--eval-dir", tmp_path / "eval", "--json-out", tmp_path / "r.json"]
    rc, err = grt([*base, "--tasks", "wikitext2"], capsys)
    refused("nothing scored", rc, err, "WikiText-2", "wikitext2_raw_test.txt", "no token was scored")
    rc, err = grt([*base, "--tasks", "piqa"], capsys)
    refused("nothing scored", rc, err, "piqa", "holds no items")
    assert not (tmp_path / "r.json").exists()


def test_sums_over_nothing_raise_instead_of_a_number():
    """The library under the commands: no token, no item summed over the ranks is a ConfigError
    naming what was scored (before: loss 0, perplexity 1, accuracy 0)."""
    from grt_common.errors import ConfigError
    from pretrain.distributed import Dist
    from pretrain.infer.evaluation.loss_by_depth import loss_table
    from pretrain.infer.evaluation.zero_shot import evaluate_task

    TRIED["nothing scored"] += 2
    with pytest.raises(ConfigError, match="data='m.json' split 'val': no token was scored"):
        loss_table(torch.zeros(2, 2, dtype=torch.float64), [0, 3], "data='m.json' split 'val'")
    model = small_model()
    with pytest.raises(ConfigError, match="no item was scored"):
        evaluate_task(model, CharTokenizer(), [], [0, 3], torch.device("cpu"), dist=Dist())
    HANDLED["nothing scored"] += 2


# ----------------------------------------------------------- 2. a model without its tokenizer.model
def test_eval_and_analyze_of_a_model_without_its_tokenizer_are_refused(models, manifest, tmp_path, capsys):
    """Before: the tokenizer check was skipped without a word and a loss was printed (data of
    another tokenizer of the same vocabulary would have given a plausible, meaningless one)."""
    rc, err = grt(["eval", models["no_tok"], "--tasks", "val", "--data", manifest, "--max-batches", "1"], capsys)
    refused("tokenizer unknown", rc, err, "has no tokenizer.model", "pass --tokenizer")
    out = tmp_path / "analysis"
    rc, err = grt(["analyze", models["no_tok"], "--data", manifest, "--out", out, "--max-batches", "1"], capsys)
    refused("tokenizer unknown", rc, err, "has no tokenizer.model", "pass --tokenizer")
    assert not out.exists()


def test_a_tokenizer_given_for_a_model_without_one_is_said_once(models, manifest, capsys):
    argv = ["eval", models["no_tok"], "--tasks", "val", "--data", manifest, "--max-batches", "1", "--batch-size", "2"]
    rc, err = grt([*argv, "--tokenizer", models["tokenizer"]], capsys)
    assert rc == 0, err
    warnings = [line for line in error_lines(err) if "warning" in line]
    assert len(warnings) == 1 and "taken on trust" in warnings[0], err


def test_a_model_with_its_tokenizer_needs_no_flag(models, manifest, tmp_path, capsys):
    """The usual case is unchanged: no warning, a loss; a copy of the same tokenizer is accepted."""
    copy = tmp_path / "copy.model"
    shutil.copyfile(models["tokenizer"], copy)
    argv = ["eval", models["model"], "--tasks", "val", "--data", manifest, "--max-batches", "1", "--batch-size", "2"]
    rc, err = grt([*argv, "--tokenizer", copy], capsys)
    assert rc == 0 and not [line for line in error_lines(err) if "warning" in line], err


def test_zz_report_counts():
    """The figures for docs/reliability.md (run with -s)."""
    print(
        "\nBAD VALUES "
        + "; ".join(f"{k}: {HANDLED[k]}/{TRIED[k]}" for k in sorted(TRIED))
        + f"; total {sum(HANDLED.values())}/{sum(TRIED.values())}"
    )
    assert HANDLED == TRIED
