"""Zero-shot tasks scored by continuation log-likelihood, at any exit depth.

Each item is a list of (context, continuation) requests. A request is tokenized as
[separator] + encode(context) + encode(continuation) (the separator plays BOS), cut
from the left to the model's context, and scored as the sum of the continuation
tokens' log-probabilities; "greedy" is whether every continuation token is the argmax.

- LAMBADA (OpenAI): context -> " " + last word; acc = greedy match, ppl = exp(-sum ll / tokens).
- HellaSwag: "<activity_label>: <ctx>" -> " " + ending.
- PIQA, ARC-Easy, ARC-Challenge: "<query>\\nAnswer:" (the harness' prompt; the files'
  query is "Question: ...") -> " " + choice.
- WinoGrande (partial scoring): each option's context -> " " + the shared continuation.
Multiple choice: acc = argmax of the summed log-likelihood; acc_norm = argmax of the
log-likelihood divided by the continuation's length in characters.

With a KV-cache strategy (`grt eval --kv-cache average`), the continuation is decoded token
by token through the cache instead of in one forward, which measures what the looped
core's shared caches (first/last/average) cost in accuracy; `full` is exact.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.evaluation.scoring import exit_hidden, sum_over_ranks
from pretrain.infer.kv_cache import CachedDecoder
from pretrain.model import GPT
from pretrain.runs.eval_tasks import Item

if TYPE_CHECKING:
    from data_pipeline.tokenizer import Tokenizer


def encode_request(tok: Tokenizer, context: str, continuation: str, max_len: int) -> tuple[list[int], int]:
    """Token ids (context + continuation, at most max_len + 1, cut from the left) and the
    number of continuation tokens (the last ones)."""
    ctx = [tok.sep_id] + tok.encode(context)
    cont = tok.encode(continuation)
    full = (ctx + cont)[-(max_len + 1) :]
    return full, min(len(cont), len(full) - 1)


@torch.no_grad()
def score_requests(
    model: GPT,
    encoded: list[tuple[list[int], int]],
    depths: list[int],
    device: torch.device,
    batch_size: int = 8,
    **fwd: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loglik [N, D] float64, greedy [N, D] bool) for encoded requests at each depth, on the
    host. Kept on the model's device until the end: one copy to the host per call."""
    n, nd = len(encoded), len(depths)
    ll = torch.zeros(n, nd, dtype=torch.float64, device=device)
    greedy = torch.zeros(n, nd, dtype=torch.bool, device=device)
    order = sorted(range(n), key=lambda i: -len(encoded[i][0]))  # similar lengths together (stable: ties keep order)
    for start in range(0, n, batch_size):
        chunk = order[start : start + batch_size]
        chunk_t = torch.tensor(chunk, device=device)
        width = max(len(encoded[i][0]) - 1 for i in chunk)
        inp = torch.zeros(len(chunk), width, dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        tgts: list[int] = []
        owner: list[int] = []
        for row, i in enumerate(chunk):
            ids, n_cont = encoded[i]
            t = len(ids) - 1
            inp[row, :t] = torch.tensor(ids[:-1])
            for p in range(t - n_cont, t):
                rows.append(row)
                cols.append(p)
                tgts.append(ids[p + 1])
                owner.append(row)
        rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        tgt = torch.tensor(tgts, device=device)
        own = torch.tensor(owner, device=device)
        for j, (_, h) in enumerate(exit_hidden(model, inp.to(device), depths, **fwd)):
            logp = F.log_softmax(model.head(h[rows_t, cols_t]).float(), dim=-1)
            tok_ll = logp.gather(1, tgt[:, None]).squeeze(1).double()
            hit = (logp.argmax(-1) == tgt).float()
            sum_ll = torch.zeros(len(chunk), dtype=torch.float64, device=device).index_add_(0, own, tok_ll)
            misses = torch.zeros(len(chunk), device=device).index_add_(0, own, 1 - hit)
            ll[chunk_t, j] = sum_ll
            greedy[chunk_t, j] = misses == 0
    return ll.cpu(), greedy.cpu()


@torch.no_grad()
def score_requests_cached(
    model: GPT, encoded: list[tuple[list[int], int]], depths: list[int], device: torch.device, strategy: str = "full"
) -> tuple[torch.Tensor, torch.Tensor]:
    """As score_requests, but the continuation is decoded token by token through the KV cache
    with the given strategy (pretrain.infer.kv_cache): the context is prefilled, then each
    continuation token is fed back. `full` gives score_requests' numbers; the shared
    strategies measure what their approximation costs. One request at a time."""
    ll = torch.zeros(len(encoded), len(depths), dtype=torch.float64)
    greedy = torch.zeros(len(encoded), len(depths), dtype=torch.bool)
    for i, (ids, n_cont) in enumerate(encoded):
        ctx_len = len(ids) - n_cont
        for j, r in enumerate(depths):
            dec = CachedDecoder(
                model, batch=1, max_len=len(ids) - 1, strategy=strategy, n_loops=r if model.loop is not None else None
            )
            logits = dec.forward(torch.tensor([ids[:ctx_len]], device=device))
            total, hit = 0.0, True
            for k in range(n_cont):
                target = ids[ctx_len + k]
                logp = F.log_softmax(logits[0].float(), dim=-1)
                total += logp[target].item()
                hit = hit and int(logp.argmax()) == target
                if k + 1 < n_cont:
                    logits = dec.forward(torch.tensor([[target]], device=device))
            ll[i, j], greedy[i, j] = total, hit
    return ll, greedy


def pad_requests(tok: Tokenizer, items: list[Item], dist: Dist, mine: int) -> list[tuple[list[int], int]]:
    """The dummy requests that bring this rank's `mine` requests up to the most any rank scores
    of `items` (each rank's share is `Dist.shard`'s, known to every rank: no collective). A dummy
    is the separator followed by the separator, one scored token: the shortest request there
    is, so that the length order puts it after every real one."""
    most = max(sum(len(item.requests) for item in Dist(r, dist.world).shard(items)) for r in range(dist.world))
    return [([tok.sep_id, tok.sep_id], 1)] * (most - mine)


def evaluate_task(
    model: GPT,
    tok: Tokenizer,
    items: list[Item],
    depths: list[int],
    device: torch.device,
    batch_size: int = 8,
    dist: Dist | None = None,
    kv_cache: str | None = None,
    **fwd: Any,
) -> dict[int, dict[str, float]]:
    """{depth: metrics} for one task; with a dist (pretrain.distributed.Dist) items are sharded
    over ranks and the sums all-reduced.

    With several ranks every rank scores as many requests as the rank with the most (its own,
    then one-token dummies, `pad_requests`), so every rank runs the same forwards: under ZeRO-3
    (the trainer's `train.eval_tasks_every`) parameters are gathered collectively inside them,
    and a rank with one forward fewer would leave the others waiting. The dummies come last
    in the length order, after every real request, and are never read."""
    mine = items if dist is None else dist.shard(items)
    flat: list[tuple[list[int], int]] = []
    for item in mine:
        for context, cont in item.requests:
            flat.append(encode_request(tok, context, cont, model.cfg.max_seq_len))
    if dist is not None and dist.world > 1:
        flat += pad_requests(tok, items, dist, len(flat))
    if not flat:
        ll, greedy = torch.zeros(0, len(depths), dtype=torch.float64), torch.zeros(0, len(depths), dtype=torch.bool)
    elif kv_cache is not None:
        ll, greedy = score_requests_cached(model, flat, depths, device, kv_cache)
    else:
        ll, greedy = score_requests(model, flat, depths, device, batch_size, **fwd)
    # per depth: correct, correct_norm, items, summed ll, continuation tokens
    sums = torch.zeros(len(depths), 5, dtype=torch.float64)
    pos = 0
    for item in mine:
        k = len(item.requests)
        item_ll, item_greedy = ll[pos : pos + k], greedy[pos : pos + k]
        if item.kind == "lambada":
            sums[:, 0] += item_greedy[0].double()
            sums[:, 3] += item_ll[0]
            sums[:, 4] += flat[pos][1]
        else:
            chars = torch.tensor(item.choice_chars, dtype=torch.float64)[:, None]
            sums[:, 0] += (item_ll.argmax(0) == item.gold).double()
            sums[:, 1] += ((item_ll / chars).argmax(0) == item.gold).double()
        sums[:, 2] += 1
        pos += k
    sums = sum_over_ranks(sums, dist)
    if depths and not sums[0, 2].item() > 0:  # on every rank alike: the count is summed over them
        raise ConfigError("zero-shot task: no item was scored, so there is no accuracy to report")
    out: dict[int, dict[str, float]] = {}
    for j, r in enumerate(depths):
        c, cn, n, sll, ntok = sums[j].tolist()
        if items and items[0].kind == "lambada":
            out[r] = {"acc": c / n, "ppl": math.exp(-sll / max(ntok, 1)), "n": int(n)}
        else:
            out[r] = {"acc": c / n, "acc_norm": cn / n, "n": int(n)}
    return out
