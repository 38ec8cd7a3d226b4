"""What `grt eval` scores besides the zero-shot tasks (pretrain/infer/evaluation/zero_shot.py), each at
every exit depth (pretrain/infer/exit_depths.py): a raw text (WikiText-2: loss, perplexity, bits
per byte over windows of the model's context) and the held-out split of one manifest or of each
source of a mixture (with the adaptive exit's table on request)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.adaptive import adaptive_table, parse_thresholds
from pretrain.infer.evaluation.scoring import (
    adaptive_sums,
    check_batches,
    check_scored,
    lm_sums,
    lm_sums_cached,
    val_batches,
)
from pretrain.model import GPT

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.tokenizer import Tokenizer
    from pretrain.infer.load import LoadedModel

LN2 = math.log(2.0)


def text_windows(n_tokens: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Windows over a token sequence of n_tokens (predicting ids[1:], n_tokens - 1 targets):
    (begin, end, first_scored) in target indices; inputs are ids[begin:end], targets
    ids[begin+1:end+1], and targets from first_scored on are scored. Every target is scored
    exactly once; with stride < window each window after the first has window - stride
    tokens of context that are not scored again."""
    stride = window if stride is None else stride
    if not 0 < stride <= window:
        raise ConfigError(f"stride={stride}: must be in 1..window ({window})")
    n_targets = n_tokens - 1
    out: list[tuple[int, int, int]] = []
    prev_end, begin = 0, 0
    while prev_end < n_targets:
        end = min(begin + window, n_targets)
        out.append((begin, end, prev_end))
        prev_end = end
        begin += stride
    return out


def text_batches(
    ids: list[int], window: int, batch_size: int, dist: Dist, stride: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    spans = dist.shard(text_windows(len(ids), window, stride))
    t = torch.tensor(ids, dtype=torch.long)
    for i in range(0, len(spans), batch_size):
        chunk = spans[i : i + batch_size]
        width = max(e - b for b, e, _ in chunk)
        inp = torch.zeros(len(chunk), width, dtype=torch.long)
        tgt = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (b, e, first) in enumerate(chunk):
            inp[row, : e - b] = t[b:e]
            tgt[row, first - b : e - b] = t[first + 1 : e + 1]
        yield {"input_ids": inp, "targets": tgt}


def text_eval(
    model: GPT,
    tok: Tokenizer,
    text: str,
    depths: list[int],
    device: torch.device,
    batch_size: int,
    dist: Dist,
    window: int | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    kv_cache: str | None = None,
    what: str = "the text",
    **fwd: Any,
) -> dict[int, dict[str, float]]:
    """Perplexity and bits per byte of a raw text, scored as one document after a separator
    (`what` names the text in the error when it holds no token to score)."""
    ids = [tok.sep_id] + tok.encode(text)
    if max_tokens is not None and len(ids) - 1 > max_tokens:
        ids = ids[: max_tokens + 1]
        text = tok.decode(ids[1:])
    n_bytes = len(text.encode("utf-8"))
    batches = text_batches(ids, window or model.cfg.max_seq_len, batch_size, dist, stride)
    if kv_cache is not None:
        sums = lm_sums_cached(model, batches, depths, device, kv_cache, dist=dist)
    else:
        sums = lm_sums(model, batches, depths, device, dist=dist, **fwd)
    check_scored(sums[0, 1].item() if depths else 0.0, what)
    out: dict[int, dict[str, float]] = {}
    for i, r in enumerate(depths):
        nll, n = sums[i].tolist()
        out[r] = {
            "loss": nll / n,
            "ppl": math.exp(nll / n),
            "bpb": nll / LN2 / n_bytes,
            "tokens": int(n),
            "bytes": n_bytes,
        }
    return out


def loss_table(sums: torch.Tensor, depths: list[int], what: str = "the batches") -> dict[int, dict[str, float]]:
    """{depth: loss, ppl, tokens} from lm_sums; no scored token is an error naming `what`."""
    check_scored(sums[0, 1].item() if depths else 0.0, what)
    out: dict[int, dict[str, float]] = {}
    for i, r in enumerate(depths):
        nll, n = sums[i].tolist()
        out[r] = {"loss": nll / n, "ppl": math.exp(nll / n), "tokens": int(n)}
    return out


# -- the held-out split ------------------------------------------------------------------------
def held_out_split(manifest: Manifest, requested: str | None) -> str:
    """The split to score: --split, else val; a missing or empty one is refused naming those there are."""
    split = requested or "val"
    if not manifest.splits.get(split):
        have = ", ".join(f"{name} ({len(shards)} shards)" for name, shards in manifest.splits.items()) or "none"
        hint = "" if requested else "; pass --split NAME to score another split (train data is not held out)"
        raise ConfigError(f"data={manifest.path!r} has no {split!r} split with shards (its splits: {have}){hint}")
    return split


def held_out(
    args: argparse.Namespace,
    loaded: LoadedModel,
    model: GPT,
    data: str,
    depths: list[int],
    device: torch.device,
    dist: Dist,
) -> dict[str, Any]:
    """The held-out split's loss at each depth ("val"), of one manifest or, for a mixture
    (`data` written name=weight:path,...), of each source that has the split ("val_by_source")
    and their mean under the mixture's weights ("val"): each source's table is the one
    `--data <its manifest>` gives. With --adaptive-exit (one manifest), the adaptive exit's table too."""
    from data_pipeline.batches import sources_of

    every = sources_of(loaded.check_data(data))  # one manifest: its one unnamed source
    seed = loaded.run_config.get("train", {}).get("seed", 1234)
    if args.adaptive_exit and every[0].name:
        raise ConfigError("--adaptive-exit scores one manifest: pass --data <manifest.json>, not a mixture")
    wanted = args.split or "val"
    # as in training: a mixture's sources that have the split (one manifest's is refused below, naming its splits)
    sources = [(s.name, s.weight, s.manifest) for s in every if not s.name or s.manifest.splits.get(wanted)]
    if not sources:
        held_out_split(every[0].manifest, args.split)  # refused, naming the splits there are
    tables: dict[str, dict[int, dict[str, float]]] = {}
    for name, _, manifest in sources:
        split = held_out_split(manifest, args.split)
        check_batches(manifest, split, args.batch_size, dist.world)
        batches = val_batches(manifest.path, args.batch_size, dist, args.max_batches, seed, split)
        if args.kv_cache is not None:
            sums = lm_sums_cached(model, batches, depths, device, args.kv_cache, dist=dist)
        else:
            sums = lm_sums(model, batches, depths, device, doc_mask=args.doc_mask, dist=dist)
        tables[name] = loss_table(sums, depths, f"data={manifest.path!r} split {split!r}")
    out: dict[str, Any] = {"val_manifest": str(data), "val_split": split}
    if len(sources) == 1 and not sources[0][0]:
        out["val"] = tables[""]
    else:
        total = sum(w for _, w, _ in sources)
        mean = {r: sum(w * tables[n][r]["loss"] for n, w, _ in sources) / total for r in depths}
        out["val"] = {
            r: {"loss": mean[r], "ppl": math.exp(mean[r]), "tokens": sum(t[r]["tokens"] for t in tables.values())}
            for r in depths
        }
        out["val_by_source"] = tables
    if args.adaptive_exit:
        thresholds = parse_thresholds(args.exit_thresholds)
        batches = val_batches(data, args.batch_size, dist, args.max_batches, seed, split)
        out["adaptive_exit"] = {
            "criterion": args.adaptive_exit,
            "max_steps": max(depths),
            "by_threshold": adaptive_table(
                adaptive_sums(
                    model,
                    batches,
                    thresholds,
                    device,
                    args.adaptive_exit,
                    max(depths),
                    dist=dist,
                    doc_mask=args.doc_mask,
                ),
                thresholds,
            ),
        }
    return out
