"""Decode benchmark (`grt bench decode`): per-token latency and memory of KV-cached decoding
for each cache strategy of a looped model and for a dense model, at several batch sizes.

For every (model, strategy, batch): prefill a random prompt, then decode `--new-tokens`
tokens greedily; latency = decode wall time / new tokens (CUDA synchronised), the median
of `--repeats` such decodes. Memory:
the cache's bytes from the formula (pretrain.infer.kv_cache.cache_bytes_formula) next to the
measured bytes (CUDA: the allocator's growth when the cache is built; CPU: the buffers'
sizes), and on CUDA the peak allocated memory while decoding (weights included).
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

from pretrain.config import ConfigError
from pretrain.infer.kv_cache import STRATEGIES, CachedDecoder, cache_bytes_formula, cache_slots
from pretrain.model import GPT, build_model


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
    return {
        "model": model.cfg.name,
        "layout": model.cfg.layout,
        "variant": model.cfg.variant,
        "strategy": strategy if model.loop is not None else "dense",
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
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "params": sum(q.numel() for q in model.parameters()),
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<14}{'strategy':<9}{'depth':>6}{'batch':>6}{'ms/token':>10}{'tok/s':>10}"
        f"{'cache MB (formula)':>20}{'cache MB (measured)':>21}{'peak MB':>9}{'vs dense':>9}"
    )
    dense = {r["batch"]: r for r in rows if r["strategy"] == "dense"}
    lines = [head]
    for r in rows:
        ref = dense.get(r["batch"])
        ratio = ""
        if ref and r["peak_memory_bytes"] and ref["peak_memory_bytes"]:
            ratio = f"{r['peak_memory_bytes'] / ref['peak_memory_bytes']:.2f}x"
        elif ref and ref["cache_bytes_formula"]:
            ratio = f"{r['cache_bytes_formula'] / ref['cache_bytes_formula']:.2f}x"
        peak = f"{r['peak_memory_bytes'] / 2**20:.0f}" if r["peak_memory_bytes"] else "-"
        lines.append(
            f"{r['model']:<14}{r['strategy']:<9}{r['depth']:>6}{r['batch']:>6}{r['ms_per_token']:>10.2f}"
            f"{r['tokens_per_s']:>10.0f}{r['cache_bytes_formula'] / 2**20:>20.2f}"
            f"{r['cache_bytes_measured'] / 2**20:>21.2f}{peak:>9}{ratio:>9}"
        )
    lines.append("vs dense: peak memory on CUDA, else cache bytes, relative to the dense model at the same batch")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from pretrain.infer.load import pick_device, pick_dtype

    p = argparse.ArgumentParser(prog="grt bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="looped model: exported dir or checkpoint (default: --preset, random weights)")
    p.add_argument("--preset", default="tiny-grt")
    p.add_argument("--dense-model", help="dense model to compare with: exported dir or checkpoint")
    p.add_argument("--dense-preset", default="tiny-dense", help="dense preset ('none' to skip)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, help="loop steps per token (default: the trained R)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed decodes per row; the median is reported")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16")
    p.add_argument("--json", nargs="?", const="-", help="print JSON (or write it to this file)")
    args = p.parse_args(argv)
    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device) or torch.float32
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        bad = [s for s in strategies if s not in STRATEGIES]
        if bad:
            raise ConfigError(f"--strategies: unknown {bad}; accepted: {', '.join(STRATEGIES)}")
        try:
            batches = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError:
            raise ConfigError(
                f"--batch-sizes {args.batch_sizes!r}: expected comma-separated integers, e.g. 1,32"
            ) from None
        if args.repeats < 1:
            raise ConfigError(f"--repeats {args.repeats}: must be at least 1")
        need = args.prompt_len + args.new_tokens
        looped = build(args.model, args.preset, device, dtype, None if args.model else max(need, 64))
        if looped.loop is None:
            raise ConfigError("--model/--preset: expected a looped model (use --dense-model for the dense one)")
        dense = None
        if args.dense_model or args.dense_preset != "none":
            dense = build(
                args.dense_model, args.dense_preset, device, dtype, None if args.dense_model else max(need, 64)
            )
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
