"""Scoring helpers shared by `grt eval`, the zero-shot tasks and `grt analyze` (a library: no
command line here, so that the commands import it and never each other).

One forward pass per batch runs the loop to the deepest requested depth and keeps every
state s_0..s_n; each exit depth r decodes s_r with the model's own tail (`GPT.final_hidden`
then `GPT.head`), which is the function `model(idx, n_loops=r)` computes (tested).

Sums are kept on the model's device and copied to the host once per call. A `dist` (any
object with rank, world and shard, e.g. pretrain.distributed.Dist) shards
and sums over ranks (`sum_over_ranks`, once per call, after the ranks agreed that none
failed); None is one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from grt_common.errors import ConfigError
from pretrain.distributed import Dist, all_reduce, check_ranks, comm_device
from pretrain.infer.adaptive import adaptive_forward
from pretrain.infer.kv_cache import CachedDecoder
from pretrain.model import GPT
from pretrain.model.layers import AttentionContext
from pretrain.model.loss import IGNORE_INDEX, is_scored, scored_tokens

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest

Batch = dict[str, torch.Tensor]  # input_ids, targets (-100 = not scored), optional doc_ids
# forward(idx, doc_ids) -> (logits, loop steps per token): a per-token exit (exit_sums)
ExitForward = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def exit_hidden(
    model: GPT,
    idx: torch.Tensor,
    depths: Iterable[int],
    doc_ids: torch.Tensor | None = None,
    gate_override: float | None = None,
    anchor: str = "prelude",
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (depth, final-norm hidden [B, T, d]) for each depth from one pass through the loop."""
    depths = list(depths)
    ctx = AttentionContext(doc_ids=doc_ids)
    if model.loop is None:  # a dense model: depth k exits after its first k blocks (GPT.dense_exit), 0 = all
        blocks = {r: model.dense_exit(r) or len(model.prelude) for r in depths}  # checks each depth
        x, after = model.embed(idx), dict[int, torch.Tensor]()
        for k, block in enumerate(model.prelude[: max(blocks.values(), default=0)], 1):
            x = block(x, ctx)
            if k in blocks.values():
                after[k] = x
        states: dict[int, torch.Tensor] | list[torch.Tensor] = {r: after[k] for r, k in blocks.items()}
    else:
        states = model(
            idx, n_loops=max(depths), doc_ids=doc_ids, gate_override=gate_override, anchor=anchor, return_states=True
        ).states
    for r in depths:
        yield r, model.final_hidden(states[r], ctx)


@torch.no_grad()
def exit_logits(model: GPT, idx: torch.Tensor, depths: Iterable[int], **kw: Any) -> dict[int, torch.Tensor]:
    return {r: model.head(h) for r, h in exit_hidden(model, idx, depths, **kw)}


def sum_over_ranks(sums: torch.Tensor, dist: Dist | None) -> torch.Tensor:
    """Summed over the ranks of a sharded evaluation (dist given), on the host. With more than
    one rank, the ranks first agree that none failed (`check_ranks`: a rank whose own part of
    the work raised calls it with its error instead), so a failure stops every rank at once,
    naming the failing rank, rather than leaving the others waiting in the sum."""
    if dist is None:
        return sums.cpu()
    if dist.world > 1:
        check_ranks()
    return all_reduce(sums.to(comm_device())).cpu()


@torch.no_grad()
def lm_sums(
    model: GPT,
    batches: Iterable[Batch],
    depths: list[int],
    device: torch.device,
    doc_mask: bool = False,
    dist: Dist | None = None,
    **fwd: Any,
) -> torch.Tensor:
    """[len(depths), 2] on the CPU: summed NLL (nats) and scored-token count per depth, summed
    over ranks. Each batch: input_ids, targets (-100 = not scored), optional doc_ids."""
    sums = torch.zeros(len(depths), 2, dtype=torch.float64, device=device)
    for batch in batches:
        idx = batch["input_ids"].to(device)
        targets = batch["targets"].to(device)
        doc_ids = batch["doc_ids"].to(device) if doc_mask and "doc_ids" in batch else None
        sums[:, 1] += scored_tokens(targets)
        for i, (_, h) in enumerate(exit_hidden(model, idx, depths, doc_ids=doc_ids, **fwd)):
            logits = model.head(h).float()
            sums[i, 0] += F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
    return sum_over_ranks(sums, dist)


@torch.no_grad()
def lm_sums_cached(
    model: GPT,
    batches: Iterable[Batch],
    depths: list[int],
    device: torch.device,
    strategy: str,
    dist: Dist | None = None,
) -> torch.Tensor:
    """As lm_sums, but every token is decoded one at a time through the KV cache with the given
    strategy (the first token is the prompt): what a shared cache costs in loss. `full` gives
    lm_sums' numbers (tested). No document mask."""
    sums = torch.zeros(len(depths), 2, dtype=torch.float64, device=device)
    for batch in batches:
        idx = batch["input_ids"].to(device)
        targets = batch["targets"].to(device)
        b, t = idx.shape
        sums[:, 1] += scored_tokens(targets)
        for i, r in enumerate(depths):
            dec = CachedDecoder(
                model, batch=b, max_len=t, strategy=strategy, n_loops=r if model.loop is not None else None
            )
            for pos in range(t):
                logits = dec.forward(idx[:, pos : pos + 1]).float()
                sums[i, 0] += F.cross_entropy(logits, targets[:, pos], ignore_index=IGNORE_INDEX, reduction="sum")
    return sum_over_ranks(sums, dist)


def val_batches(
    manifest: str,
    batch_size: int,
    dist: Dist | None = None,
    max_batches: int | None = None,
    seed: int = 1234,
    split: str = "val",
) -> Iterator[Batch]:
    """Batches of a manifest's split (this rank's share when dist is given), in a fixed order."""
    from data_pipeline.loader import TokenBatchLoader

    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    loader = TokenBatchLoader(
        manifest,
        split=split,
        micro_batch_size=batch_size,
        rank=rank,
        world_size=world,
        num_workers=0,
        seed=seed,
        shuffle_buffer=0,
        loop=False,
    )
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        yield batch


def check_batches(manifest: Manifest, split: str, batch_size: int, world: int = 1) -> None:
    """Refuse a split that gives this evaluation no batch: the loader only makes whole batches of
    `batch_size` per rank, and a loss over nothing would print as 0 (perplexity 1)."""
    if not manifest.splits.get(split):
        have = ", ".join(f"{name} ({len(shards)} shards)" for name, shards in manifest.splits.items()) or "none"
        raise ConfigError(f"data={manifest.path!r} has no {split!r} split with shards (its splits: {have})")
    n = manifest.sequences(split)
    if n < batch_size * world:
        ranks = f" on each of {world} ranks" if world > 1 else ""
        raise ConfigError(
            f"data={manifest.path!r} split {split!r}: {n} sequences, fewer than one batch of --batch-size "
            f"{batch_size}{ranks}: nothing to score; pass a smaller --batch-size or a larger split"
        )


def check_scored(tokens: float, what: str) -> None:
    """Refuse a result computed over no token (summed over the ranks): an error, not a loss of 0."""
    if not tokens > 0:
        raise ConfigError(f"{what}: no token was scored, so there is no loss to report")


def jsonable(obj: Any) -> Any:
    """Dicts with non-string keys (depths) as JSON-ready objects."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


@torch.no_grad()
def adaptive_sums(
    model: GPT,
    batches: Iterable[Batch],
    thresholds: list[float],
    device: torch.device,
    criterion: str = "update",
    max_steps: int | None = None,
    dist: Dist | None = None,
    doc_mask: bool = False,
) -> torch.Tensor:
    """exit_sums of per-token adaptive exit, one row per threshold."""

    def at(thr: float) -> ExitForward:
        return lambda idx, doc_ids: adaptive_forward(model, idx, thr, criterion, max_steps, doc_ids)

    forwards = [at(thr) for thr in thresholds]
    return exit_sums(forwards, batches, device, dist, doc_mask)


@torch.no_grad()
def exit_sums(
    forwards: list[ExitForward],
    batches: Iterable[Batch],
    device: torch.device,
    dist: Dist | None = None,
    doc_mask: bool = False,
) -> torch.Tensor:
    """[len(forwards), 3] on the CPU: summed NLL, scored tokens and summed loop steps of the
    scored tokens of every per-token exit (adaptive, Ouro's learned), one row per
    forward(idx, doc_ids) -> (logits, loop steps per token), summed over ranks (doc_mask:
    attend within documents, as lm_sums)."""
    sums = torch.zeros(len(forwards), 3, dtype=torch.float64, device=device)
    for batch in batches:
        idx, targets = batch["input_ids"].to(device), batch["targets"].to(device)
        doc_ids = batch["doc_ids"].to(device) if doc_mask and "doc_ids" in batch else None
        scored, n = is_scored(targets), scored_tokens(targets)
        for row, forward in zip(sums, forwards):
            logits, steps = forward(idx, doc_ids)
            row[0] += F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            row[1] += n
            row[2] += (steps * scored).sum()  # not steps[scored]: a boolean index waits for the device (nonzero)
    return sum_over_ranks(sums, dist)
