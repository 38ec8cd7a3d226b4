"""`grt generate`: sample text from a trained model with a KV cache.

Sampling: greedy (or temperature 0), temperature, top-k, top-p (nucleus). For a GRT the
exit depth (loop steps per token, `--depth`) and the KV-cache strategy for the looped core
(`--kv-cache full|first|last|average`, see pretrain.infer.kv_cache) are chosen at decode;
`--no-cache` recomputes the whole sequence for every token (the reference).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import TYPE_CHECKING, Literal, overload

import torch

from grt_common.errors import ConfigError
from pretrain.infer.adaptive import CRITERIA
from pretrain.infer.kv_cache import STRATEGIES, CachedDecoder
from pretrain.model import GPT

if TYPE_CHECKING:
    from data_pipeline.tokenizer import Tokenizer


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose
    probability reaches top_p (the most likely token is always kept). logits [B, V]."""
    logits = logits.clone()
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]."""
    if greedy or temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@overload
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    strategy: str = "full",
    n_loops: int | None = None,
    use_cache: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | None = None,
    stop_id: int | None = None,
    return_logits: Literal[False] = False,
    exit_threshold: float | None = None,
    exit_rule: str = "update",
    stats: dict[str, float] | None = None,
) -> torch.Tensor: ...


@overload
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    strategy: str = "full",
    n_loops: int | None = None,
    use_cache: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | None = None,
    stop_id: int | None = None,
    return_logits: Literal[True],
    exit_threshold: float | None = None,
    exit_rule: str = "update",
    stats: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    strategy: str = "full",
    n_loops: int | None = None,
    use_cache: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | None = None,
    stop_id: int | None = None,
    return_logits: bool = False,
    exit_threshold: float | None = None,
    exit_rule: str = "update",
    stats: dict[str, float] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Continue prompts idx [B, T] by up to max_new_tokens (capped by the context).
    Returns new tokens [B, n] (and the logits [B, n, V] that chose them when asked).
    exit_threshold, exit_rule: per-token adaptive exit of the looped core at decode by the rule
    `update` or `kl` (needs the cache; CachedDecoder); `stats`, when given, receives the mean
    loop steps per decoded token."""
    model.eval()
    b, t = idx.shape
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if t > model.cfg.max_seq_len:
        raise ConfigError(f"prompt of {t} tokens exceeds the context of {model.cfg.max_seq_len}")
    max_new_tokens = min(max_new_tokens, model.cfg.max_seq_len - t)
    gen = torch.Generator(device=idx.device).manual_seed(seed) if seed is not None else None
    out: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    done = torch.zeros(b, dtype=torch.bool, device=idx.device)
    if exit_threshold is not None and not use_cache:
        raise ConfigError("adaptive exit at decode runs through the KV cache: drop --no-cache")
    if use_cache:
        decoder = CachedDecoder(
            model,
            batch=b,
            max_len=t + max_new_tokens,
            strategy=strategy,
            n_loops=n_loops,
            exit_threshold=exit_threshold,
            exit_rule=exit_rule,
        )
        logits = decoder.forward(idx)
    seq = idx
    for i in range(max_new_tokens):
        if not use_cache:
            logits = model(seq, n_loops=n_loops).logits[:, -1]
        nxt = sample_next(logits, temperature, top_k, top_p, greedy, gen)
        if stop_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, stop_id), nxt)
            done |= nxt == stop_id
        out.append(nxt)
        if return_logits:
            all_logits.append(logits.float())
        if stop_id is not None and bool(done.all()):
            break
        if i + 1 < max_new_tokens:
            if use_cache:
                logits = decoder.forward(nxt[:, None])
            else:
                seq = torch.cat([seq, nxt[:, None]], dim=1)
    tokens = torch.stack(out, dim=1) if out else idx.new_zeros(b, 0)
    if stats is not None and exit_threshold is not None:
        stats["mean_loop_steps"] = decoder.decoded_steps / max(decoder.decoded_tokens, 1)
    if return_logits:
        return tokens, (torch.stack(all_logits, dim=1) if all_logits else None)
    return tokens


def render(tok: Tokenizer, ids: list[int], stop_at_separator: bool = False, separator: str = "\n\n") -> str:
    """Decoded text; the document separator (which decodes to nothing) becomes a blank line,
    or ends the text with stop_at_separator."""
    if stop_at_separator and tok.sep_id in ids:
        ids = ids[: ids.index(tok.sep_id)]
    parts: list[list[int]] = []
    cur: list[int] = []
    for i in ids:
        if i == tok.sep_id:
            parts.append(cur)
            cur = []
        else:
            cur.append(i)
    parts.append(cur)
    return separator.join(tok.decode(p) for p in parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grt generate", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="exported dir (grt export), run dir, <out>/checkpoints or a step dir")
    p.add_argument("--prompt", default="", help="prompt text (default: empty, start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--num-samples", type=int, default=1, help="samples of the prompt, decoded as one batch")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth", type=int, help="loop steps per token (default: the trained R)")
    p.add_argument("--allow-beyond-trained", action="store_true", help="allow --depth above the trained R")
    p.add_argument("--kv-cache", default="full", choices=STRATEGIES, help="KV-cache strategy for the looped core")
    p.add_argument(
        "--exit-threshold",
        type=float,
        help="per-token adaptive exit: a token stops looping once its change (--exit-rule) is below "
        "this (pretrain/infer/adaptive.py); prints the mean loop steps used",
    )
    p.add_argument(
        "--exit-rule",
        default="update",
        choices=CRITERIA,
        help="adaptive exit's change: update (the state's relative update) or kl (KL between successive "
        "steps' next-token distributions; decodes every step through the coda)",
    )
    p.add_argument("--no-cache", action="store_true", help="recompute the sequence for every token")
    p.add_argument("--stop-at-separator", action="store_true", help="stop a sample at the document separator")
    p.add_argument("--tokenizer", help="tokenizer.model (default: the one next to the model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a CUDA GPU, else the stored dtype), fp32, bf16, fp16")
    p.add_argument("--json", action="store_true", help="print JSON (samples, tokens, timing)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The sampling flags, before the model is loaded: one line naming the flag and what is accepted."""
    checks = (
        (args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens}: must be >= 1 (tokens to generate)"),
        (args.num_samples >= 1, f"--num-samples {args.num_samples}: must be >= 1"),
        (
            math.isfinite(args.temperature) and args.temperature >= 0,
            f"--temperature {args.temperature}: must be >= 0 (0 = greedy)",
        ),
        (args.top_k is None or args.top_k >= 0, f"--top-k {args.top_k}: must be >= 0 (0 = no top-k filter)"),
        (
            args.top_p is None or 0 < args.top_p <= 1,
            f"--top-p {args.top_p}: must be in (0, 1] (1 = no nucleus filter)",
        ),
        (args.depth is None or args.depth >= 0, f"--depth {args.depth}: must be >= 0 (loop steps per token)"),
        (
            args.exit_threshold is None or (math.isfinite(args.exit_threshold) and args.exit_threshold >= 0),
            f"--exit-threshold {args.exit_threshold}: must be >= 0",
        ),
        (args.seed >= 0, f"--seed {args.seed}: must be >= 0"),
    )
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def main(argv: list[str] | None = None) -> int:
    from pretrain.infer.exit_depths import check_depths
    from pretrain.infer.load import load_model, pick_device, pick_dtype

    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        device = pick_device(args.device)
        loaded = load_model(args.model, device=device, dtype=pick_dtype(args.dtype, device), tokenizer=args.tokenizer)
        model, tok = loaded.model, loaded.tokenizer()
        depth = None
        if args.depth is not None:
            depth = check_depths(model, [args.depth], args.allow_beyond_trained)[0] if model.loop is not None else None
        ids = [tok.sep_id] + tok.encode(args.prompt)
        if len(ids) >= model.cfg.max_seq_len:
            raise ConfigError(
                f"--prompt of {len(ids)} tokens (with the document separator) fills the model's context of "
                f"{model.cfg.max_seq_len}: no token can be generated; shorten the prompt"
            )
        idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
        t0 = time.time()
        stats: dict[str, float] = {}
        tokens = generate(
            model,
            idx,
            args.max_new_tokens,
            strategy=args.kv_cache,
            n_loops=depth,
            use_cache=not args.no_cache,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            greedy=args.greedy,
            seed=args.seed,
            stop_id=tok.sep_id if args.stop_at_separator else None,
            exit_threshold=args.exit_threshold,
            exit_rule=args.exit_rule,
            stats=stats,
        )
        seconds = time.time() - t0
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"grt generate: error: {err}", file=sys.stderr)
        return 2
    samples = [args.prompt + render(tok, row, args.stop_at_separator) for row in tokens.tolist()]
    if args.json:
        print(
            json.dumps(
                {
                    "samples": samples,
                    "tokens": tokens.tolist(),
                    "seconds": seconds,
                    "depth": depth if depth is not None else (model.max_loops if model.loop is not None else 0),
                    "kv_cache": "none" if args.no_cache else args.kv_cache,
                    **stats,
                },
                indent=2,
            )
        )
    else:
        for i, text in enumerate(samples):
            if len(samples) > 1:
                print(f"--- sample {i + 1}")
            print(text)
        n = tokens.numel()
        steps = f", {stats['mean_loop_steps']:.2f} loop steps per token" if stats else ""
        print(
            f"[{n} tokens in {seconds:.2f}s, {1000 * seconds / max(tokens.shape[1], 1):.1f} ms/step{steps}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
