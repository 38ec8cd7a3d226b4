"""What bf16 and the loss cost: `grt bench precision` and `grt bench loss`.

    grt bench precision  the GRT's loop state under bf16 weights (as DeepSpeed's bf16 mode casts
                         the model), kept in bf16 or in fp32 (ModelConfig.state_dtype), against
                         the fp32 model: the error of the state after R loop steps, then short
                         real `grt train` runs in bf16 with either state against fp32's losses
    grt bench loss       time and peak memory of the training loss at GPT-2's vocabulary, one
                         row per way of computing it (LOSS_ROWS): the plain cross-entropy on
                         materialised logits, the chunked `linear_cross_entropy` before padding
                         (eager, 50,257 columns) and after (50,304, the padding masked), eager,
                         compiled and cut-cross-entropy's; with each one's largest differences
                         from the fp32 reference in the loss and gradients

Both run on the CPU (bf16 matmuls included) as on a GPU; the figures printed are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grt_common.errors import ConfigError
from pretrain import PROJECT_ROOT
from pretrain.model import GPT, build_model
from pretrain.model.layers import AttentionContext
from pretrain.model.loss import IGNORE_INDEX, linear_cross_entropy, lm_loss, loss_chunk, resolve_impl
from pretrain.model_config import ModelConfig, padded_vocab
from pretrain.presets import PAPER_START, get_preset
from pretrain.tools.bench.support import (
    GPT2_VOCAB,
    current_bytes,
    make_bench_data,
    peak_bytes,
    reset_peak,
    train_command,
    whole_number,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    and of the loop's total change s_R - e, with bf16 weights and the state in bf16 or in fp32. The
    model starts as the paper's (PAPER_START: the gate at 0.98), whose ~2% writes are what bf16 rounds."""
    torch.manual_seed(seed)
    cfg = cfg.replace(**PAPER_START)
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
    settings = [f"train.precision={precision}", f"model.state_dtype={state}", "train.eval_every=0"]
    settings += ["train.save_every=0", "train.save_final=false", f"train.log_every={steps}"]
    settings += [f"train.warmup_steps={steps // 10}", "train.lr=2e-3", "train.depth_sampling=fixed"]
    cmd = [sys.executable, "-m", *train_command(preset, manifest, out, steps, 8, "ds_configs/zero2.json", settings)]
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


# `grt bench loss`'s rows: name -> what it is
LOSS_ROWS = {
    "plain": "logits, then F.cross_entropy in fp32 (the reference)",
    "chunked-unpadded": "the chunked loss before padding: eager, at the real vocabulary's width",
    "chunked-padded": "the chunked loss, eager, at the padded width (the padding masked)",
    "compiled": "the chunked loss at the padded width, each chunk under torch.compile",
    "cce": "cut-cross-entropy's fused kernel (CUDA, where installed)",
}


def _loss_inputs(
    tokens: int, d: int, vocab: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, the head's weight at the padded width, targets (every 10th not scored)."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, d, device=device, generator=gen).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(padded_vocab(vocab), d, device=device, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    targets[::10] = IGNORE_INDEX
    return h, w, targets


def _loss(row: str, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    if row == "plain":
        return lm_loss((h @ w[:vocab].t())[None], targets[None])
    if row == "chunked-unpadded":
        return linear_cross_entropy(h, w[:vocab], targets, vocab, impl="eager")
    return linear_cross_entropy(h, w, targets, vocab, impl={"chunked-padded": "eager"}.get(row, row))


def _why_not(row: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `row` cannot run here, or None."""
    h, w = torch.empty(1, 1, device=device, dtype=dtype), torch.empty(1, 1, device=device, dtype=dtype)
    try:
        if row in ("compiled", "cce"):
            resolve_impl(row, h, w)
    except RuntimeError as err:
        return str(err)
    return None


def loss_probe(argv: list[str]) -> None:
    """One row of `grt bench loss` in a fresh process: warm-up (and compile), then the median time
    of forward and backward, and the peak memory above what was in use before (the inputs and the
    weight excluded, the gradients included); then the largest differences from the reference."""
    tokens, d, vocab, row, dtype_name, repeats, warmup = argv[0], argv[1], argv[2], argv[3], argv[4], argv[5], argv[6]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[dtype_name]
    h, w, targets = _loss_inputs(int(tokens), int(d), int(vocab), device, dtype)
    times: list[float] = []
    peak = 0
    for i in range(int(warmup) + int(repeats)):
        h.grad = w.grad = None
        if i == int(warmup):
            reset_peak(device)
            base = current_bytes(device)
        _sync(device)
        t0 = time.perf_counter()
        loss = _loss(row, h, w, targets, int(vocab))
        loss.backward()
        _sync(device)
        if i >= int(warmup):
            times.append(time.perf_counter() - t0)
    peak = peak_bytes(device) - base
    assert h.grad is not None and w.grad is not None  # leaves that require grad, after backward
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = lm_loss((h32 @ w32[: int(vocab)].t())[None], targets[None])
    ref.backward()
    assert h32.grad is not None and w32.grad is not None
    width = int(vocab) if row == "chunked-unpadded" else w.shape[0]
    chunked = row.startswith("chunked") or row == "compiled"
    out = {
        "chunk": loss_chunk(h.shape[0], width, device) if chunked else None,
        "ms": 1000 * statistics.median(times),
        "peak_mb": peak / 2**20,
        "loss_abs_diff": float((loss.detach().float() - ref.detach()).abs()),
        "grad_h_rel_diff": _rel(h.grad, h32.grad),
        "grad_w_rel_diff": _rel(w.grad, w32.grad),
        "padded_rows_grad": float(w.grad[int(vocab) :].abs().max()) if w.shape[0] > int(vocab) else 0.0,
    }
    print(json.dumps(out))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_loss(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each row in its own process (its peak memory alone; on the CPU glibc serves large tensors
    from mmap, as `grt bench memory` does, so that the RSS follows the live tensors)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    probe = [sys.executable, "-m", "pretrain.tools.bench.numerics", "_loss_probe"]
    sizes = [str(args.tokens), str(args.d_model), str(args.vocab)]
    h, w = torch.empty(1, 1, device=device, dtype=dtype), torch.empty(1, 1, device=device, dtype=dtype)
    auto = resolve_impl("auto", h, w)
    rows: list[dict[str, Any]] = []
    for row in args.rows:
        base = {"row": row, "device": device.type, "dtype": dtype_name, "tokens": args.tokens, "d_model": args.d_model}
        base["width"] = args.vocab if row in ("plain", "chunked-unpadded") else padded_vocab(args.vocab)
        why = _why_not(row, device, dtype)
        if why is not None:
            rows.append({**base, "skipped": why})
            continue
        cmd = [*probe, *sizes, row, dtype_name, str(args.repeats), str(args.warmup)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=PROJECT_ROOT, env=env)
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        training = {"eager": "chunked-padded"}.get(auto, auto)
        rows.append({**base, **measured, "training_default": row == training})
    return rows


def format_loss_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        "row | width | chunk | ms (fwd+bwd) | peak MB | loss diff | grad h rel diff | grad w rel diff | training's",
        "---|---:|---:|---:|---:|---:|---:|---:|---",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['row']} | {r['width']} | | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(
            f"{r['row']} | {r['width']} | {r['chunk'] or ''} | {r['ms']:,.1f} | {r['peak_mb']:,.1f} | "
            f"{r['loss_abs_diff']:.1e} | {r['grad_h_rel_diff']:.1e} | {r['grad_w_rel_diff']:.1e} | "
            f"{'yes' if r['training_default'] else ''}"
        )
    first = rows[0]
    lines.append(
        f"\n{first['tokens']} tokens, d {first['d_model']}, {first['dtype']} on {first['device']}; diffs against "
        "the fp32 reference (plain logits, F.cross_entropy); chunk: tokens per chunk (loss_chunk: on CUDA "
        "sized by the free memory); training's: the impl `auto` picks here."
    )
    lines += [f"  {name}: {what}" for name, what in LOSS_ROWS.items()]
    return "\n".join(lines)


def bench_precision(args: argparse.Namespace) -> dict[str, Any]:
    cfg = get_preset(args.preset)
    if not cfg.parsed_layout.looped:
        raise ConfigError(f"--preset {args.preset}: a dense model has no loop state to measure; use a looped preset")
    if args.seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len}: more than {args.preset}'s max_seq_len of {cfg.max_seq_len}")
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
    lo = sub.add_parser(
        "loss", help="time and peak memory of the training loss: plain, chunked before and after padding, compiled"
    )
    lo.add_argument("--tokens", type=whole_number(1), default=4096, help="tokens of one loss (default: CPU-sized)")
    lo.add_argument("--d-model", type=whole_number(1), default=768)
    lo.add_argument("--vocab", type=whole_number(2), default=GPT2_VOCAB, help="the real vocabulary (padded to 64)")
    lo.add_argument("--repeats", type=whole_number(1), default=3, help="timed runs per row; the median is reported")
    lo.add_argument("--warmup", type=whole_number(1), default=1, help="untimed runs first (the compile)")
    lo.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on CUDA, fp32 on the CPU")
    lo.add_argument(
        "--rows", type=_loss_rows, default=list(LOSS_ROWS), help=f"comma-separated, of {', '.join(LOSS_ROWS)}"
    )
    for sp in (pr, lo):
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    args = p.parse_args(argv)
    result = bench_precision(args) if args.what == "precision" else bench_loss(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"# reproduce: grt bench {' '.join(argv)}")
    if isinstance(result, list):
        print(format_loss_rows(result))
        return 0
    for key, value in result.items():
        print(f"{key:<40} {value:,.6g}" if isinstance(value, float) else f"{key:<40} {value}")
    return 0


def _loss_rows(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in LOSS_ROWS]
    if bad or not rows:
        raise argparse.ArgumentTypeError(f"{text!r}: expected rows of {', '.join(LOSS_ROWS)}, comma-separated")
    return rows


if __name__ == "__main__":
    sys.exit(main())
