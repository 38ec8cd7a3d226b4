"""Decode benchmark (`grt bench decode`): per-token latency and memory of KV-cached decoding
for each cache strategy of a looped model and for a dense model, at several batch sizes.

For every (model, strategy, batch): prefill a random prompt, then decode `--new-tokens`
tokens greedily; latency = decode wall time / new tokens (CUDA synchronised), the median
of `--repeats` such decodes. `--compile`: both models' blocks and loop step under
torch.compile (`compile_for_decode`), as the paper's latency is measured. Memory:
the cache's bytes from the formula (pretrain.infer.kv_cache.cache_bytes_formula) next to the
measured bytes (CUDA: the allocator's growth when the cache is built; CPU: the buffers'
sizes); the total, weights plus cache, and its ratio to the dense model at the same batch
(what the paper's 0.55x / 0.91x / 0.39x are); on CUDA the peak allocated memory while
decoding (weights and activations included). Below the table, the same totals from the
formulas for grt-medium against dense-medium (bf16, 1,024 tokens), beside the paper's ratios.
Models: an exported dir / checkpoint (`--model`, `--dense-model`) or a preset with random
weights (`--preset`, `--dense-preset`): latency and memory do not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from grt_common.errors import ConfigError
from grt_common.files import output_path
from pretrain.infer.kv_cache import (
    STRATEGIES,
    CachedDecoder,
    cache_bytes_formula,
    cache_slots,
    cache_strategy,
    compile_for_decode,
    is_compiled,
)
from pretrain.model import GPT, build_model
from pretrain.model_config import ModelConfig
from pretrain.tools.bench.support import whole_number, whole_numbers

# the paper's total decode memory (weights + cache) of GRT-Medium against dense GPT-2 Medium
# (spec section 5): (batch, strategy) -> ratio
PAPER_MEMORY_RATIOS = {(1, "full"): 0.55, (32, "full"): 0.91, (32, "average"): 0.39}


def build(
    path: str | None, preset: str, device: torch.device, dtype: torch.dtype | None, max_seq_len: int | None = None
) -> GPT:
    if path:
        from pretrain.infer.load import load_model

        return load_model(path, device=device, dtype=dtype).model
    from pretrain.presets import get_preset

    cfg = get_preset(preset)
    if max_seq_len:
        cfg = cfg.replace(max_seq_len=max_seq_len)
    with torch.device(device):
        model = build_model(cfg)
    return model.to(dtype or torch.float32).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bench_one(
    model: GPT,
    strategy: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    depth: int | None,
    warmup: int = 2,
    seed: int = 0,
    repeats: int = 3,
) -> dict[str, Any]:
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    n = 0 if model.loop is None else (model.max_loops if depth is None else depth)
    max_len = prompt_len + new_tokens
    if max_len > model.cfg.max_seq_len:
        raise ConfigError(
            f"prompt {prompt_len} + new tokens {new_tokens} exceed the context of {model.cfg.max_seq_len}"
        )
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    for _ in range(warmup):  # kernels, allocator
        d = CachedDecoder(model, batch, max_len, strategy, n)
        logits = d.forward(prompt)
        for _ in range(min(4, new_tokens)):
            logits = d.forward(logits.argmax(-1)[:, None])
        del d
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    prefill: list[float] = []
    per_token: list[float] = []
    for i in range(repeats):  # the median repeat: one burst of other work on the host does not decide the figure
        decoder = CachedDecoder(model, batch, max_len, strategy, n)
        if i == 0:
            measured = (torch.cuda.memory_allocated(device) - before) if cuda else decoder.cache.nbytes
        t0 = time.perf_counter()
        logits = decoder.forward(prompt)
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            logits = decoder.forward(logits.argmax(-1)[:, None])
        _sync(device)
        prefill.append(t1 - t0)
        per_token.append((time.perf_counter() - t1) / new_tokens)
        del decoder
    prefill_s, token_s = statistics.median(prefill), statistics.median(per_token)
    weights = weights_bytes(model)
    return {
        "model": model.cfg.name,
        "layout": model.cfg.layout,
        "variant": model.cfg.variant,
        "strategy": cache_strategy(model, strategy) if model.loop is not None else "dense",
        "depth": n,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "prefill_ms": 1000 * prefill_s,
        "ms_per_token": 1000 * token_s,
        "tokens_per_s": batch / token_s,
        "repeats": repeats,
        "cache_slots": cache_slots(model, strategy, n),
        "cache_bytes_formula": cache_bytes_formula(model, strategy, n, batch, max_len, dtype),
        "cache_bytes_measured": int(measured),
        "weights_bytes": weights,
        "total_bytes": weights + int(measured),
        "compiled": is_compiled(model),
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "params": sum(q.numel() for q in model.parameters()),
    }


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (a tied head once) and buffers."""
    params = {id(p): p for p in model.parameters()}
    return sum(p.nbytes for p in params.values()) + sum(b.nbytes for b in model.buffers())


def total_bytes_formula(cfg: ModelConfig, strategy: str, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """Weights plus cache of a preset, from the formulas (the model built on the meta device)."""
    with torch.device("meta"):
        model = build_model(cfg).to(dtype)
    n = 0 if model.loop is None else model.max_loops
    return weights_bytes(model) + cache_bytes_formula(model, strategy, n, batch, max_len, dtype)


def paper_memory_ratios(
    looped: str = "grt-medium", dense: str = "dense-medium", dtype: torch.dtype = torch.bfloat16
) -> list[dict[str, Any]]:
    """Total decode memory (weights + a cache of max_seq_len tokens) of a looped preset against a
    dense one at batch 1 and 32 for every strategy, from the formulas, with the paper's ratio
    where it gives one (PAPER_MEMORY_RATIOS)."""
    from pretrain.presets import get_preset

    lcfg, dcfg = get_preset(looped), get_preset(dense)
    rows = []
    for batch in (1, 32):
        ref = total_bytes_formula(dcfg, "full", batch, dcfg.max_seq_len, dtype)
        for strategy in STRATEGIES:
            total = total_bytes_formula(lcfg, strategy, batch, lcfg.max_seq_len, dtype)
            rows.append(
                {
                    "batch": batch,
                    "strategy": strategy,
                    "total_bytes": total,
                    "dense_total_bytes": ref,
                    "ratio": total / ref,
                    "paper": PAPER_MEMORY_RATIOS.get((batch, strategy)),
                }
            )
    return rows


def format_paper_ratios(rows: list[dict[str, Any]], looped: str = "grt-medium", dense: str = "dense-medium") -> str:
    lines = [
        f"total memory (weights + cache of 1,024 tokens, bf16) of {looped} against {dense}, from the formulas:",
        f"{'batch':>6}{'strategy':>10}{'total MB':>10}{'dense MB':>10}{'ratio':>8}{'paper':>8}",
    ]
    for r in rows:
        paper = f"{r['paper']:.2f}x" if r["paper"] is not None else "-"
        lines.append(
            f"{r['batch']:>6}{r['strategy']:>10}{r['total_bytes'] / 2**20:>10.0f}"
            f"{r['dense_total_bytes'] / 2**20:>10.0f}{r['ratio']:>7.2f}x{paper:>8}"
        )
    return "\n".join(lines)


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<20}{'strategy':<9}{'depth':>6}{'batch':>6}{'ms/token':>10}{'tok/s':>10}{'weights MB':>11}"
        f"{'cache MB (formula)':>19}{'(measured)':>11}{'total MB':>9}{'vs dense':>9}{'peak MB':>9}{'vs dense':>9}"
    )
    dense = {r["batch"]: r for r in rows if r["strategy"] == "dense"}
    lines = [head]
    for r in rows:
        ref = dense.get(r["batch"])
        total_ratio = f"{r['total_bytes'] / ref['total_bytes']:.2f}x" if ref else ""
        peak_ratio = ""
        if ref and r["peak_memory_bytes"] and ref["peak_memory_bytes"]:
            peak_ratio = f"{r['peak_memory_bytes'] / ref['peak_memory_bytes']:.2f}x"
        peak = f"{r['peak_memory_bytes'] / 2**20:.0f}" if r["peak_memory_bytes"] else "-"
        lines.append(
            f"{r['model']:<20}{r['strategy']:<9}{r['depth']:>6}{r['batch']:>6}{r['ms_per_token']:>10.2f}"
            f"{r['tokens_per_s']:>10.0f}{r['weights_bytes'] / 2**20:>11.2f}{r['cache_bytes_formula'] / 2**20:>19.2f}"
            f"{r['cache_bytes_measured'] / 2**20:>11.2f}{r['total_bytes'] / 2**20:>9.2f}{total_ratio:>9}"
            f"{peak:>9}{peak_ratio:>9}"
        )
    compiled = "torch.compile" if rows and rows[0]["compiled"] else "eager"
    lines.append(
        f"{compiled}; total: weights + cache (measured); vs dense: relative to the dense model at the same batch; "
        "peak: CUDA's peak allocated memory while decoding"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from pretrain.infer.load import pick_device, pick_dtype

    p = argparse.ArgumentParser(prog="grt bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="looped model: exported dir or checkpoint (default: --preset, random weights)")
    p.add_argument("--preset", default="tiny-grt")
    p.add_argument("--dense-model", help="dense model to compare with: exported dir or checkpoint")
    p.add_argument("--dense-preset", default="tiny-dense", help="dense preset ('none' to skip)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--batch-sizes", type=whole_numbers(1), default=[1, 32], help="comma-separated, e.g. 1,32")
    p.add_argument("--prompt-len", type=whole_number(1), default=32)
    p.add_argument("--new-tokens", type=whole_number(1), default=64)
    p.add_argument("--depth", type=whole_number(0), help="loop steps per token (default: the trained R)")
    p.add_argument("--warmup", type=whole_number(0), default=2)
    p.add_argument("--repeats", type=whole_number(1), default=3, help="timed decodes per row; the median is reported")
    p.add_argument("--compile", action="store_true", help="decode under torch.compile (blocks and loop step)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        type=lambda text: text if text == "-" else output_path(is_dir=False)(text),
        help="print JSON (or write it to this file)",
    )
    args = p.parse_args(argv)
    try:
        device = pick_device(args.device)  # ConfigError for a bad --device
        dtype = pick_dtype(args.dtype, device) or torch.float32
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        bad = [s for s in strategies if s not in STRATEGIES]
        if bad or not strategies:
            raise ConfigError(f"--strategies: unknown {bad or 'none given'}; accepted: {', '.join(STRATEGIES)}")
        batches = args.batch_sizes
        need = args.prompt_len + args.new_tokens
        looped = build(args.model, args.preset, device, dtype, None if args.model else max(need, 64))
        if looped.loop is None:
            raise ConfigError("--model/--preset: expected a looped model (use --dense-model for the dense one)")
        dense = None
        if args.dense_model or args.dense_preset != "none":
            dense = build(
                args.dense_model, args.dense_preset, device, dtype, None if args.dense_model else max(need, 64)
            )
        if args.compile:
            for model in (looped, dense):
                if model is not None:
                    compile_for_decode(model)
        if cache_strategy(looped, strategies[0]) == "anchor":  # one exact cache, whichever strategy
            strategies = strategies[:1]
        rows: list[dict[str, Any]] = []
        for b in batches:
            if dense is not None:
                rows.append(
                    bench_one(
                        dense, "full", b, args.prompt_len, args.new_tokens, None, args.warmup, repeats=args.repeats
                    )
                )
            for s in strategies:
                rows.append(
                    bench_one(
                        looped, s, b, args.prompt_len, args.new_tokens, args.depth, args.warmup, repeats=args.repeats
                    )
                )
    except (ConfigError, FileNotFoundError) as err:
        print(f"grt bench decode: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        text = json.dumps(rows, indent=2)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(format_rows(rows))
    print()
    print(format_paper_ratios(paper_memory_ratios()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
