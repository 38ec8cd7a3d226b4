"""`grt eval --tasks chains`: the chains task (data_pipeline/chains.py) scored at every exit depth
and by k, the lookups an answer needs: answer accuracy (the argmax at the position before the
answer is the answer) and answer loss (nats). The answers and their k are parsed from the
tokens of the manifest's split (`score_positions`), so any split of `grt data chains` data scores
with no side file. Sums stay on the device and are copied to the host once, summed over ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from data_pipeline.chains import score_positions
from data_pipeline.epoch_plan import IGNORE_INDEX
from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.evaluation.scoring import check_batches, check_scored, exit_hidden, sum_over_ranks, val_batches

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.tokenizer import Tokenizer
    from pretrain.model import GPT


def chains_settings(manifest: Manifest) -> tuple[dict[str, Any], int]:
    """The manifest's task settings and the largest k of any split; a manifest `grt data chains`
    did not write is refused in one line."""
    train, val = manifest.options.get("chains"), manifest.options.get("val_chains")
    if not isinstance(train, dict) or not isinstance(val, dict):
        raise ConfigError(
            f"--tasks chains: data={manifest.path!r} is not a chains data set (make one with `grt data chains`)"
        )
    return train, max(int(train["max_hops"]), int(val["max_hops"]))


def answer_positions(ids: torch.Tensor, pieces: list[str], max_k: int) -> tuple[torch.Tensor, ...]:
    """(row, position of the logits that predict the answer, k) of every query in a batch of
    samples ``ids`` [B, T + 1] (inputs and the last target), as CPU long tensors."""
    rows, cols, ks = [], [], []
    for b, sample in enumerate(ids.tolist()):
        for pos, _, k in score_positions([pieces[t] for t in sample]):
            if k > max_k:
                raise ConfigError(f"a query needs k={k} lookups, more than the manifest's largest ({max_k})")
            rows.append(b)
            cols.append(pos - 1)
            ks.append(k)
    return tuple(torch.tensor(v, dtype=torch.long) for v in (rows, cols, ks))


@torch.no_grad()
def chains_sums(
    model: GPT,
    tok: Tokenizer,
    manifest: Manifest,
    split: str,
    depths: list[int],
    device: torch.device,
    batch_size: int,
    dist: Dist | None = None,
    max_batches: int | None = None,
    seed: int = 1234,
) -> torch.Tensor:
    """[len(depths), max_k + 1, 3] on the CPU: correct answers, summed answer NLL and answers, per
    exit depth and k (index k; 0 is unused), summed over ranks."""
    _, max_k = chains_settings(manifest)
    pieces = [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
    check_batches(manifest, split, batch_size, dist.world if dist is not None else 1)
    sums = torch.zeros(len(depths), max_k + 1, 3, dtype=torch.float64, device=device)
    for batch in val_batches(manifest.path, batch_size, dist, max_batches, seed, split):
        idx, targets = batch["input_ids"], batch["targets"]
        last = targets[:, -1:]  # the next sample's separator; where a loss mask left it out, its id
        last = last.masked_fill(last == IGNORE_INDEX, tok.sep_id)
        rows, cols, ks = answer_positions(torch.cat([idx, last], dim=1), pieces, max_k)
        gold = targets[rows, cols].to(device)
        rows, cols, ks = rows.to(device), cols.to(device), ks.to(device)
        for i, (_, h) in enumerate(exit_hidden(model, idx.to(device), depths)):
            logits = model.head(h[rows, cols]).float()
            per_item = torch.stack(
                [
                    (logits.argmax(-1) == gold).double(),
                    F.cross_entropy(logits, gold, reduction="none").double(),
                    torch.ones_like(gold, dtype=torch.float64),
                ],
                dim=1,
            )
            sums[i].index_add_(0, ks, per_item)
    return sum_over_ranks(sums, dist)


def chains_table(sums: torch.Tensor, depths: list[int], what: str) -> dict[int, dict[str, Any]]:
    """{depth: {acc, loss, items, by_k: {k: {acc, loss, items}}}} of `chains_sums` (k with no item
    left out); no answer scored is an error naming `what`."""
    check_scored(float(sums[0, :, 2].sum()) if depths else 0.0, what)
    out: dict[int, dict[str, Any]] = {}
    for i, r in enumerate(depths):
        by_k = {}
        for k in range(sums.shape[1]):
            correct, nll, n = sums[i, k].tolist()
            if n:
                by_k[k] = {"acc": correct / n, "loss": nll / n, "items": int(n)}
        correct, nll, n = sums[i].sum(0).tolist()
        out[r] = {"acc": correct / n, "loss": nll / n, "items": int(n), "by_k": by_k}
    return out


def format_chains(results: dict[str, Any]) -> str:
    """`grt eval`'s chains results as tables of answer accuracy and loss: a row per k (and all), a
    column per exit depth (a looped model's loop steps beyond the trained R marked)."""
    res = results["chains"]
    trained_loops = results["trained_loops"] if results["depth_unit"] == "loop steps" else None
    by_depth = res["by_depth"]
    depths = list(by_depth)
    ks = sorted({k for row in by_depth.values() for k in row["by_k"]})
    lo, hi = res["trained_hops"]
    head = "".join(f"{str(r) + ('*' if trained_loops is not None and r > trained_loops else ''):>9}" for r in depths)
    lines = [
        f"chains ({res['split']} split, trained on k {lo}..{hi}; chance accuracy {res['chance_acc']:.3f}): "
        f"rows k (lookups an answer needs), columns exit depth ({results['depth_unit']})"
    ]
    for metric, label in (("acc", "answer accuracy"), ("loss", "answer loss (nats)")):
        lines.append(f"{label:<24}" + head)
        for k in ks:
            name = f"k={k}{'+' if k > hi else ''} ({by_depth[depths[0]]['by_k'][k]['items']} items)"
            lines.append(f"  {name:<22}" + "".join(f"{by_depth[r]['by_k'][k][metric]:>9.4f}" for r in depths))
        name = f"all ({by_depth[depths[0]]['items']} items)"
        lines.append(f"  {name:<22}" + "".join(f"{by_depth[r][metric]:>9.4f}" for r in depths))
    if any(k > hi for k in ks):
        lines.append("+ k beyond the trained range")
    if trained_loops is not None and any(r > trained_loops for r in depths):
        lines.append(f"* beyond the trained maximum of {trained_loops} loop steps")
    return "\n".join(lines)


def chains_part(
    args: Any, loaded: Any, model: GPT, tok: Tokenizer, depths: list[int], device: torch.device, dist: Dist
) -> dict[str, Any]:
    """`grt eval`'s chains part (its ``chains`` entry): the data (--data, else the run's), its --split
    (default val); the task's settings, chance and the table by depth and k."""
    from data_pipeline.manifest import Manifest
    from pretrain.infer.evaluation.loss_by_depth import held_out_split

    data: str | None = args.data or loaded.run_config.get("data")
    if not data:
        raise ConfigError("--tasks chains: no data set; pass --data <manifest.json of `grt data chains`>")
    manifest = loaded.check_data(data)
    if not isinstance(manifest, Manifest):
        raise ConfigError(f"--tasks chains scores one manifest, not a mixture (data={data!r}): pass --data")
    split = held_out_split(manifest, args.split)
    train, _ = chains_settings(manifest)
    sums = chains_sums(model, tok, manifest, split, depths, device, args.batch_size, dist, args.max_batches)
    return {
        "manifest": manifest.path,
        "split": split,
        "trained_hops": [int(train["min_hops"]), int(train["max_hops"])],
        "chance_acc": 1.0 / int(train["num_values"]),
        "by_depth": chains_table(sums, depths, f"--tasks chains: data={manifest.path!r} split {split!r}"),
    }
