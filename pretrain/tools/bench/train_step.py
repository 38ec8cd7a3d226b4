"""`grt bench train-step` and `grt bench memory`: the bare model step (forward, backward, AdamW,
no DeepSpeed) of a GRT against the dense model of equal FLOPs, and its peak memory against R
with per-loop-step checkpointing on and off (each measured in a fresh process)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pretrain import PROJECT_ROOT
from pretrain.model import GPT, build_model
from pretrain.model.flops import flops_per_token
from pretrain.model_config import ModelConfig
from pretrain.tools.bench.support import peak_bytes, timed_call
from pretrain.training.engine.parallelize import apply_activation_checkpointing, checkpoint_and_compile
from pretrain.training.report.metrics import peak_flops


def equal_flops_pair(
    d_model: int, n_heads: int, layout: str, seq_len: int, vocab: int
) -> tuple[ModelConfig, ModelConfig]:
    """A GRT and the dense model of the same width and effective depth (equal FLOPs up to
    the loop's small projection and gate)."""
    common: dict[str, Any] = dict(d_model=d_model, n_heads=n_heads, vocab_size=vocab, max_seq_len=seq_len, bias=False)
    grt = ModelConfig(name="grt", variant="grt", layout=layout, **common)
    dense = ModelConfig(name="dense", variant="dense", layout=str(grt.parsed_layout.effective_depth()), **common)
    return grt, dense


def train_step_fn(
    model: GPT, n_loops: int | None, compiled: bool, dtype: torch.dtype, checkpointing: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One optimizer step computed as `grt train` computes it: the weights in the training dtype
    (DeepSpeed's bf16 mode casts the model; the GRT's loop state stays fp32, ModelConfig.state_dtype),
    checkpointing and compilation as the trainer applies them (`checkpoint_and_compile`), the loss
    without logits.
    DeepSpeed's optimizer also keeps fp32 master weights; this AdamW steps the weights as they are."""
    checkpoint_and_compile(model.to(dtype), checkpointing, compiled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available() or None)

    def step(idx: torch.Tensor) -> torch.Tensor:
        loss = model(idx, idx, n_loops=n_loops, return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def bench_train_step(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grt_cfg, dense_cfg = equal_flops_pair(args.d_model, args.n_heads, args.layout, args.seq_len, args.vocab)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    peak, peak_note = peak_flops(device, args.peak_tflops)
    results: dict[str, Any] = {"peak_flops_note": peak_note}
    for compiled in [False, True] if args.compile else [False]:
        steps: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        for name, cfg in (("grt", grt_cfg), ("dense", dense_cfg)):
            torch.manual_seed(0)
            model = build_model(cfg).to(device).train()
            steps[name] = train_step_fn(
                model, cfg.max_loops if cfg.parsed_layout.looped else None, compiled, dtype, args.checkpointing
            )
            for _ in range(args.warmup):
                steps[name](idx)
        times = {name: 0.0 for name in steps}
        for _ in range(args.steps):  # interleaved, so machine noise hits both alike
            for name, step in steps.items():
                times[name] += timed_call(partial(step, idx), device)
        tag = "compiled" if compiled else "eager"
        tokens = args.steps * idx.numel()
        for name, cfg in (("grt", grt_cfg), ("dense", dense_cfg)):
            fpt = flops_per_token(cfg, args.seq_len, executed=True)
            results[f"{name}_{tag}_tokens_per_s"] = tokens / times[name]
            results[f"{name}_{tag}_mfu"] = 3 * fpt * tokens / times[name] / peak
            results[f"{name}_flops_per_token"] = fpt
        # at equal FLOPs per token: the dense model's tokens/s rescaled to the GRT's FLOPs
        results[f"ratio_{tag}"] = results[f"grt_{tag}_mfu"] / results[f"dense_{tag}_mfu"]
        results[f"raw_tokens_ratio_{tag}"] = results[f"grt_{tag}_tokens_per_s"] / results[f"dense_{tag}_tokens_per_s"]
    results["grt_tokens_per_s"] = results["grt_eager_tokens_per_s"]
    results["dense_tokens_per_s"] = results["dense_eager_tokens_per_s"]
    results["ratio"] = results["ratio_eager"]
    results["peak_bytes"] = peak_bytes(device)
    results.update(
        layout=args.layout,
        dense_layout=dense_cfg.layout,
        d_model=args.d_model,
        seq_len=args.seq_len,
        batch=args.batch,
        device=str(device),
        checkpointing=args.checkpointing,
    )
    return results


def memory_probe(argv: list[str]) -> None:
    """One training step in a fresh process; prints the peak memory above the baseline."""
    d_model, seq_len, batch, loops, mode = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(layout=f"1+2x{loops}+1", d_model=d_model, n_heads=4, vocab_size=512, max_seq_len=seq_len)
    model = apply_activation_checkpointing(build_model(cfg).to(device).train(), mode)
    idx = torch.randint(0, 512, (batch, seq_len), device=device)
    base = peak_bytes(device)
    model(idx, idx).loss.backward()
    print(json.dumps({"peak_bytes": peak_bytes(device) - base}))


def bench_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for loops in args.loops:
        for mode in ("off", "loop_step"):
            # On CPU the peak is the process's peak RSS. glibc keeps freed chunks mapped and
            # fragments, which inflates RSS with every alloc/free cycle; serving large tensors
            # from mmap (returned to the OS on free) makes RSS follow the live tensors.
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pretrain.tools.bench.cli",
                    "_memory_probe",
                    str(args.d_model),
                    str(args.seq_len),
                    str(args.batch),
                    str(loops),
                    mode,
                ],
                capture_output=True,
                text=True,
                check=True,
                cwd=PROJECT_ROOT,
                env=env,
            )
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
            rows.append({"R": loops, "checkpointing": mode != "off", "peak_bytes": peak})
    return rows
