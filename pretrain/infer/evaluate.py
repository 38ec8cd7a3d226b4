"""`grt eval`: loss, perplexity and zero-shot accuracy at every exit depth.

One forward pass per batch runs the loop to the deepest requested depth and keeps
every state s_0..s_n; each exit depth r decodes s_r with the model's own tail
(pretrain.infer.scoring, shared with zero-shot and `grt analyze`). What it measures:

- held-out loss/perplexity on the manifest's validation split (token-weighted mean);
- WikiText-2 raw: loss per token, perplexity and bits per byte (total NLL in bits over
  the UTF-8 bytes of the text), windows of the model's context (optional stride);
- zero-shot tasks (`pretrain.infer.zero_shot`): LAMBADA (acc, ppl), HellaSwag, PIQA,
  ARC-Easy/Challenge, WinoGrande (acc, acc_norm).
With `--kv-cache STRATEGY` every part decodes token by token through the KV cache
(pretrain.infer.kv_cache), which measures what the looped core's shared caches cost.

Run under a launcher (torchrun, deepspeed, srun, mpirun) it shards batches and items by
rank and all-reduces the sums; results are identical to one process up to float order.
A rank that fails (an unreadable shard, a missing file, any error in its share) stops every
rank at the next sum, each with one line naming it and its error (`run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from data_pipeline.shards import ShardError
from pretrain import PROJECT_ROOT
from pretrain.config import ConfigError
from pretrain.distributed import Dist, RankFailed, check_ranks, is_main, join_launch, ranks_with, run_command
from pretrain.infer.adaptive import CRITERIA, adaptive_table, check_criterion, parse_thresholds
from pretrain.infer.kv_cache import STRATEGIES
from pretrain.infer.scoring import (
    adaptive_sums,
    check_batches,
    check_scored,
    jsonable,
    lm_sums,
    lm_sums_cached,
    val_batches,
)
from pretrain.infer.zero_shot import evaluate_task
from pretrain.model import GPT
from pretrain.runs.eval_tasks import TASKS, load_task, parse_depths
from pretrain.runs.run_config import data_paths

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest
    from data_pipeline.tokenizer import Tokenizer
    from pretrain.infer.load import LoadedModel

LN2 = math.log(2.0)


def default_eval_dir() -> Path:
    """The shared evaluation data: $GRT_EVAL_DIR, else ../shared/data/eval next to the repo."""
    return Path(os.environ.get("GRT_EVAL_DIR", PROJECT_ROOT.parent / "shared" / "data" / "eval"))


# -- depths ------------------------------------------------------------------------------
def depth_unit(model: GPT) -> str:
    """What an exit depth counts: a looped model's loop steps, a dense model's layers."""
    return "loop steps" if model.loop is not None else "layers"


def default_depths(model: GPT) -> list[int]:
    """--depths by default: a looped model's 0..R, a dense model's N (the whole model)."""
    return list(range(model.max_loops + 1)) if model.loop is not None else [len(model.prelude)]


def check_depths(model: GPT, depths: list[int], allow_beyond: bool) -> list[int]:
    """The exit depths, refused in one line where the model cannot run them. A looped model's
    depth r is r loop steps (0: the prelude straight to the coda; above the trained R only with
    allow_beyond); a dense model's depth k is its first k layers, then the final norm and head
    (1..N; N: the whole model; `GPT.dense_exit`)."""
    trained = model.max_loops if model.loop is not None else 0
    if model.loop is None:
        n = len(model.prelude)
        bad = [d for d in depths if not 1 <= d <= n]
        if bad:
            raise ConfigError(
                f"--depths {bad}: a dense model's exit depth is the number of layers run, 1..{n} ({n}: the whole model)"
            )
        return depths
    beyond = [d for d in depths if d > trained]
    if beyond and not allow_beyond:
        raise ConfigError(
            f"depth(s) {beyond} exceed the trained maximum of {trained} loop steps; "
            "pass --allow-beyond-trained to run them"
        )
    return depths


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


# -- reporting ------------------------------------------------------------------------------------
def format_table(results: dict[str, Any]) -> str:
    depths = results["depths"]

    def task_metric(task: str, metric: str) -> Callable[[int], float]:
        return lambda r: results["tasks"][task][r][metric]

    cols: list[tuple[str, Callable[[int], float]]] = []
    for name in results.get("val_by_source", {}):
        cols.append((f"val loss {name}", source_loss(results, name)))
    if "val" in results:
        cols += [("val loss", lambda r: results["val"][r]["loss"]), ("val ppl", lambda r: results["val"][r]["ppl"])]
    if "wikitext2" in results:
        cols += [
            ("wt2 ppl", lambda r: results["wikitext2"][r]["ppl"]),
            ("wt2 bpb", lambda r: results["wikitext2"][r]["bpb"]),
        ]
    for task, by_depth in results.get("tasks", {}).items():
        for metric in ("acc", "acc_norm", "ppl"):
            if metric in by_depth[depths[0]] and not (task == "winogrande" and metric == "acc_norm"):
                cols.append((f"{task} {metric}", task_metric(task, metric)))
    # past the trained R (a looped model's depths; a dense model's are layers, at most N)
    trained = results.get("trained_loops") if results.get("depth_unit", "loop steps") == "loop steps" else None
    widths = [max(len(name) + 2, 10) for name, _ in cols]
    lines = ["depth " + "".join(f"{name:>{w}}" for (name, _), w in zip(cols, widths))]
    for r in depths:
        mark = "*" if trained is not None and r > trained else " "
        lines.append(f"{r:>4}{mark}" + "".join(f"{fn(r):>{w}.4f}" for (_, fn), w in zip(cols, widths)))
    if trained is not None and any(r > trained for r in depths):
        lines.append(f"* beyond the trained maximum of {trained} loop steps")
    if "adaptive_exit" in results:
        ad = results["adaptive_exit"]
        lines += [
            "",
            f"adaptive exit ({ad['criterion']}, at most {ad['max_steps']} steps), held-out split:",
            f"{'threshold':>10}{'val loss':>12}{'mean steps':>12}",
        ]
        lines += [
            f"{thr:>10g}{row['loss']:>12.4f}{row['mean_steps']:>12.3f}" for thr, row in ad["by_threshold"].items()
        ]
    return "\n".join(lines)


def source_loss(results: dict[str, Any], name: str) -> Callable[[int], float]:
    return lambda r: results["val_by_source"][name][r]["loss"]


def plot_depths(results: dict[str, Any], path: str | Path, title: str = "") -> None:
    import matplotlib

    from data_pipeline.files import atomic_savefig

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = results["depths"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("val", "validation"), ("wikitext2", "WikiText-2")):
        if key in results:
            ax.plot(depths, [results[key][r]["loss"] for r in depths], marker="o", label=label)
    if results.get("trained_loops") and results.get("depth_unit", "loop steps") == "loop steps":
        ax.axvline(results["trained_loops"], color="grey", ls="--", lw=1, label="trained R")
    ax.set_xlabel(f"exit depth ({results.get('depth_unit', 'loop steps')})")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss by exit depth")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


# -- the command --------------------------------------------------------------------------------------
ALL_PARTS = ("val", "wikitext2", "lambada", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grt eval", description="Evaluate a model at every exit depth.")
    p.add_argument("model", help="exported dir (grt export), run dir, <out>/checkpoints or a step dir")
    p.add_argument(
        "--depths",
        help="exit depths, e.g. 0-12 or 0,2,4: loop steps of a looped model (default 0..R, the trained maximum); "
        "layers run of a dense model, 1..N (default N, the whole model)",
    )
    p.add_argument("--allow-beyond-trained", action="store_true", help="allow depths above the trained R")
    p.add_argument("--tasks", default="all", help=f"comma list of {', '.join(ALL_PARTS)}; or 'all' (default)")
    p.add_argument("--data", help="manifest.json for the held-out split (default: the run config's data)")
    p.add_argument("--split", help="the manifest's split to score (default: val; the error lists the splits there are)")
    p.add_argument("--max-batches", type=int, help="held-out split: at most this many batches per rank")
    p.add_argument("--eval-dir", help="directory of the WikiText-2 and zero-shot files (default ../shared/data/eval)")
    p.add_argument("--wikitext", help="WikiText-2 raw text file (default <eval-dir>/wikitext2_raw_test.txt)")
    p.add_argument("--wikitext-max-tokens", type=int, help="score only the first N tokens of WikiText-2")
    p.add_argument("--stride", type=int, help="WikiText-2 window stride (default: the window, no overlap)")
    p.add_argument("--limit", type=int, help="at most N items per zero-shot task")
    p.add_argument(
        "--kv-cache",
        choices=STRATEGIES,
        help="decode token by token through this KV-cache strategy (held-out loss, WikiText-2, "
        "zero-shot continuations) instead of one forward per sequence; full is exact",
    )
    p.add_argument(
        "--adaptive-exit",
        choices=CRITERIA,
        help="held-out split: also per-token adaptive exit by this rule (pretrain/infer/adaptive.py)",
    )
    p.add_argument(
        "--exit-thresholds",
        default="0.3,0.1,0.03,0.01",
        help="adaptive exit: thresholds on the rule's change (default 0.3,0.1,0.03,0.01)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--doc-mask", action="store_true", help="held-out split: attend within documents only")
    p.add_argument("--tokenizer", help="tokenizer.model (default: the one next to the model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a CUDA GPU, else the stored dtype), fp32, bf16, fp16")
    p.add_argument("--json-out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG of loss against depth here")
    p.add_argument("--quiet", action="store_true")
    return p


def check_args(args: argparse.Namespace, parts: list[str]) -> None:
    """The flags, before the model is loaded or any rank waits for another: one line naming the
    flag and what is accepted."""
    from pretrain.infer.load import parse_dtype

    counts = (
        ("--batch-size", args.batch_size),
        ("--max-batches", args.max_batches),
        ("--wikitext-max-tokens", args.wikitext_max_tokens),
        ("--stride", args.stride),
        ("--limit", args.limit),
    )
    for flag, value in counts:
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1 (a result over nothing is not a result)")
    if args.depths:
        parse_depths(args.depths, 0)  # the syntax now; the trained maximum once the model is loaded
    if args.adaptive_exit:
        if "val" not in parts:
            raise ConfigError("--adaptive-exit is measured on the held-out split: add val to --tasks")
        parse_thresholds(args.exit_thresholds)
    parse_dtype(args.dtype)


def held_out_split(manifest: Manifest, requested: str | None) -> str:
    """The split to score: --split, else val; a missing or empty one is refused naming those there are."""
    split = requested or "val"
    if not manifest.splits.get(split):
        have = ", ".join(f"{name} ({len(shards)} shards)" for name, shards in manifest.splits.items()) or "none"
        hint = "" if requested else "; pass --split NAME to score another split (train data is not held out)"
        raise ConfigError(f"data={manifest.path!r} has no {split!r} split with shards (its splits: {have}){hint}")
    return split


# What one process reports in one line (exit 2); anything else is a bug, shown with its traceback (exit 1).
INPUT_ERRORS = (ConfigError, FileNotFoundError, ShardError)  # ShardError: names the unreadable shard


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The results (on every rank). With several ranks, a rank's own failure is passed to
    `check_ranks`, which the others reach at their next sum (or at the end): every rank then
    raises RankFailed naming the failing rank and its error, and no partial table is printed."""
    parts = list(ALL_PARTS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in parts if t not in ALL_PARTS]
    if unknown:
        raise ConfigError(f"--tasks: unknown {unknown}; accepted: {', '.join(ALL_PARTS)}, all")
    check_args(args, parts)
    dist = join_launch()
    if dist.world == 1:
        return evaluate(args, parts, dist)
    try:
        results = evaluate(args, parts, dist)
    except RankFailed:
        raise
    except Exception as err:  # this rank's own failure: check_ranks raises RankFailed here, and on the others
        expected = isinstance(err, INPUT_ERRORS)
        if not expected:
            traceback.print_exc()  # a bug: its traceback, as one process shows it
        text = " ".join(str(err).split())
        check_ranks(text if expected else f"{type(err).__name__}: {text}", 2 if expected else 1)
    check_ranks()  # a rank that failed after the last sum
    return results


def evaluate(args: argparse.Namespace, parts: list[str], dist: Dist) -> dict[str, Any]:
    from pretrain.infer.load import load_model, pick_device, pick_dtype

    device = pick_device(args.device)
    loaded = load_model(args.model, device=device, dtype=pick_dtype(args.dtype, device), tokenizer=args.tokenizer)
    model = loaded.model
    trained = model.max_loops if model.loop is not None else 0
    depths = check_depths(
        model, parse_depths(args.depths, 0) if args.depths else default_depths(model), args.allow_beyond_trained
    )
    if args.kv_cache is not None and model.loop is None and depths != default_depths(model):
        raise ConfigError(
            f"--kv-cache decodes a dense model whole (depth {len(model.prelude)}): drop --kv-cache to exit "
            f"early at --depths {args.depths}"
        )
    if args.adaptive_exit:
        check_criterion(model, args.adaptive_exit)  # before any evaluation (a dense model or MoR is refused)
    results: dict[str, Any] = {
        "model": str(args.model),
        "name": loaded.cfg.name,
        "layout": loaded.cfg.layout,
        "variant": loaded.cfg.variant,
        "trained_loops": trained,
        "depth_unit": depth_unit(model),
        "depths": depths,
        "world_size": dist.world,
        "kv_cache": args.kv_cache,
    }
    timings: dict[str, float] = {}
    say = (lambda *a: None) if args.quiet or dist.rank else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if "val" in parts:
        manifest: str | None = args.data or loaded.run_config.get("data")
        found = bool(manifest and all(Path(p).is_file() for p in data_paths(manifest)))
        if dist.world > 1:
            # every collective here follows a check_ranks(): a rank that failed earlier (loading
            # the model) waits in check_ranks, and any other collective would pair with it wrongly
            check_ranks()
            # skipped on some ranks only, the next sums would pair one rank's val with another's next part
            if 0 < ranks_with(found) < dist.world:
                if not found:
                    raise ConfigError(
                        f"held-out split: no manifest {manifest!r} on this node, while other "
                        "ranks have it: give every node the same data, or pass --tasks without val"
                    )
                check_ranks()  # meets the ranks without it, and names them
        if not found:
            if args.tasks != "all":
                raise ConfigError(f"held-out split: no manifest ({manifest!r}); pass --data <manifest.json>")
            say(f"skipping the held-out split: no manifest ({manifest!r}); pass --data")
        else:
            assert manifest is not None  # found: a manifest file or a mixture's
            t0 = time.time()
            results.update(held_out(args, loaded, model, manifest, depths, device, dist))
            timings["val"] = time.time() - t0
    eval_dir = Path(args.eval_dir) if args.eval_dir else default_eval_dir()
    tok = loaded.tokenizer() if any(p != "val" for p in parts) else None
    if "wikitext2" in parts:
        assert tok is not None  # wikitext2 is not val
        path = Path(args.wikitext) if args.wikitext else eval_dir / "wikitext2_raw_test.txt"
        if not path.is_file():
            raise ConfigError(f"WikiText-2: {path} not found (pass --wikitext or --eval-dir)")
        t0 = time.time()
        results["wikitext2"] = text_eval(
            model,
            tok,
            path.read_text(encoding="utf-8"),
            depths,
            device,
            args.batch_size,
            dist,
            stride=args.stride,
            max_tokens=args.wikitext_max_tokens,
            kv_cache=args.kv_cache,
            what=f"WikiText-2 {str(path)!r}",
        )
        results["wikitext2_file"] = str(path)
        timings["wikitext2"] = time.time() - t0
    for task in [p for p in parts if p in TASKS]:
        assert tok is not None  # a task is not val
        path = eval_dir / TASKS[task].file
        if not path.is_file():
            raise ConfigError(f"{task}: {path} not found (pass --eval-dir)")
        t0 = time.time()
        items = load_task(task, path, args.limit)
        if not items:
            raise ConfigError(f"{task}: {path} holds no items: nothing to score")
        results.setdefault("tasks", {})[task] = evaluate_task(
            model, tok, items, depths, device, args.batch_size, dist, kv_cache=args.kv_cache
        )
        timings[task] = time.time() - t0
        say(f"{task}: {len(items)} items in {timings[task]:.1f}s")
    results["seconds"] = timings
    return results


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from data_pipeline.files import atomic_write_text

    try:
        results = run(args)
    except INPUT_ERRORS as err:
        print(f"grt eval: error: {err}", file=sys.stderr)
        return 2
    except RankFailed as err:
        print(f"grt eval: error: {err}", file=sys.stderr)
        return err.code
    if not is_main():
        return 0
    print(format_table(results))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json_out), json.dumps(jsonable(results), indent=2) + "\n")  # complete or absent
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_depths(results, args.plot, f"{results['name']} ({results['layout']})")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
