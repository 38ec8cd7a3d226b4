"""`grt compare`'s sizing of its runs: the layout change that comes closest to the reference's
forward FLOPs per token or parameter count (`match`), and with --time-budget the token count
measured to fit the budget.

`--time-budget S` times one optimizer step of each run at each depth its recipe trains at (the
trainer's own engine, in a fresh process) and one whole one-step `grt train` (the start-up), then
gives every run the largest equal token count for which all of them, one after another, finish
within S seconds of the command's start, counting their evaluations and what final_eval runs
on each final checkpoint (<out>/sizing.json keeps the result, so the same command rebuilds the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from grt_common.files import atomic_write_text
from pretrain.model.flops import flops_per_token, train_flops_per_token
from pretrain.model_config import Layout, ModelConfig
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import TrainConfig, tokens_per_step
from pretrain.tools.compare.final_eval import final_eval_work
from pretrain.tools.compare.runs import start_run
from pretrain.training.depth import depth_for_step


# -- matching the reference ----------------------------------------------------------------------
def model_params(cfg: ModelConfig) -> int:
    """The model's parameter count, built on the meta device (no memory, no weights)."""
    import torch

    from pretrain.model import build_model
    from pretrain.model.flops import count_params

    with torch.device("meta"):
        return count_params(build_model(cfg))["params"]


def _with_layout(cfg: ModelConfig, **parts: int) -> ModelConfig:
    layout = cfg.parsed_layout
    if not layout.looped:
        return cfg.replace(layout=str(parts.get("n", layout.prelude)))
    c, r = parts.get("c", layout.core), parts.get("r", layout.loops)
    return cfg.replace(layout=str(Layout(layout.prelude, c, r, layout.coda)))  # the placement kept


def match(cfg: ModelConfig, target: float, what: str, seq_len: int) -> ModelConfig:
    """The layout change (R for looped, N for dense; C for looped under params) closest to target:
    forward FLOPs per token ("flops"), training FLOPs per token at depth R ("train-flops") or
    parameters ("params")."""
    measures: dict[str, Callable[[ModelConfig], float]] = {
        "flops": lambda c: flops_per_token(c, seq_len),
        "train-flops": lambda c: train_flops_per_token(c, seq_len, c.max_loops),
        "params": model_params,
    }
    measure = measures[what]
    key = ("c" if what == "params" else "r") if cfg.parsed_layout.looped else "n"
    best = min((_with_layout(cfg, **{key: v}) for v in range(1, 65)), key=lambda c: abs(measure(c) - target))
    return best


# -- sizing the tokens by measurement -----------------------------------------------------------
# Share of the time left after timing that is not planned for: what the timing does not see
# (data loader start, checkpoint saves, the exit curves, the table and plot).
UNPLANNED_SHARE = 0.1


def depth_counts(cfg: RunConfig) -> Counter:
    """How many of the run's steps train at each loop depth (its recipe, seed and step count)."""
    t = cfg.train
    return Counter(depth_for_step(t, cfg.model.max_loops, step) for step in range(t.steps))


def measure_steps(runs: list[tuple[dict, list[int]]], seq_len: int, repeats: int) -> list[dict[int, float]]:
    """Seconds per optimizer step of each run at each given depth, timed with the trainer's
    own engine (DeepSpeed, the run's precision, optimizer and checkpointing) on random
    tokens. Runs in a fresh process (measure_steps_apart): the process group and device
    memory go with it."""
    import gc

    import torch

    from pretrain.distributed import init_distributed
    from pretrain.training.engine.build import build_engine

    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    build_engine(RunConfig.from_dict(runs[0][0]), 1, device)  # untimed: JIT builds (FusedAdam) happen once, here
    measured = []
    for cfg_dict, depths in runs:
        cfg = RunConfig.from_dict(cfg_dict)
        t = cfg.train
        engine, _ = build_engine(cfg, 1, device)
        idx = torch.randint(cfg.model.vocab_size, (t.micro_batch_size, seq_len), device=device)
        step_s = {}
        for depth in depths:
            for i in range(repeats + 1):  # the first step at each depth warms up (kernels, allocator)
                if i == 1:
                    sync()
                    begin = time.perf_counter()
                for _ in range(t.grad_accum):
                    loss = engine(idx, idx, n_loops=depth, return_logits=False).loss  # as the trainer calls it
                    loss.item()  # the trainer's host sync per micro-batch
                    engine.backward(loss)
                    engine.step()
            sync()
            step_s[depth] = (time.perf_counter() - begin) / repeats
        measured.append(step_s)
        del engine, loss
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return measured


def measure_steps_apart(runs: list[dict], seq_len: int, repeats: int) -> list[dict[int, float]]:
    """measure_steps in a spawned process, for each run at every depth its recipe trains at."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    work = [(run["cfg"].to_dict(), sorted(depth_counts(run["cfg"]))) for run in runs]
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_steps, work, seq_len, repeats).result()


def measure_startup(run: dict, out: Path) -> float:
    """Seconds of a real one-step `grt train` of the run: what every run spends besides its
    steps (process start, imports, engine, data loader, one evaluation, the checkpoint)."""
    import shutil

    cfg = RunConfig.from_dict(run["cfg"].to_dict())
    cfg.train.steps, cfg.train.eval_every, cfg.out = 1, 1, str(out / "startup-probe")
    shutil.rmtree(cfg.out, ignore_errors=True)
    log = out / "startup-probe.log"
    begin = time.time()
    codes = [p.wait() for p in start_run(cfg, 1, log)]
    if any(codes):
        raise RuntimeError(f"the start-up probe (grt train of {run['label']}, one step) failed; see {log}")
    shutil.rmtree(cfg.out)
    return time.time() - begin


def final_forwards(cfg: ModelConfig, exit_factor: int) -> float:
    """final_eval's work on a looped model's final checkpoint, in forwards at depth R by FLOPs:
    a loop step at its share of such a forward, a decode as a forward at depth 0 (its prelude
    also covers each pass's own: every pass decodes at least once)."""
    work = final_eval_work(cfg, exit_factor)
    at_0, at_r = (flops_per_token(cfg, n_loops=n, executed=True) for n in (0, cfg.max_loops))
    return (work["decodes"] * at_0 + work["loop_steps"] * (at_r - at_0) / cfg.max_loops) / at_r


def size_tokens(
    runs: list[dict],
    step_s_by_depth: list[dict],
    startup_s: float,
    budget_s: float,
    tokens_per_step: int,
    evals: int,
    eval_batches: int,
    exit_factor: int,
) -> dict:
    """The largest equal token count (whole steps) for which the runs, one after another, fit
    in budget_s: each run costs the start-up (startup_s: the one-step run of the first, less
    that step), its evaluations, and per step its mean step time over the depths its recipe
    samples (depth_counts)."""
    mean_step_s = []
    for run, timed in zip(runs, step_s_by_depth):
        counts = depth_counts(run["cfg"])
        mean_step_s.append(sum(timed[d] * n for d, n in counts.items()) / sum(counts.values()))
    plan, fixed_s, step_sum_s = {}, 0.0, 0.0
    for run, timed, step_s in zip(runs, step_s_by_depth, mean_step_s):
        r = run["cfg"].model.max_loops
        forward_s = max(timed.values()) / 3  # a forward at the deepest timed depth: about a third of a step
        # the trainer's evaluations at r = 0..R (the probe's one is counted again: a margin), and what
        # final_eval runs on the final checkpoint
        final = final_forwards(run["cfg"].model, exit_factor) if r else 0.0
        eval_s = eval_batches * forward_s * (evals * (r + 1) + final)
        overhead_s = startup_s - mean_step_s[0] + eval_s
        plan[run["label"]] = {"step_s": step_s, "overhead_s": overhead_s, "step_s_by_depth": timed}
        fixed_s += overhead_s
        step_sum_s += step_s
    steps = max(1, int((budget_s * (1 - UNPLANNED_SHARE) - fixed_s) / step_sum_s))
    return {
        "tokens": steps * tokens_per_step,
        "steps": steps,
        "budget_s": budget_s,
        "startup_s": startup_s,
        "planned_s": fixed_s + steps * step_sum_s,
        "runs": plan,
    }


def run_tokens_per_step(args: argparse.Namespace, seq_len: int) -> int:
    """The training tokens of one optimizer step of every run (`tokens_per_step`): --micro-batch-size
    x --grad-accum sequences of seq_len tokens on each of --nproc ranks."""
    train = TrainConfig(micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum)
    return tokens_per_step(train, args.nproc, seq_len)


def sized_tokens(args: argparse.Namespace, runs: list[dict], out: Path, suffix: str, started: float) -> float:
    """--time-budget's tokens per run, measured on `runs` (built at --min-tokens: the depth mix of
    a run of the minimum size), kept in <out>/sizing.json and reused."""
    path = out / f"sizing{suffix}.json"
    labels = [run["label"] for run in runs]
    if path.is_file() and not args.retrain:
        saved = json.loads(path.read_text())
        if saved.get("labels") == labels:
            print(f"using the sizing in {path}: {saved['tokens']:,} tokens per run", flush=True)
            return float(saved["tokens"])
    from data_pipeline.manifest import Manifest

    seq_len = Manifest.load(args.data).seq_len
    print(
        f"timing one optimizer step of each run at each depth it trains at ({args.timing_steps} timed) ...", flush=True
    )
    step_s_by_depth = measure_steps_apart(runs, seq_len, args.timing_steps)
    print("timing the start-up of one run (grt train, one step) ...", flush=True)
    startup_s = measure_startup(runs[0], out)
    left_s = args.time_budget - (time.time() - started)
    tokens_per_step = run_tokens_per_step(args, seq_len)
    sizing = size_tokens(
        runs, step_s_by_depth, startup_s, left_s, tokens_per_step, args.evals, args.eval_batches, args.exit_depth_factor
    )
    for label, p in sizing["runs"].items():
        print(
            f"  {label:<24} {p['step_s'] * 1e3:9.1f} ms/step (mean over its depths)  "
            f"{tokens_per_step / p['step_s']:>12,.0f} tokens/s  overhead {p['overhead_s']:5.1f} s",
            flush=True,
        )
    print(
        f"sized: {sizing['tokens']:,} tokens per run ({sizing['steps']} steps); planned {sizing['planned_s']:.0f} s "
        f"of the {left_s:.0f} s left (a one-step run took {startup_s:.1f} s)",
        flush=True,
    )
    if sizing["tokens"] < args.min_tokens:
        print(
            f"grt compare: warning: the time budget affords {sizing['tokens']:,} tokens per run, below "
            f"--min-tokens {args.min_tokens:,.0f}",
            file=sys.stderr,
            flush=True,
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"labels": labels, **sizing}, indent=2) + "\n")
    return float(sizing["tokens"])
