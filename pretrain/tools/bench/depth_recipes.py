"""Truncated backprop's cost: the bare train step of a GRT preset (`train_step_fn`: forward, backward,
AdamW, as `grt train` computes it, no DeepSpeed) at one depth, backprop through the last k loop steps
(model.extra.backprop_steps; 0 = every step) against the full backward. Per k, in a fresh process:
the median step time, the bytes autograd keeps for the backward (exact: the activation memory) and
the peak memory above the step's start (CUDA's allocator, else the peak RSS). docs/training.md,
"Depth recipes", has the figures and this command:

    python -m pretrain.tools.bench.depth_recipes --preset tiny-grt --depth 4 --k 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import torch

from pretrain import PROJECT_ROOT
from pretrain.model import build_model
from pretrain.presets import get_preset
from pretrain.tools.bench.support import current_bytes, peak_bytes, reset_peak, timed_call, whole_number
from pretrain.tools.bench.train_step import train_step_fn


def probe(preset: str, depth: int, k: int, batch: int, seq_len: int, steps: int) -> dict[str, Any]:
    """One k, measured in this process (run by `main` in a fresh one)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = get_preset(preset).replace(extra={"backprop_steps": k} if k else {}, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    step = train_step_fn(model, depth, False, torch.float32, "off")
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    step(idx)  # the optimizer's state allocated
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx, n_loops=depth, return_logits=False).loss.backward()
    model.zero_grad(set_to_none=True)
    base = current_bytes(device)
    reset_peak(device)
    times = []
    for _ in range(steps):
        times.append(timed_call(lambda: step(idx), device))
    return {
        "k": k,
        "step_s": statistics.median(times),
        "saved_mb": sum(saved) / 2**20,
        "peak_mb": (peak_bytes(device) - base) / 2**20,
        "device": str(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pretrain.tools.bench.depth_recipes", description=__doc__)
    p.add_argument("--preset", default="tiny-grt")
    p.add_argument("--depth", type=whole_number(1), default=4, help="loop steps of every training step")
    p.add_argument("--k", default="0,1,2", help="backprop_steps to compare (0 = every step)")
    p.add_argument("--batch", type=whole_number(1), default=8)
    p.add_argument("--seq-len", type=whole_number(1), default=256)
    p.add_argument("--steps", type=whole_number(1), default=6, help="timed steps per k (the median is kept)")
    p.add_argument("--_probe", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._probe is not None:
        print(json.dumps(probe(args.preset, args.depth, args._probe, args.batch, args.seq_len, args.steps)))
        return
    # as `grt bench memory`: large tensors from mmap, so that the peak RSS follows the live tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    flags = ["--preset", args.preset, "--depth", str(args.depth), "--batch", str(args.batch)]
    flags += ["--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    rows = []
    for k in (int(x) for x in args.k.split(",")):
        command = [sys.executable, "-m", "pretrain.tools.bench.depth_recipes", *flags, "--_probe", str(k)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=PROJECT_ROOT, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.preset} at depth {args.depth}, batch {args.batch} x {args.seq_len}, fp32, {rows[0]['device']}")
    print("k (backprop_steps) | step time (s) | kept for the backward (MB) | peak above the step's start (MB)")
    for r in rows:
        name = f"{r['k']} (every step)" if r["k"] == 0 or r["k"] >= args.depth else str(r["k"])
        print(f"{name} | {r['step_s']:.3f} | {r['saved_mb']:.1f} | {r['peak_mb']:.1f}")


if __name__ == "__main__":
    main()
