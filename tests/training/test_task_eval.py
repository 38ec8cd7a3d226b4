"""Zero-shot tasks during training (train.eval_tasks_every, pretrain/training/evaluation/tasks.py): the
numbers a run logs equal `grt eval` on its checkpoint; every rank runs the same forwards; bad
settings and missing task files are refused in one line before training."""

import json
import subprocess
import sys

import pytest
import torch
from commands import error_lines, train_command
from multiproc import run_ranks
from trained_models import (  # noqa: F401 (fixtures: manifest, single_thread)
    ENV,
    REPO,
    CharTokenizer,
    manifest,
    single_thread,
    small_model,
)

from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.evaluation import zero_shot
from pretrain.infer.evaluation.evaluate import main as eval_main
from pretrain.infer.evaluation.zero_shot import evaluate_task
from pretrain.presets import get_preset
from pretrain.runs.eval_tasks import Item, default_depths, task_depths
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore")
CPU = torch.device("cpu")
WORDS = ["apple", "stone", "river", "crown", "sword", "night", "honour"]


def write_tasks(root, tasks=("piqa", "lambada")):
    """7 items per task (a limit of 5 splits them 3 + 2 over two ranks: unequal request counts)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = {
        "piqa": [
            {
                "query": f"Question: How to find the {w}?\n",
                "choices": ["Ask the king.", "Walk by the river."],
                "gold": i % 2,
            }
            for i, w in enumerate(WORDS)
        ],
        "lambada": [{"context": f"The {w} was given to the", "continuation": "king"} for w in WORDS],
    }
    files = {"piqa": "piqa.jsonl", "lambada": "lambada_openai.jsonl"}
    for task in tasks:
        (root / files[task]).write_text("".join(json.dumps(r) + "\n" for r in rows[task]))
    return root


def test_default_depths_and_bad_settings_are_one_line():
    assert default_depths(get_preset("micro-grt")) == [1, 3]  # R = 3: 1, R/2 rounded down (1), R
    assert default_depths(get_preset("tiny-grt")) == [1, 2, 4]
    assert default_depths(get_preset("micro-dense")) == [5]  # a dense model: the whole model, as grt eval
    assert task_depths("0,2-3", get_preset("micro-grt")) == [0, 2, 3]
    bad = {
        "train.eval_tasks='piqa,nope': unknown nope": ("eval_tasks", "piqa,nope", "micro-grt"),
        "train.eval_tasks_depths='1,x'": ("eval_tasks_depths", "1,x", "micro-grt"),
        "1..5": ("eval_tasks_depths", "1,6", "micro-dense"),
    }
    for expected, (key, value, preset) in bad.items():
        cfg = RunConfig(model=get_preset(preset), train=TrainConfig(**{key: value}), data="m.json")
        with pytest.raises(ConfigError) as err:
            cfg.validate()
        assert expected in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    assert "accepted: all, or comma-separated names of lambada, hellaswag, piqa" in str(
        pytest.raises(ConfigError, RunConfig(train=TrainConfig(eval_tasks="x"), data="m").validate).value
    )


def test_every_rank_runs_the_same_forwards_and_the_sums_are_one_process(monkeypatch):
    """Two ranks' shares of 5 items (3 + 2, of 2 requests each) with 4 requests per forward: the
    rank with fewer requests is padded to as many forwards; the two ranks' sums are one
    process's (the dummies add nothing)."""
    model, tok = small_model(), CharTokenizer()
    items = [Item([(f"Q{i}: where?", " here"), (f"Q{i}: where?", " over there")], gold=i % 2) for i in range(5)]
    items += [Item([(f"It was {i}", " dark")], kind="lambada") for i in range(3)]
    sums: list[torch.Tensor] = []
    monkeypatch.setattr(zero_shot, "sum_over_ranks", lambda s, dist: sums.append(s) or s)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    counts, depths = [], [0, 3]
    for task in (items[:5], items[5:]):
        evaluate_task(model, tok, task, depths, CPU, batch_size=4)
        for rank in (0, 1):
            forwards[0] = 0
            evaluate_task(model, tok, task, depths, CPU, batch_size=4, dist=Dist(rank, 2))
            counts.append(forwards[0])
        one, rank0, rank1 = sums[-3:]
        torch.testing.assert_close(rank0 + rank1, one, rtol=1e-12, atol=1e-9)
    assert counts == [2, 2, 1, 1]  # unpadded: 6 and 4 requests, 2 and 1 forwards


def train_args(data, out, eval_dir, ds_config, *extra):
    sets = (
        "train.eval_every=0",
        "train.log_every=2",
        "train.warmup_steps=1",
        "train.eval_tasks_every=2",
        "train.eval_tasks=piqa,lambada",
        "train.eval_tasks_limit=5",
        f"train.eval_dir={eval_dir}",
    )
    return ["-m", "pretrain.cli", *train_command("micro-grt", data, out, 4, 4, str(ds_config), sets, *extra)]


@pytest.mark.slow
def test_two_ranks_zero3_log_what_grt_eval_gives_on_the_checkpoint(manifest, tmp_path, capsys):
    """ZeRO-3 on two ranks with every parameter outside the pinned core gathered in each forward
    (persistence threshold 0): the ranks' unequal shares are padded to the same forwards (without
    it the run hangs), and the numbers at the final step are `grt eval`'s on the final checkpoint
    (one process, fp32): accuracies exactly, LAMBADA's perplexity to 1e-6."""
    eval_dir = write_tasks(tmp_path / "eval")
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "zero3.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    results = run_ranks(train_args(manifest, out, eval_dir, tmp_path / "zero3.json"), world=2, timeout=300, env=ENV)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    records = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4] and records[-1]["depths"] == [1, 3]
    assert records[-1]["items"] == {"piqa": 5, "lambada": 5}
    log = (out / "train.log").read_text()
    lines = [line for line in log.splitlines() if "zero-shot tasks at step" in line]
    assert len(lines) == 2 and "10 items in" in lines[-1] and "% of the time since the first step" in lines[-1]

    assert (
        eval_main(
            [
                str(out / "checkpoints"),
                "--tasks",
                "piqa,lambada",
                "--depths",
                "1,3",
                "--limit",
                "5",
                "--eval-dir",
                str(eval_dir),
                "--batch-size",
                "4",
                "--dtype",
                "fp32",
                "--json-out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    expected = json.loads((tmp_path / "eval.json").read_text())["tasks"]
    got = records[-1]["tasks"]
    assert set(got) == set(expected) == {"piqa", "lambada"}
    for task, by_depth in expected.items():
        assert set(got[task]) == set(by_depth) == {"1", "3"}
        for depth, metrics in by_depth.items():
            assert set(got[task][depth]) == set(metrics)
            for metric, value in metrics.items():
                if metric == "ppl":
                    assert got[task][depth][metric] == pytest.approx(value, rel=1e-6), (task, depth)
                else:
                    assert got[task][depth][metric] == value, (task, depth, metric)
    # the step-2 evaluation scored other weights: the final one is the checkpoint's, not a stale one
    assert records[0]["tasks"]["lambada"]["1"]["ppl"] != pytest.approx(got["lambada"]["1"]["ppl"], rel=1e-6)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "tasks/piqa/acc_depth_1",
        "tasks/piqa/acc_norm_depth_3",
        "tasks/lambada/ppl_depth_3",
        "tasks/eval_s",
    } <= tags
    assert "tasks/lambada/acc_norm_depth_1" not in tags
    final = {e.step: e.value for e in events.Scalars("tasks/lambada/ppl_depth_3")}
    assert sorted(final) == [2, 4] and final[4] == pytest.approx(got["lambada"]["3"]["ppl"], rel=1e-6)


def _train(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def test_unknown_task_and_missing_task_file_are_refused_before_training(manifest, tmp_path):
    """One line each (exit 2), and nothing written into --out: an unknown task name (with the run
    config's values), a task file that is not there (read before the process group starts)."""
    eval_dir = write_tasks(tmp_path / "eval", tasks=("piqa",))
    zero3 = REPO / "ds_configs" / "zero3.json"
    unknown = _train(*train_args(manifest, tmp_path / "a", eval_dir, zero3, "--set", "train.eval_tasks=piqa,nope"))
    missing = _train(*train_args(manifest, tmp_path / "b", eval_dir, zero3))  # no lambada_openai.jsonl
    expected = ("train.eval_tasks='piqa,nope': unknown nope", f"{eval_dir / 'lambada_openai.jsonl'} not found")
    for proc, what in zip((unknown, missing), expected):
        lines = error_lines(proc.stderr)  # the start's progress line aside (tests/commands.py)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("grt train: error: ") and what in lines[0], lines
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_report_writes_the_scalars_the_records_and_one_line(tmp_path):
    """TensorBoard's tags, one record per evaluation step in tasks.jsonl (an evaluation step
    written again after a resume or rollback drops the records from it on), one log line."""
    from pretrain.training.evaluation.tasks import TaskEval, TaskScores

    class Writer:
        def __init__(self):
            self.got, self.tokens = {}, {}

        def scalars(self, step, values, tokens=None):
            self.got[step] = dict(values)
            self.tokens[step] = tokens

    tasks = TaskEval(2, {"winogrande": [], "lambada": []}, {}, [1, 3], CharTokenizer(), 4, 0)
    results = {
        "winogrande": {1: {"acc": 0.5, "acc_norm": 0.5, "n": 4}, 3: {"acc": 0.75, "acc_norm": 0.75, "n": 4}},
        "lambada": {1: {"acc": 0.0, "ppl": 300.0, "n": 4}, 3: {"acc": 0.25, "ppl": 250.0, "n": 4}},
    }
    writer = Writer()
    for step in (2, 4, 2):
        line = tasks.report(TaskScores(step, results, 1.5, 8, 3.0, 30.0), step * 512, writer, tmp_path, rank=0)
    assert set(writer.got[2]) == {
        "tasks/winogrande/acc_depth_1",
        "tasks/winogrande/acc_depth_3",
        "tasks/lambada/acc_depth_1",
        "tasks/lambada/acc_depth_3",
        "tasks/lambada/ppl_depth_1",
        "tasks/lambada/ppl_depth_3",
        "tasks/eval_s",
    }
    assert writer.got[4]["tasks/lambada/ppl_depth_3"] == 250.0
    assert writer.tokens == {2: 1024, 4: 2048}  # each score also against the tokens trained (by_tokens/)
    records = [json.loads(r) for r in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2] and records[0]["tasks"]["winogrande"]["3"]["acc_norm"] == 0.75
    assert line == (
        "zero-shot tasks at step 2 (depths 1/3): winogrande acc 0.5/0.75 | lambada acc 0/0.25 ppl 300/250 | "
        "8 items in 1.5 s, 10.0% of the time since the first step (3.0 of 30.0 s)"
    )
