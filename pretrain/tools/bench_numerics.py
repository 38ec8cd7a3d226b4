"""What bf16 and the loss cost: `grt bench precision` and `grt bench loss`.

    grt bench precision  the GRT's loop state under bf16 weights (as DeepSpeed's bf16 mode casts
                         the model), kept in bf16 or in fp32 (ModelConfig.state_dtype), against
                         the fp32 model: the error of the state after R loop steps, then short
                         real `grt train` runs in bf16 with either state against fp32's losses
    grt bench loss       peak memory of the training loss at a GPT-2 vocabulary: the plain
                         cross-entropy on materialised logits against `linear_cross_entropy`,
                         with the largest difference in the loss and gradients

Both run on the CPU (bf16 matmuls included) as on a GPU; the figures printed are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pretrain import PROJECT_ROOT
from pretrain.config import ModelConfig
from pretrain.model import GPT, build_model
from pretrain.model.layers import AttentionContext
from pretrain.model.loss import linear_cross_entropy, lm_loss
from pretrain.presets import get_preset
from pretrain.tools.bench import _peak_bytes, make_bench_data, whole_number


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@torch.no_grad()
def _prelude_and_state(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, s_R): the prelude output and the state after the layout's R steps, in fp64 for comparing."""
    ctx = AttentionContext()
    e = model.run_prelude(model.embed(idx), ctx)
    s = model.run_loop(e, ctx, model.max_loops)
    return e.double(), s.double()


def state_errors(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 0) -> dict[str, float]:
    """Relative errors against the fp32 model (eval mode, the same weights) of the prelude output e
    and of the loop's total change s_R - e, with bf16 weights and the state in bf16 or in fp32."""
    torch.manual_seed(seed)
    reference = build_model(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    e_ref, s_ref = _prelude_and_state(reference, idx)
    out: dict[str, float] = {}
    for state in ("weights", "fp32"):
        model = build_model(cfg.replace(state_dtype=state)).eval()
        model.load_state_dict(reference.state_dict())
        e, s = _prelude_and_state(model.to(torch.bfloat16), idx)
        name = "bf16" if state == "weights" else "fp32"
        out[f"prelude_error_state_{name}"] = _rel(e, e_ref)
        out[f"loop_change_error_state_{name}"] = _rel(s - e, s_ref - e_ref)
    return out


def _train_losses(manifest: Path, preset: str, out: Path, steps: int, precision: str, state: str) -> list[float]:
    cmd = [
        sys.executable,
        "-m",
        "pretrain.cli",
        "train",
        "--preset",
        preset,
        "--data",
        str(manifest),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--micro-batch-size",
        "8",
        "--ds-config",
        "ds_configs/zero2.json",
        "--set",
        f"train.precision={precision}",
        "--set",
        f"model.state_dtype={state}",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=0",
        "--set",
        "train.save_final=false",
        "--set",
        f"train.log_every={steps}",
        "--set",
        f"train.warmup_steps={steps // 10}",
        "--set",
        "train.lr=2e-3",
        "--set",
        "train.depth_sampling=fixed",
    ]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def training_losses(preset: str, steps: int, seq_len: int) -> dict[str, float]:
    """Short `grt train` runs (ZeRO-2, fixed depth): fp32, then bf16 with the state in bf16 and
    in fp32. Per run: the mean of the last tenth of the losses, and its mean absolute
    difference from fp32's step by step."""
    cfg = get_preset(preset)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        manifest = make_bench_data(tmp, seq_len, cfg.vocab_size)
        runs = {"fp32": ("fp32", "fp32"), "bf16_state_bf16": ("bf16", "weights"), "bf16_state_fp32": ("bf16", "fp32")}
        losses = {name: _train_losses(manifest, preset, tmp / name, steps, *how) for name, how in runs.items()}
    tail = max(1, steps // 10)
    out: dict[str, float] = {}
    for name, values in losses.items():
        out[f"final_loss_{name}"] = sum(values[-tail:]) / tail
        if name != "fp32":
            out[f"mean_abs_loss_diff_vs_fp32_{name}"] = sum(abs(a - b) for a, b in zip(values, losses["fp32"])) / steps
    return out


def loss_probe(argv: list[str]) -> None:
    """One forward and backward of the training loss in a fresh process; prints the peak memory
    above the baseline (the inputs and weight excluded)."""
    tokens, d, vocab, mode = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, w, targets = _loss_inputs(tokens, d, vocab, device)
    base = _peak_bytes(device)
    loss = _loss(mode, h, w, targets)
    loss.backward()
    print(json.dumps({"peak_bytes": _peak_bytes(device) - base}))


def _loss_inputs(
    tokens: int, d: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, d, device=device, generator=gen).requires_grad_()
    w = (0.02 * torch.randn(vocab, d, device=device, generator=gen)).requires_grad_()
    return h, w, torch.randint(0, vocab, (tokens,), device=device, generator=gen)


def _loss(mode: str, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if mode == "plain":  # what the head and loss did before: [tokens x V] logits, their fp32 copy and gradient
        return lm_loss((h @ w.t())[None], targets[None])
    return linear_cross_entropy(h, w, targets, w.shape[0])


def bench_loss(args: argparse.Namespace) -> dict[str, Any]:
    # as `grt bench memory`: glibc serves large tensors from mmap, so that RSS follows the live tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    out: dict[str, Any] = {"tokens": args.tokens, "d_model": args.d_model, "vocab": args.vocab}
    for mode in ("plain", "fused"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pretrain.tools.bench_numerics",
                "_loss_probe",
                str(args.tokens),
                str(args.d_model),
                str(args.vocab),
                mode,
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=PROJECT_ROOT,
            env=env,
        )
        out[f"peak_mb_{mode}"] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**20
    out["peak_ratio_fused_to_plain"] = out["peak_mb_fused"] / out["peak_mb_plain"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # mode -> (loss, grad h, grad w)
    for mode in ("plain", "fused"):
        h, w, targets = _loss_inputs(args.tokens, args.d_model, args.vocab, device)
        loss = _loss(mode, h, w, targets)
        loss.backward()
        assert h.grad is not None and w.grad is not None  # leaves that require grad, after backward
        results[mode] = (loss.detach(), h.grad, w.grad)
    (loss_p, gh_p, gw_p), (loss_f, gh_f, gw_f) = results["plain"], results["fused"]
    out["loss_abs_diff"] = float((loss_p - loss_f).abs())
    out["grad_h_rel_diff"] = _rel(gh_f, gh_p)
    out["grad_w_rel_diff"] = _rel(gw_f, gw_p)
    return out


def bench_precision(args: argparse.Namespace) -> dict[str, Any]:
    cfg = get_preset(args.preset)
    out: dict[str, Any] = {"preset": args.preset, "layout": cfg.layout, **state_errors(cfg, args.batch, args.seq_len)}
    if args.train_steps:
        out.update(training_losses(args.preset, args.train_steps, args.seq_len))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_loss_probe":
        loss_probe(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="grt bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    pr = sub.add_parser("precision", help="the loop state under bf16: error after R steps, and training losses")
    pr.add_argument("--preset", default="tiny-grt")
    pr.add_argument("--batch", type=whole_number(1), default=8)
    pr.add_argument("--seq-len", type=whole_number(1), default=128)
    pr.add_argument("--train-steps", type=whole_number(0), default=200, help="steps of each `grt train` run (0: none)")
    lo = sub.add_parser("loss", help="peak memory of the training loss, plain vs fused linear cross-entropy")
    lo.add_argument("--tokens", type=whole_number(1), default=4096)
    lo.add_argument("--d-model", type=whole_number(1), default=768)
    lo.add_argument("--vocab", type=whole_number(1), default=50257)
    args = p.parse_args(argv)
    benches: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "precision": bench_precision,
        "loss": bench_loss,
    }
    result = benches[args.what](args)
    print(f"# reproduce: grt bench {' '.join(argv)}")
    for key, value in result.items():
        print(f"{key:<40} {value:,.6g}" if isinstance(value, float) else f"{key:<40} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
