"""Zero-shot tasks scored during training (`train.eval_tasks_every`; docs/training.md).

Every `train.eval_tasks_every` steps, and at the last step, the zero-shot tasks of `grt eval`
(pretrain/infer/evaluation/zero_shot.py: `train.eval_tasks`, their first `train.eval_tasks_limit` items,
from `train.eval_dir`) are scored at a few exit depths (`train.eval_tasks_depths`; by default
1, R/2 and R) by `zero_shot.evaluate_task`, the function `grt eval` scores them with: the
items sharded over the ranks, every rank running the same forwards (ZeRO-3 gathers parameters
inside them), the sums all-reduced. So a step's numbers are those of `grt eval <its
checkpoint> --tasks <the tasks> --depths <the depths> --limit <the limit> --eval-dir <the
dir>` (tests/training/test_task_eval.py), up to the order of float sums.

What is checked, and when: the task names and depths with every other value of the run
config (pretrain/runs/eval_tasks.py, from `RunConfig.validate`); the task files, each read once here,
before the process group starts (`TaskEval.build`, from `Trainer.preflight`): a missing or
empty one is one line naming it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.evaluation.zero_shot import evaluate_task
from pretrain.runs.eval_tasks import TASKS, Item, load_task, task_depths, task_names

if TYPE_CHECKING:
    from data_pipeline.tokenizer import Tokenizer
    from pretrain.model import GPT
    from pretrain.runs.run_config import RunConfig
    from pretrain.runs.train_config import TrainConfig
    from pretrain.training.report.metrics import MetricsWriter

RECORDS = "tasks.jsonl"  # <out>/tasks.jsonl: one record per evaluation, the full-precision numbers


def shown(task: str, metric: str) -> bool:
    """The metrics TensorBoard and the log line show, as `grt eval`'s table: not the item count,
    nor WinoGrande's acc_norm (its choices share one continuation: acc_norm is acc)."""
    return metric != "n" and not (task == "winogrande" and metric == "acc_norm")


def eval_dir(t: TrainConfig) -> Path:
    """train.eval_dir, or `grt eval`'s default ($GRT_EVAL_DIR, else ../shared/data/eval)."""
    from pretrain.infer.evaluation.evaluate import default_eval_dir

    return Path(t.eval_dir) if t.eval_dir else default_eval_dir()


@dataclass
class TaskScores:
    """One evaluation: {task: {depth: metrics}} as `grt eval` reports them, and what it cost."""

    step: int
    results: dict[str, dict[int, dict[str, float]]]
    seconds: float  # this evaluation's wall time (the slowest rank's: it ends in a collective)
    items: int  # items scored, over every task and rank (each at every depth)
    spent: float  # seconds of every evaluation in this process so far, this one included
    elapsed: float  # wall seconds since this process's first training step ended

    @property
    def share(self) -> float:
        """The share of the wall time since the first step that went to task evaluation."""
        return self.spent / self.elapsed if self.elapsed > 0 else 0.0


@dataclass
class TaskEval:
    """The zero-shot tasks of a run, loaded once (`build`), scored by `score` at the steps `due` says."""

    every: int
    tasks: dict[str, list[Item]]  # name -> its items (the first train.eval_tasks_limit)
    files: dict[str, Path]
    depths: list[int]
    tokenizer: Tokenizer
    batch_size: int  # requests per forward: train.micro_batch_size
    seed: int
    spent: float = 0.0
    started: float | None = None  # when `due` was first asked: the end of this process's first step
    last_written: int | None = field(default=None, repr=False)  # the step of the last record written

    @classmethod
    def build(cls, cfg: RunConfig, tokenizer_path: str) -> TaskEval | None:
        """The run's task evaluation, its files read and its tokenizer loaded (None:
        train.eval_tasks_every=0). A missing, unreadable or empty task file is one line naming it."""
        from data_pipeline.tokenizer import Tokenizer

        t = cfg.train
        if not t.eval_tasks_every:
            return None
        names, depths, root = task_names(t.eval_tasks), task_depths(t.eval_tasks_depths, cfg.model), eval_dir(t)
        tasks: dict[str, list[Item]] = {}
        files: dict[str, Path] = {}
        hint = "(train.eval_dir, else $GRT_EVAL_DIR or ../shared/data/eval; or leave the task out of train.eval_tasks)"
        for name in names:
            path = root / TASKS[name].file
            if not path.is_file():
                raise ConfigError(f"train.eval_tasks: {name}: {path} not found {hint}")
            try:
                items = load_task(name, path, t.eval_tasks_limit or None)
            except (ValueError, KeyError, TypeError, OSError) as err:
                raise ConfigError(
                    f"train.eval_tasks: {name}: {path} cannot be read as {name} items ({err!r})"
                ) from None
            if not items:
                raise ConfigError(f"train.eval_tasks: {name}: {path} holds no items: nothing to score")
            tasks[name], files[name] = items, path
        return cls(t.eval_tasks_every, tasks, files, depths, Tokenizer(tokenizer_path), t.micro_batch_size, t.seed)

    def due(self, step: int, last: int) -> bool:
        """Whether `step` (just trained) is an evaluation step: every `every` steps, and the last."""
        if self.started is None:
            self.started = time.perf_counter()
        return step % self.every == 0 or step == last

    def score(self, model: GPT, step: int, rank: int, world: int, device: torch.device) -> TaskScores:
        """Every task at every depth, rank `rank` of `world` scoring its share (collectives: every
        rank calls it at the same step). The model is put in eval mode and back; the random
        streams are forked, so the training after it draws what it would have drawn without it."""
        dist = Dist(rank, world)
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        results: dict[str, dict[int, dict[str, float]]] = {}
        forked = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=forked), torch.no_grad():
                torch.manual_seed(self.seed + step)  # a model that draws (Huginn's start state): the same every run
                for name, items in self.tasks.items():
                    results[name] = evaluate_task(
                        model, self.tokenizer, items, self.depths, device, self.batch_size, dist
                    )
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - t0
        self.spent += seconds
        elapsed = time.perf_counter() - (self.started if self.started is not None else t0)
        scored = sum(len(v) for v in self.tasks.values())
        return TaskScores(step, results, seconds, scored, self.spent, elapsed)

    # -- reporting ----------------------------------------------------------------------------
    @staticmethod
    def scalars(scores: TaskScores) -> dict[str, float]:
        """TensorBoard: tasks/<task>/<metric>_depth_<d> (acc; acc_norm of the multiple-choice
        tasks but WinoGrande, ppl of LAMBADA), and tasks/eval_s, this evaluation's seconds."""
        out = {
            f"tasks/{name}/{metric}_depth_{depth}": value
            for name, by_depth in scores.results.items()
            for depth, metrics in by_depth.items()
            for metric, value in metrics.items()
            if shown(name, metric)
        }
        return {**out, "tasks/eval_s": scores.seconds}

    def line(self, scores: TaskScores) -> str:
        """The log line of one evaluation: each task's metrics by depth, then the cost."""
        parts = []
        for name, by_depth in scores.results.items():
            metrics = [m for m in by_depth[self.depths[0]] if shown(name, m)]
            values = " ".join(f"{m} " + "/".join(_short(by_depth[d][m]) for d in self.depths) for m in metrics)
            parts.append(f"{name} {values}")
        return (
            f"zero-shot tasks at step {scores.step} (depths {'/'.join(map(str, self.depths))}): "
            f"{' | '.join(parts)} | {scores.items} items in {scores.seconds:.1f} s, "
            f"{100 * scores.share:.1f}% of the time since the first step ({scores.spent:.1f} of {scores.elapsed:.1f} s)"
        )

    def report(self, scores: TaskScores, tokens_seen: int, writer: MetricsWriter, out: Path, rank: int) -> str:
        """TensorBoard (the writer), and on rank 0 one record in <out>/tasks.jsonl (a step written
        again, after a resume or a rollback, first drops the records from it on); the log line."""
        from pretrain.training.report.metrics import trim_records

        writer.scalars(scores.step, self.scalars(scores), tokens=tokens_seen)  # each also against tokens
        if rank == 0:
            path = out / RECORDS
            if self.last_written is None or scores.step <= self.last_written:
                trim_records(path, scores.step - 1)
            record = {
                "step": scores.step,
                "depths": self.depths,
                "items": {name: len(items) for name, items in self.tasks.items()},
                "tasks": {name: {str(d): m for d, m in by_depth.items()} for name, by_depth in scores.results.items()},
                "seconds": scores.seconds,
                "share": scores.share,
            }
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.last_written = scores.step
        return self.line(scores)


def _short(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)
