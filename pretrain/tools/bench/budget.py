"""`grt bench budget`: where a training step's time goes on one GPU, predicted from this tree's
model (its FLOP counts, pretrain/model/flops.py and pretrain/variants/; its loss chunks,
pretrain/model/loss.py) and a GPU's peaks, before and after the changes of issue 47:

    gate matmuls   the gate's logits (`FP32Linear`): before, 3 fp32 GEMMs per loop step off the tensor
                   cores; after, bf16 GEMMs with fp32 accumulation (1 forward + 2 x 2 backward,
                   pretrain/kernels/matmul.py)
    loss passes    the chunked loss's element-wise passes over the logits (the compiled chunk: read the
                   bf16 logits twice, write their gradient) and the weight gradient's sum over chunks:
                   before, 256 MiB chunks (13 at 16 x 1024 tokens) and a bf16 product cast and added per
                   chunk; after, chunks sized by the free memory (one on a 141 GB card), the sum in the GEMM
    host           the time the GPU idles on the host per step: before, DeepSpeed's per-step reads (the
                   bf16 overflow check drains the queue, then the optimizer step's Python launches on an
                   idle GPU) and the in-process, pageable batch copy; after, ZeRO-2 without those reads
                   (docs/gpu.md's sync list), ZeRO-3's reduce-stream drain left

Every other row is the same before and after: block and loop matmuls (bf16, tensor cores), the head's
three matmuls, attention (flash/cuDNN, causal), element-wise work (norms, GELU, residuals, the gate
update) and the optimizer (fused AdamW over fp32 master weights and moments). Matmul rows are FLOPs
over an achieved rate (EFFICIENCY x the peak), memory rows bytes over EFFICIENCY x the bandwidth, the
host row a guess. Nothing here is measured: the first GPU draw checks it (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.model import build_model
from pretrain.model.flops import count_params
from pretrain.model.loss import CHUNK_BYTES, cuda_chunk_tokens
from pretrain.model_config import ModelConfig
from pretrain.presets import get_preset
from pretrain.tools.bench.support import whole_number


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense tensor-core peak
    fp32_tflops: float  # fp32 without tensor cores (no TF32)
    tb_s: float  # memory bandwidth
    memory_gb: float


GPUS = {
    "h200": Gpu("H200 SXM", 989.0, 67.0, 4.8, 141.0),
    "h100": Gpu("H100 SXM", 989.0, 67.0, 3.35, 80.0),
}
# achieved share of the peak: d=768 GEMMs at 16K tokens, attention at head dim 64, element-wise kernels
EFFICIENCY = {"matmul": 0.65, "fp32_matmul": 0.8, "attention": 0.35, "memory": 0.8}
ENGINE_GB = 20.0  # weights, optimizer state and activations live when the loss runs (grt-small, ZeRO-2)
# per block and token, forward and backward, in units of d x 2 bytes: layer norms, residuals, GELU
# (4d wide), the attention's reshapes; per GRT loop step: its norm, SiLU, noise and the gate update
BLOCK_ELEMENTWISE, STEP_ELEMENTWISE = 60, 40
OPTIMIZER_BYTES_PER_PARAM = 48  # fused AdamW (fp32 master, grad, m, v read; 3 written; bf16 copy), norm, clip
HOST_MS = {"before": {2: 2.5, 3: 2.5}, "after": {2: 0.6, 3: 2.0}}  # guesses: docs/gpu.md's sync list


def _ms_flops(flops: float, tflops: float, kind: str) -> float:
    return 1000 * flops / (tflops * 1e12 * EFFICIENCY[kind])


def _ms_bytes(nbytes: float, gpu: Gpu) -> float:
    return 1000 * nbytes / (gpu.tb_s * 1e12 * EFFICIENCY["memory"])


def step_budget(cfg: ModelConfig, tokens: int, seq_len: int, gpu: Gpu, zero_stage: int) -> dict[str, dict[str, float]]:
    """ms per micro-batch step of `tokens` tokens: row -> {"before": ms, "after": ms}."""
    layout, d, vp = cfg.parsed_layout, cfg.d_model, cfg.padded_vocab_size
    r = layout.loops if layout.looped else 0
    blocks = layout.prelude + layout.core * r + layout.coda
    rows: dict[str, dict[str, float]] = {}

    def same(name: str, ms: float) -> None:
        rows[name] = {"before": ms, "after": ms}

    hidden = cfg.mlp_ratio * d
    block_linear = 2 * (4 * d * d + 2 * d * hidden) * 3 * tokens  # qkv, proj, MLP; forward + 2 backward
    loop_linear = 0.0
    if r:
        per_step = (2 * d * d if cfg.reinject_anchor else 0) + (2 * d * d if cfg.gate else 0)
        anchor = per_step  # the anchor halves, once per forward
        loop_linear = (r * per_step + anchor) * 3 * tokens
    same("block and loop matmuls", _ms_flops(blocks * block_linear + loop_linear, gpu.bf16_tflops, "matmul"))
    if r and cfg.gate:
        gate = r * 2 * d * d * tokens  # one GEMM's FLOPs per loop step
        rows["gate matmuls"] = {
            "before": _ms_flops(3 * gate, gpu.fp32_tflops, "fp32_matmul"),
            "after": _ms_flops(5 * gate, gpu.bf16_tflops, "matmul"),
        }
    same("head matmuls", _ms_flops(2 * d * vp * 3 * tokens, gpu.bf16_tflops, "matmul"))
    rows["loss passes"] = {k: _ms_bytes(loss_bytes(cfg, tokens, gpu, k), gpu) for k in ("before", "after")}
    causal_flash = blocks * 4 * seq_len * d * tokens * 3.5 * 0.5  # QK^T and PV; backward 2.5x; half masked
    same("attention", _ms_flops(causal_flash, gpu.bf16_tflops, "attention"))
    elementwise = (blocks * BLOCK_ELEMENTWISE + r * STEP_ELEMENTWISE) * d * 2 * tokens
    same("element-wise", _ms_bytes(elementwise, gpu))
    with torch.device("meta"):
        params = count_params(build_model(cfg))["params"]
    same("optimizer", _ms_bytes(params * OPTIMIZER_BYTES_PER_PARAM, gpu))
    rows["host (DeepSpeed, syncs, data)"] = {k: HOST_MS[k][zero_stage] for k in ("before", "after")}
    return rows


def loss_bytes(cfg: ModelConfig, tokens: int, gpu: Gpu, when: str) -> float:
    """The loss's element-wise bytes per step: the compiled chunk's passes over the logits and the
    weight gradient's traffic beyond its GEMMs (before: each chunk's bf16 product written, read and
    added into the fp32 sum; after: none, the sum in the GEMM's epilogue), then its final scale-and-cast."""
    vp, d = cfg.padded_vocab_size, cfg.d_model
    logits = 6 * vp * tokens  # the bf16 logits read twice (log-sum-exp, then the softmax), their gradient written
    if when == "before":
        chunk = max(1, CHUNK_BYTES // (4 * vp))  # the old chunk: 256 MiB of fp32 logits, any count of tokens
    else:
        free = (gpu.memory_gb - ENGINE_GB) * 1e9
        chunk = min(tokens, cuda_chunk_tokens(vp, int(free)))
    chunks = -(-tokens // chunk)
    sum_over_chunks = chunks * 12 * vp * d if when == "before" else (chunks - 1) * 8 * vp * d
    return logits + sum_over_chunks + 6 * vp * d


def budget_table(args: argparse.Namespace) -> dict[str, Any]:
    gpu, tokens = GPUS[args.gpu], args.batch * args.seq_len
    out: dict[str, Any] = {"gpu": gpu.name, "tokens": tokens, "zero_stage": args.zero_stage, "presets": {}}
    for preset in args.presets:
        rows = step_budget(get_preset(preset), tokens, args.seq_len, gpu, args.zero_stage)
        total = {k: sum(r[k] for r in rows.values()) for k in ("before", "after")}
        out["presets"][preset] = {
            "rows": rows,
            "total_ms": total,
            "tokens_per_s": {k: tokens / (v / 1000) for k, v in total.items()},
        }
    return out


def format_budget(result: dict[str, Any]) -> str:
    presets = result["presets"]
    head = " | ".join(f"{p} before | {p} after" for p in presets)
    lines = [f"ms per step | {head}", "---|" + "---:|" * (2 * len(presets))]
    names = list(next(iter(presets.values()))["rows"])
    for p in presets.values():
        names += [n for n in p["rows"] if n not in names]
    for name in names:
        cells = []
        for p in presets.values():
            row = p["rows"].get(name)
            cells += [f"{row['before']:.1f}", f"{row['after']:.1f}"] if row else ["-", "-"]
        lines.append(f"{name} | " + " | ".join(cells))
    lines.append(
        "**total** | "
        + " | ".join(f"**{p['total_ms']['before']:.1f}** | **{p['total_ms']['after']:.1f}**" for p in presets.values())
    )
    lines.append(
        "tokens/s | "
        + " | ".join(
            f"{p['tokens_per_s']['before'] / 1e3:.0f}K | {p['tokens_per_s']['after'] / 1e3:.0f}K"
            for p in presets.values()
        )
    )
    lines.append(
        f"\n{result['tokens']:,} tokens a step on one {result['gpu']}, ZeRO-{result['zero_stage']}, compiled; "
        f"achieved shares of the peaks: {', '.join(f'{k} {v:g}' for k, v in EFFICIENCY.items())} (predictions)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="grt bench budget", description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["grt-small", "dense-small"])
    p.add_argument("--batch", type=whole_number(1), default=16)
    p.add_argument("--seq-len", type=whole_number(1), default=1024)
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--zero-stage", type=int, default=2, choices=[2, 3])
    p.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    args = p.parse_args(argv)
    result = budget_table(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"# reproduce: grt bench budget {' '.join(argv)}")
    print(format_budget(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
