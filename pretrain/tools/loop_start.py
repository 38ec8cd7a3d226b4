"""Which start lets a small GRT use its loop: each candidate start trained briefly on the same
shards over seeds, with the loop's health at the end (docs/comparison.md, "A start in which a
small GRT uses its loop").

    python -m pretrain.tools.loop_start --data runs/demo/data/shards/manifest.json --seeds 0,1

A start is a set of ModelConfig switches on top of a preset (`STARTS`): the gate's bias start,
the projection's start (`proj_init`), the state noise's scale (`state_noise_scale`), and the
training's depth distribution. Each run is plain PyTorch on one process (the model code of
`grt train`, AdamW with the trainer's recipe: betas 0.9/0.95, weight decay 0.1 on matrices,
clipping 1.0, linear warm-up then cosine; no DeepSpeed), so that a sweep fits a CPU. Finished
runs are kept in <out>.jsonl and reused, so the command can be stopped and run again.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from data_pipeline.manifest import Manifest
from pretrain.infer.loop_health import LoopHealth, loop_health
from pretrain.model import build_model
from pretrain.model.gpt import GPT
from pretrain.presets import PAPER_START, get_preset
from pretrain.training.depth import sample_depth

PAPER = PAPER_START
# name -> (model switches, depth distribution)
STARTS: dict[str, tuple[dict[str, Any], str]] = {
    "paper (gate +4, random W_proj, absolute noise)": (PAPER, "uniform"),
    "gate +2": ({**PAPER, "gate_bias_init": 2.0}, "uniform"),
    "gate 0": ({**PAPER, "gate_bias_init": 0.0}, "uniform"),
    "gate 0, no state noise": ({**PAPER, "gate_bias_init": 0.0, "state_noise_std": 0.0}, "uniform"),
    "gate 0, relative noise": ({**PAPER, "gate_bias_init": 0.0, "state_noise_scale": "relative"}, "uniform"),
    "residual W_proj, relative noise, gate +2": (
        {"gate_bias_init": 2.0, "proj_init": "residual", "state_noise_scale": "relative"},
        "uniform",
    ),
    "residual W_proj, relative noise, gate 0": (
        {"gate_bias_init": 0.0, "proj_init": "residual", "state_noise_scale": "relative"},
        "uniform",
    ),
    "residual W_proj, no state noise, gate 0": (
        {"gate_bias_init": 0.0, "proj_init": "residual", "state_noise_std": 0.0},
        "uniform",
    ),
    "gate 0, depth fixed at R": ({**PAPER, "gate_bias_init": 0.0}, "fixed"),
}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine to lr / 10 (the demo's schedule)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * progress))


def train_briefly(
    model: GPT,
    batches: Iterator[dict[str, torch.Tensor]],
    steps: int,
    lr: float,
    warmup: int,
    seed: int,
    depth_sampling: str = "uniform",
    gate_override: float | None = None,
) -> GPT:
    """`steps` AdamW steps of one batch each at the sampled depth (gate_override: the gate forced in
    training, a broken loop for the tests)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        batch = next(batches)
        n = sample_depth(depth_sampling, model.max_loops, seed, step)
        loss = model(batch["input_ids"], batch["targets"], n_loops=n, gate_override=gate_override, return_logits=False)
        opt.zero_grad(set_to_none=True)
        assert loss.loss is not None
        loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model


@torch.no_grad()
def measure(model: GPT, val: list[dict[str, torch.Tensor]]) -> LoopHealth:
    """The validation loss at every depth 0..R and the mean gate per loop step on `val`."""
    model.eval()
    R = model.max_loops
    by_depth = {r: 0.0 for r in range(R + 1)}
    gates = [0.0] * R
    for batch in val:
        for r in range(R + 1):
            out = model(batch["input_ids"], batch["targets"], n_loops=r, return_gates=r == R, return_logits=False)
            assert out.loss is not None
            by_depth[r] += float(out.loss) / len(val)
            for i, g in enumerate(out.gates):
                gates[i] += float(g.mean()) / len(val)
    health = loop_health(by_depth, gates if any(gates) else [])
    assert health is not None, "a model without a loop"
    return health


def measure_line(record: dict[str, Any]) -> str:
    """The loop-health line of a run's record (pretrain/infer/loop_health.py)."""
    health = loop_health(record["by_depth"], record["gate_mean_by_step"])
    return health.line() if health is not None else "no loop"


def loader(manifest: str | Manifest, split: str, batch_size: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of `split` (a Manifest object: loaded, and its tokenizer hashed, once by the caller)."""
    from data_pipeline.loader import TokenBatchLoader

    return iter(TokenBatchLoader(manifest, split=split, micro_batch_size=batch_size, loop=split == "train", seed=seed))


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One start at one seed: its health as a JSON record."""
    torch.set_num_threads(1)
    torch.manual_seed(job["seed"])
    switches, depth = STARTS[job["start"]]
    manifest = Manifest.load(job["data"])
    cfg = get_preset(job["preset"]).replace(vocab_size=manifest.vocab_size, max_seq_len=manifest.seq_len, **switches)
    model = build_model(cfg)
    batches = loader(manifest, "train", job["batch"], job["seed"])
    train_briefly(model, batches, job["steps"], job["lr"], job["warmup"], job["seed"], depth)
    val = [b for _, b in zip(range(job["val_batches"]), loader(manifest, "val", 32, 0))]
    health = measure(model, val)
    return {**job, **health.record(), "by_depth": health.by_depth}


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: per start, mean ± sd over seeds of what the loop's steps after the first add (L(1) -
    L(R), pretrain/infer/loop_health.py), depth 0 (never trained) against depth 1, the final
    validation loss, the loss at depth 0, and the mean gate per loop step."""
    lines = [
        "| start | seeds | steps after the first, L(1) - L(R) | depth 0 (untrained) - depth 1 | val loss at R "
        "| val loss at 0 | gate mean by step |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(values: list[float]) -> str:  # one seed: no spread to give
        if len(values) < 2:
            return f"{statistics.mean(values):.3f} (1 seed)"
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"

    for start in STARTS:
        runs = [r for r in records if r["start"] == start]
        if not runs:
            continue
        R = max(int(k) for k in runs[0]["by_depth"])
        gates = " / ".join(f"{statistics.mean(r['gate_mean_by_step'][i] for r in runs):.3f}" for i in range(R))
        lines.append(
            f"| {start} | {len(runs)} | {cell([r['by_depth']['1'] - r['by_depth'][str(R)] for r in runs])} | "
            f"{cell([r['by_depth']['0'] - r['by_depth']['1'] for r in runs])} | "
            f"{cell([r['by_depth'][str(R)] for r in runs])} | {cell([r['by_depth']['0'] for r in runs])} | {gates} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.tools.loop_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="manifest.json (the demo's: runs/demo/data/shards/manifest.json)")
    p.add_argument("--out", default="runs/loop-start", help="<out>.jsonl (the runs, reused) and <out>.md (the table)")
    p.add_argument("--preset", default="tiny-grt")
    p.add_argument("--starts", default="", help="names from STARTS separated by ';' (default: all)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=600, help="the demo's 600")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=6)
    p.add_argument("--parallel", type=int, default=1, help="runs at once (one thread each)")
    args = p.parse_args(argv)
    starts = [s.strip() for s in args.starts.split(";") if s.strip()] or list(STARTS)
    unknown = [s for s in starts if s not in STARTS]
    if unknown:
        print(f"loop_start: error: unknown start(s) {unknown}; known: {list(STARTS)}", file=sys.stderr)
        return 2
    store = Path(f"{args.out}.jsonl")
    store.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in store.read_text().splitlines()] if store.is_file() else []
    settings = {k: getattr(args, k) for k in ("data", "preset", "steps", "batch", "lr", "warmup", "val_batches")}
    jobs = [  # seed by seed: a sweep stopped early has every start at the first seeds
        {**settings, "start": s, "seed": int(seed)}
        for seed in args.seeds.split(",")
        for s in starts
        if not any(
            r["start"] == s and r["seed"] == int(seed) and all(r[k] == v for k, v in settings.items()) for r in done
        )
    ]
    with ProcessPoolExecutor(max_workers=args.parallel) as pool:
        for record in pool.map(run_one, jobs):
            done.append(json.loads(json.dumps(record)))
            with store.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{record['start']} seed {record['seed']}: {measure_line(record)}", flush=True)
    mine = [r for r in done if all(r[k] == v for k, v in settings.items())]
    command = "python -m pretrain.tools.loop_start " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"{table(mine)}\n\nCommand: `{command}`\n"
    Path(f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
