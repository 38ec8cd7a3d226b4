"""The zero-shot tasks a run and `grt eval` name, and the exit depths they are scored at: each
task's file and how its JSON lines become items (scored by pretrain/infer/evaluation/zero_shot.py), and
the checks of train.eval_tasks and train.eval_tasks_depths that `RunConfig.validate` makes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from pretrain.model_config import ModelConfig


@dataclass
class Item:
    requests: list[tuple[str, str]]  # (context, continuation) per choice
    gold: int = 0
    kind: str = "mc"  # mc | lambada

    @property
    def choice_chars(self) -> list[int]:
        return [len(c) for _, c in self.requests]


@dataclass
class TaskSpec:
    file: str
    kind: str = "mc"
    build: Callable[[dict[str, Any]], Item] | None = field(default=None, repr=False)  # a JSON line -> an Item


def _qa_context(query: str) -> str:
    q = query.rstrip()
    return q if q.endswith("Answer:") else q + "\nAnswer:"


def _lambada(d: dict[str, Any]) -> Item:
    return Item([(d["context"], " " + d["continuation"])], 0, "lambada")


def _hellaswag(d: dict[str, Any]) -> Item:
    ctx = f"{d['activity_label']}: {d['ctx']}"
    return Item([(ctx, " " + e) for e in d["endings"]], int(d["label"]))


def _qa(d: dict[str, Any]) -> Item:
    ctx = _qa_context(d["query"])
    return Item([(ctx, " " + c) for c in d["choices"]], int(d["gold"]))


def _winogrande(d: dict[str, Any]) -> Item:
    return Item([(opt, " " + d["continuation"]) for opt in d["context_options"]], int(d["gold"]))


TASKS: dict[str, TaskSpec] = {
    "lambada": TaskSpec("lambada_openai.jsonl", "lambada", _lambada),
    "hellaswag": TaskSpec("hellaswag_val.jsonl", "mc", _hellaswag),
    "piqa": TaskSpec("piqa.jsonl", "mc", _qa),
    "arc_easy": TaskSpec("arc_easy.jsonl", "mc", _qa),
    "arc_challenge": TaskSpec("arc_challenge.jsonl", "mc", _qa),
    "winogrande": TaskSpec("winogrande.jsonl", "mc", _winogrande),
}


def load_task(name: str, path: str | Path, limit: int | None = None) -> list[Item]:
    build = TASKS[name].build
    if build is None:
        raise ValueError(f"task {name!r} has no item builder")
    items: list[Item] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                items.append(build(json.loads(line)))
                if limit is not None and len(items) >= limit:
                    break
    return items


# -- depths ------------------------------------------------------------------------------
def parse_depths(text: str | None, trained: int) -> list[int]:
    """'0-12', '0,2,4', '0-4,8' -> sorted unique ints; None -> 0..trained."""
    if text is None or text == "":
        return list(range(0, trained + 1))
    depths: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError
                depths.update(range(a, b + 1))
            else:
                depths.add(int(part))
        except ValueError:
            raise ConfigError(f"--depths {text!r}: expected e.g. '0-12', '0,2,4' or '0-4,8'") from None
    if any(d < 0 for d in depths):
        raise ConfigError(f"--depths {text!r}: depths are >= 0")
    return sorted(depths)


def task_names(text: str) -> list[str]:
    """train.eval_tasks: 'all' (every task of TASKS) or comma-separated names."""
    if text.strip() == "all":
        return list(TASKS)
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ConfigError(
            f"train.eval_tasks={text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no task named'}; "
            f"accepted: all, or comma-separated names of {', '.join(TASKS)}"
        )
    return names


def default_depths(model: ModelConfig) -> list[int]:
    """1, R/2 (rounded down) and R of a looped model; a dense model's N (the whole model, as `grt eval`)."""
    layout = model.parsed_layout
    if not layout.looped:
        return [layout.prelude]
    r = layout.loops
    return sorted({1, max(1, r // 2), r})


def task_depths(text: str, model: ModelConfig) -> list[int]:
    """train.eval_tasks_depths: '' (default_depths), or exit depths as `grt eval --depths` reads
    them ('1,2,4', '1-4'): a looped model's loop steps (any >= 0; above the layout's R
    `grt eval` needs --allow-beyond-trained), a dense model's layers run, 1..N."""
    if not text.strip():
        return default_depths(model)
    key = f"train.eval_tasks_depths={text!r}"
    try:
        depths = parse_depths(text, 0)
    except ConfigError:
        raise ConfigError(f"{key}: expected exit depths, e.g. '1,2,4' or '1-4' ('' = 1, R/2, R)") from None
    layout = model.parsed_layout
    if not layout.looped and not all(1 <= d <= layout.prelude for d in depths):
        n = layout.prelude
        raise ConfigError(
            f"{key}: a dense model's exit depth is the number of layers run, 1..{n} ({n}: the whole model)"
        )
    return depths
