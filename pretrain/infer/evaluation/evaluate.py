"""`grt eval`: loss, perplexity and zero-shot accuracy at every exit depth.

One forward pass per batch runs the loop to the deepest requested depth and keeps
every state s_0..s_n; each exit depth r decodes s_r with the model's own tail
(pretrain.infer.evaluation.scoring, shared with zero-shot and `grt analyze`). What it measures:

- held-out loss/perplexity on the manifest's validation split (token-weighted mean);
- WikiText-2 raw: loss per token, perplexity and bits per byte (total NLL in bits over
  the UTF-8 bytes of the text), windows of the model's context (optional stride);
- zero-shot tasks (`pretrain.infer.evaluation.zero_shot`): LAMBADA (acc, ppl), HellaSwag, PIQA,
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
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from data_pipeline.shards import ShardError
from grt_common.errors import ConfigError
from grt_common.files import output_path
from pretrain import PROJECT_ROOT
from pretrain.distributed import Dist, RankFailed, check_ranks, is_main, join_launch, ranks_with, run_command
from pretrain.infer.adaptive import CRITERIA, check_criterion, parse_thresholds
from pretrain.infer.evaluation.chains_score import chains_part, format_chains
from pretrain.infer.evaluation.loss_by_depth import held_out, text_eval
from pretrain.infer.evaluation.report import format_table, plot_depths
from pretrain.infer.evaluation.scoring import jsonable
from pretrain.infer.evaluation.zero_shot import evaluate_task
from pretrain.infer.exit_depths import check_depths, default_depths, depth_unit
from pretrain.infer.kv_cache import STRATEGIES
from pretrain.model_config import OnceParser
from pretrain.runs.data_spec import parse_data
from pretrain.runs.eval_tasks import TASKS, load_task, parse_depths


def default_eval_dir() -> Path:
    """The shared evaluation data: $GRT_EVAL_DIR, else ../shared/data/eval next to the repo."""
    return Path(os.environ.get("GRT_EVAL_DIR", PROJECT_ROOT.parent / "shared" / "data" / "eval"))


# -- the command --------------------------------------------------------------------------------------
ALL_PARTS = ("val", "wikitext2", "lambada", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")
NAMED_PARTS = ("chains",)  # scored when named only: 'all' does not need a `grt data chains` data set


def build_parser() -> argparse.ArgumentParser:
    p = OnceParser(prog="grt eval", description="Evaluate a model at every exit depth.")  # a flag given twice: refused
    p.add_argument("model", help="exported dir (grt export), run dir, <out>/checkpoints or a step dir")
    p.add_argument(
        "--depths",
        help="exit depths, e.g. 0-12 or 0,2,4: loop steps of a looped model (default 0..R, the trained maximum); "
        "layers run of a dense model, 1..N (default N, the whole model)",
    )
    p.add_argument("--allow-beyond-trained", action="store_true", help="allow depths above the trained R")
    p.add_argument(
        "--tasks",
        default="all",
        help=f"comma list of {', '.join(ALL_PARTS + NAMED_PARTS)}; or 'all' (default; all but chains)",
    )
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
    p.add_argument("--json-out", type=output_path(is_dir=False), help="write the results as JSON here")
    p.add_argument("--plot", type=output_path(is_dir=False), help="write a PNG of loss against depth here")
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


# What one process reports in one line (exit 2); anything else is a bug, shown with its traceback (exit 1).
INPUT_ERRORS = (ConfigError, FileNotFoundError, ShardError)  # ShardError: names the unreadable shard


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The results (on every rank). With several ranks, a rank's own failure is passed to
    `check_ranks`, which the others reach at their next sum (or at the end): every rank then
    raises RankFailed naming the failing rank and its error, and no partial table is printed."""
    parts = list(ALL_PARTS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in parts if t not in ALL_PARTS + NAMED_PARTS]
    if unknown:
        raise ConfigError(f"--tasks: unknown {unknown}; accepted: {', '.join(ALL_PARTS + NAMED_PARTS)}, all")
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
        found = bool(manifest and all(Path(p).is_file() for p in parse_data(manifest).paths))
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
    if "chains" in parts:
        assert tok is not None  # chains is not val
        t0 = time.time()
        results["chains"] = chains_part(args, loaded, model, tok, depths, device, dist)
        timings["chains"] = time.time() - t0
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from grt_common.files import atomic_write_text

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
    if set(results) & {"val", "wikitext2", "tasks"}:
        print(format_table(results))
    if "chains" in results:
        print(format_chains(results))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json_out), json.dumps(jsonable(results), indent=2) + "\n")  # complete or absent
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_depths(results, args.plot, f"{results['name']} ({results['layout']})")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, prog="grt eval"))
