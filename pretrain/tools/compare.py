"""`grt compare`: train several methods on the same shards for the same number of tokens
(each with `grt train`, one run directory per method), then tabulate and plot.

(Longer than the project's ~400 lines: the matching, the time-budget sizing, the runs and
the table are one command's stages, each short, that share its run list.)

    grt compare --data shards/manifest.json --out runs/compare \\
        --configs tiny-grt,tiny-dense,tiny-huginn,tiny-rrt,tiny-ouro,tiny-mor --tokens 2e6 \\
        --match flops --set model.d_model=64 --set model.n_heads=2

A config is a preset name or a JSON file: a model config, or {"label": ..., "model":
<preset name or model config>, "train": {...overrides}}. `--match flops` changes each
looped config's loop count R (a dense config's layer count) to come closest to the
reference's forward FLOPs per token (the first config, or --reference); `--match params`
changes the core size C (dense: the layer count) to come closest to its parameter count.
Each method trains with its own recipe (its Variant's, pretrain/variants/, as `grt train
--preset` does; override with --set or a JSON config): GRT and the ladder r ~ U{1..R}, Huginn
the heavy-tail Poisson, RRT, Ouro and MoR the full depth R.

Writes <out>/<label>/ (the run: config.json, metrics.jsonl, summary.json, tb/),
<out>/comparison.json, <out>/comparison.md (the table) and <out>/loss_curves.png.
Runs that already finished (summary.json present) are not trained again, so the table
and plot can be rebuilt with the same command; an interrupted run is resumed.

`--time-budget S` sizes the tokens by measurement instead of --tokens: one optimizer step
of each run at each depth its recipe trains at is timed first (the trainer's own engine, in
a fresh process), then every run gets the largest equal token count for which all of them,
one after another, finish within S seconds of the command's start (<out>/sizing.json keeps
the result, so the same command rebuilds the table). `--exit-depth-factor 2` adds the
early-exit curve beyond the trained R, up to 2R, evaluated on each final checkpoint.
Every looped run's final checkpoint also gets the loss at 2R and 4R, per-token adaptive
exit at fixed thresholds, and for Ouro its learned exit (pretrain/tools/compare_eval.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from data_pipeline.files import atomic_write_text
from pretrain import PROJECT_ROOT
from pretrain.config import ConfigError, Layout, ModelConfig, load_json_object
from pretrain.model.flops import flops_per_token, train_flops_per_token
from pretrain.presets import PRESETS, get_preset
from pretrain.runs.run_config import (
    RunConfig,
    apply_overrides,
    apply_recipe,
    choose_model,
    is_model_override,
    resolve,
)
from pretrain.tools.compare_eval import (
    ADAPTIVE_EXITS,
    EXTRAPOLATION_FACTORS,
    adaptive_label,
    final_eval_work,
    final_evals,
)
from pretrain.tools.compare_plot import plot
from pretrain.training.depth import depth_for_step
from pretrain.variants import get_variant


def describe_method(cfg: ModelConfig) -> str:
    return get_variant(cfg.variant).describe(cfg)


# -- building the runs ------------------------------------------------------------------------
def load_spec(spec: str) -> tuple[str, ModelConfig, dict]:
    """(label, model config, train overrides) for a preset name or a JSON file."""
    path = Path(spec)
    if spec in PRESETS:
        return spec, get_preset(spec), {}
    if not path.suffix == ".json":
        raise ConfigError(f"config {spec!r}: not a preset ({', '.join(PRESETS)}) nor a .json file")
    data = load_json_object(path, f"config {spec!r}")
    if "model" in data or "label" in data or "train" in data:
        unknown = set(data) - {"label", "model", "train"}
        if unknown:
            raise ConfigError(
                f"config {spec!r}: unknown key(s) {', '.join(sorted(unknown))}; accepted: label, model, train"
            )
        model = data.get("model", "tiny-grt")
        cfg = get_preset(model) if isinstance(model, str) else ModelConfig.from_dict(model)
        return str(data.get("label", cfg.name if cfg.name != "custom" else path.stem)), cfg, dict(data.get("train", {}))
    cfg = ModelConfig.from_dict(data)
    return (cfg.name if cfg.name != "custom" else path.stem), cfg, {}


def model_params(cfg: ModelConfig) -> int:
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
    """The layout change (R for looped, N for dense; C for looped under params) closest to target."""
    if what == "flops":
        key = "r" if cfg.parsed_layout.looped else "n"
        measure = lambda c: flops_per_token(c, seq_len)  # noqa: E731
    else:
        key = "c" if cfg.parsed_layout.looped else "n"
        measure = model_params
    best = min((_with_layout(cfg, **{key: v}) for v in range(1, 65)), key=lambda c: abs(measure(c) - target))
    return best


def build_runs(args: argparse.Namespace, tokens: float) -> list[dict]:
    from data_pipeline.manifest import Manifest

    manifest = Manifest.load(args.data)
    seq_len = manifest.seq_len
    specs = [s for item in args.configs for s in item.split(",") if s.strip()]
    if not specs:
        raise ConfigError("--configs: give at least one preset or JSON file")
    loaded = [load_spec(s.strip()) for s in specs]
    labels = [label for label, _, _ in loaded]
    if len(set(labels)) != len(labels):
        raise ConfigError(f'--configs: labels must be unique, got {labels} (give JSON configs a "label")')
    runs: list[dict[str, Any]] = []
    for label, model, train in loaded:
        cfg = RunConfig(data=str(args.data), ds_config=args.ds_config, out=str(Path(args.out) / label))
        choose_model(cfg, model, args.overrides)  # as `grt train --preset` does
        resolve(cfg, manifest)  # the trainer's rule: the tokenizer's vocabulary, a context that holds the shards
        runs.append({"label": label, "cfg": cfg, "train": train})
    if args.match != "none":
        ref_label = args.reference or labels[0]
        if ref_label not in labels:
            raise ConfigError(f"--reference {ref_label!r} is not one of the labels {labels}")
        ref = next(r for r in runs if r["label"] == ref_label)["cfg"].model
        target = flops_per_token(ref, seq_len) if args.match == "flops" else model_params(ref)
        for run in runs:
            if run["label"] != ref_label:
                before = run["cfg"].model.layout
                run["cfg"].model = match(run["cfg"].model, target, args.match, seq_len)
                run["matched_from"] = before
                apply_recipe(run["cfg"])  # the recipe of the matched model (Huginn's Poisson mean follows R)
    tokens_per_step = args.micro_batch_size * args.grad_accum * args.nproc * seq_len
    steps = max(1, int(round(float(tokens) / tokens_per_step)))
    for run in runs:
        cfg = run["cfg"]
        t = cfg.train
        t.steps, t.micro_batch_size, t.grad_accum = steps, args.micro_batch_size, args.grad_accum
        t.lr, t.min_lr, t.warmup_steps = args.lr, args.lr / 10, max(1, int(0.05 * steps))
        t.seed, t.log_every = args.seed, args.log_every
        t.eval_every = max(1, steps // max(1, args.evals))
        t.eval_batches, t.save_every, t.keep_checkpoints = args.eval_batches, 0, 1
        for key, value in run["train"].items():
            apply_overrides(cfg, [f"train.{key}={json.dumps(value) if not isinstance(value, str) else value}"])
        apply_overrides(cfg, [s for s in args.overrides if not is_model_override(s)])
        cfg.validate()
    return runs


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
    from pretrain.training.engine import build_engine

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
    """compare_eval's work on a looped model's final checkpoint, in forwards at depth R by FLOPs:
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
        # compare_eval runs on the final checkpoint
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


def sized_tokens(args: argparse.Namespace, out: Path, suffix: str, started: float) -> float:
    """--tokens, or with --time-budget the measured size (kept in <out>/sizing.json and reused)."""
    if not args.time_budget:
        return float(args.tokens)
    path = out / f"sizing{suffix}.json"
    runs = build_runs(args, args.min_tokens)  # the depth mix of a run of the minimum size
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
    tokens_per_step = args.micro_batch_size * args.grad_accum * args.nproc * seq_len
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


# -- running -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_run(cfg: RunConfig, nproc: int, log_path: Path, threads: int = 0) -> list[subprocess.Popen]:
    """`grt train --config-json` in nproc local processes (resuming if interrupted)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "compare_run_config.json"
    cfg.save(cfg_path)
    cmd = [sys.executable, "-m", "pretrain.cli", "train", "--config-json", str(cfg_path), "--resume"]
    port = _free_port()
    procs = []
    with open(log_path, "a") as log:
        for rank in range(nproc):
            # the caller's working directory, so that every path it gave (and the run config's) means
            # what it meant to the caller; the checkout on the path for a tree that is not installed
            path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            if nproc > 1:
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                )
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=log if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _lock(run_dir: Path) -> Path:
    """Refuse to train a run that another live `grt compare` is training (same --out)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / "compare.lock"
    try:
        pid = int(lock.read_text().strip())
        os.kill(pid, 0)
        if pid != os.getpid():
            raise RuntimeError(
                f"{run_dir} is being trained by another grt compare (pid {pid}); wait for it, "
                f"or remove {lock} if that process is gone"
            )
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass  # no lock, or a stale one
    lock.write_text(f"{os.getpid()}\n")
    return lock


PROGRESS_EVERY_S = 30.0  # how often train_all says where each running run is


def progress(run_dir: Path, steps: int) -> str:
    """Where a run is, from the last record of its metrics.jsonl: "step 40/100, loss 5.12"."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        lines = []
    for line in reversed(lines):  # the last whole record (the newest line may be half written)
        try:
            record = json.loads(line)
            return f"step {record['step']}/{steps}, loss {record['loss']:.3f}"
        except (ValueError, KeyError, TypeError):
            continue
    return f"starting (0/{steps} steps)"


def train_all(todo: list[dict], args: argparse.Namespace, out: Path) -> dict[str, float]:
    """Train the runs, up to --parallel at a time; {label: wall seconds}. Raises on a failed run."""
    running: dict[str, tuple[list[subprocess.Popen], float]] = {}
    pending, walls, reported = list(todo), {}, time.time()
    steps = {run["label"]: run["cfg"].train.steps for run in todo}
    while pending or running:
        while pending and len(running) < max(1, args.parallel):
            run = pending.pop(0)
            _lock(Path(run["cfg"].out))
            log = out / f"{run['label']}.log"
            print(f"training {run['label']} ... (log: {log})", flush=True)
            running[run["label"]] = (start_run(run["cfg"], args.nproc, log, args.threads), time.time())
        time.sleep(1.0)
        if time.time() - reported >= PROGRESS_EVERY_S:
            reported = time.time()
            for label, (_, start) in running.items():
                print(f"  {label}: {progress(out / label, steps[label])}, {time.time() - start:.0f} s", flush=True)
        for label, (procs, start) in list(running.items()):
            codes = [p.poll() for p in procs]
            if any(c is None for c in codes):
                continue
            del running[label]
            (out / label / "compare.lock").unlink(missing_ok=True)
            if any(codes):
                for other, _ in running.values():
                    for p in other:
                        p.terminate()
                raise RuntimeError(f"grt train for {label} failed (exit codes {codes}); see {out / (label + '.log')}")
            walls[label] = time.time() - start
            print(f"  {label} done in {walls[label]:.0f} s", flush=True)
    return walls


# -- results -----------------------------------------------------------------------------------
def _tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def collect(run: dict, seq_len: int, wall_s: float | None, exit_factor: int = 1) -> dict:
    cfg: RunConfig = run["cfg"]
    out = Path(cfg.out)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tb = _tb_scalars(out)
    tps = [v for _, v in tb.get("perf/tokens_per_s", [])][1:] or [v for _, v in tb.get("perf/tokens_per_s", [])]
    peak = [v for _, v in tb.get("memory/peak_bytes", [])]
    by_depth = {int(k): v for k, v in summary.get("val_loss_by_depth", {}).items()}
    r = cfg.model.max_loops
    evals = final_evals(cfg, exit_factor) if r else {}
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * seq_len * max(1, run.get("nproc", 1))
    train_flops = [train_flops_per_token(cfg.model, seq_len, rec.get("depth", r)) for rec in records]
    return {
        "label": run["label"],
        "method": describe_method(cfg.model),
        "variant": cfg.model.variant,
        "layout": cfg.model.layout,
        "loops": r,
        "matched_from": run.get("matched_from"),
        "d_model": cfg.model.d_model,
        "params": model_params(cfg.model),
        "flops_per_token": flops_per_token(cfg.model, seq_len),
        "train_flops_per_token": sum(train_flops) / max(1, len(train_flops)),
        "depth_sampling": cfg.train.depth_sampling if r else "-",
        "val_loss": by_depth.get(r, by_depth.get(0)) if by_depth else None,
        "val_loss_by_depth": by_depth,
        "exit_curve": evals.get("exit_curve"),
        "extrapolation": evals.get("extrapolation"),
        "adaptive_exit": evals.get("adaptive_exit"),
        "learned_exit": evals.get("learned_exit"),
        "val_curve": [(s, v) for s, v in tb.get("val/loss", [])],
        "train_curve": [(rec["step"], rec["loss"]) for rec in records],
        "tokens_per_step": tokens_per_step,
        "steps": summary.get("steps"),
        "tokens": summary.get("steps", 0) * tokens_per_step,
        "tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,  # median: windows with an eval are slow
        "peak_memory_mb": max(peak) / 2**20 if peak else None,
        "wall_s": wall_s,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _at_steps(result: dict | None) -> str:
    return "-" if not result else f"{result['loss']:.3f} @ {result['mean_steps']:.2f}"


def table(rows: list[dict]) -> str:
    rules = " / ".join(adaptive_label(*a) for a in ADAPTIVE_EXITS)
    beyond = " / ".join(f"{f}R" for f in EXTRAPOLATION_FACTORS)
    head = (
        "| method | label | layout | params | fwd MFLOPs/tok | train MFLOPs/tok | val loss | "
        "early exit (val loss at r = 0, 1, ..., R; beyond R when evaluated) | "
        f"past R: val loss at {beyond} | adaptive exit {rules} (val loss @ mean steps) | "
        "learned exit (Ouro) | tokens/s | peak mem MB |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        exits = (
            " / ".join(f"{v:.3f}" for _, v in sorted(r["val_loss_by_depth"].items())) if r["val_loss_by_depth"] else "-"
        )
        if r.get("exit_curve"):
            trained = r["loops"]
            curve = sorted(r["exit_curve"].items())
            exits = (
                " / ".join(f"{v:.3f}" for d, v in curve if d <= trained)
                + " (beyond R: "
                + " / ".join(f"{v:.3f}" for d, v in curve if d > trained)
                + ")"
            )
        if not get_variant(r["variant"]).looped:  # no loop: no exit curve
            exits = "-"
        layout = r["layout"] + (
            f" (from {r['matched_from']})" if r.get("matched_from") and r["matched_from"] != r["layout"] else ""
        )
        beyond = (
            " / ".join(f"{v:.3f}" for _, v in sorted(r["extrapolation"].items())) if r.get("extrapolation") else "-"
        )
        adaptive = (
            " / ".join(_at_steps(r["adaptive_exit"].get(adaptive_label(*a))) for a in ADAPTIVE_EXITS)
            if r.get("adaptive_exit")
            else "-"
        )
        lines.append(
            f"| {r['method']} | {r['label']} | {layout} | {r['params']:,} | {r['flops_per_token'] / 1e6:.2f} | "
            f"{r['train_flops_per_token'] / 1e6:.2f} | {_fmt(r['val_loss'], '.3f')} | {exits} | {beyond} | "
            f"{adaptive} | {_at_steps(r.get('learned_exit'))} | "
            f"{_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['peak_memory_mb'], ',.0f')} |"
        )
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grt compare", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs",
        action="append",
        required=True,
        help="comma-separated presets or JSON files (repeatable); the first is the reference",
    )
    p.add_argument("--data", required=True, help="manifest.json from `grt data prepare` (every run reads it)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokens", type=float, default=1e6, help="training tokens per run (default 1e6)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=0,
        metavar="S",
        help="size the tokens per run by measurement (instead of --tokens) so that the whole command "
        "finishes within S seconds: each run's step is timed first; needs --nproc 1 --parallel 1",
    )
    p.add_argument(
        "--min-tokens",
        type=float,
        default=1e6,
        help="with --time-budget: warn when the budget affords fewer tokens per run (default 1e6)",
    )
    p.add_argument("--timing-steps", type=int, default=3, help="with --time-budget: timed steps per depth (default 3)")
    p.add_argument(
        "--exit-depth-factor",
        type=int,
        default=1,
        metavar="F",
        help="early exit at r = 0..F*R on each final checkpoint (default 1: the trainer's r = 0..R)",
    )
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (min = lr / 10, warmup 5%%)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--match",
        choices=("none", "flops", "params"),
        default="none",
        help="adjust layouts to the reference's forward FLOPs per token or parameter count",
    )
    p.add_argument("--reference", help="label of the reference config (default: the first)")
    p.add_argument("--ds-config", default=str(PROJECT_ROOT / "ds_configs" / "zero2.json"))
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (local processes)")
    p.add_argument("--parallel", type=int, default=1, help="runs trained at the same time (default 1)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS per process (0: leave as is)")
    p.add_argument("--tag", default="", help="name suffix of the table/JSON/plot files (comparison-TAG.md ...)")
    p.add_argument("--evals", type=int, default=4, help="validation evaluations per run")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5, help="TensorBoard logging interval (tokens/s, memory)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every run, e.g. model.d_model=64 or train.lr=1e-3 (repeatable)",
    )
    p.add_argument("--retrain", action="store_true", help="train again runs that already finished")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the runs (layout, params, FLOPs), check each as `grt train --dry-run` does, and exit",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    suffix = f"-{args.tag}" if args.tag else ""
    try:
        if args.time_budget and (args.nproc != 1 or args.parallel != 1):
            raise ConfigError(
                "--time-budget times one process training one run at a time: use it with --nproc 1 --parallel 1"
            )
        if args.exit_depth_factor < 1 or args.timing_steps < 1:
            raise ConfigError("--exit-depth-factor and --timing-steps must be >= 1")
        runs = build_runs(args, args.tokens if args.dry_run else sized_tokens(args, out, suffix, started))
        if args.dry_run:  # each run as `grt train --dry-run` checks it
            from pretrain.training.trainer import dry_run

            checks = [dry_run(run["cfg"], resume=True) for run in runs]
    except (ConfigError, ValueError, OSError) as err:
        print(f"grt compare: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the step timing or the start-up probe failed
        print(f"grt compare: {err}", file=sys.stderr)
        return 3
    from data_pipeline.manifest import Manifest

    seq_len = Manifest.load(args.data).seq_len
    for run in runs:
        run["nproc"] = args.nproc
        c = run["cfg"]
        print(
            f"{run['label']:<24} {c.model.variant:<7} {c.model.layout:<10} params {model_params(c.model):>10,}  "
            f"fwd FLOPs/token {flops_per_token(c.model, seq_len) / 1e6:8.2f}M  steps {c.train.steps}  "
            f"depth {c.train.depth_sampling if c.model.max_loops else '-'}",
            flush=True,
        )
    if args.dry_run:
        print("\n".join(f"{run['label']}: {check}" for run, check in zip(runs, checks)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    for run in runs:
        run_dir = Path(run["cfg"].out)
        saved = run_dir / "compare_run_config.json"
        if not args.retrain and saved.is_file() and RunConfig.load(saved).to_dict() != run["cfg"].to_dict():
            print(
                f"grt compare: error: {run_dir} holds a run of a different config; pass --retrain to replace it "
                "or choose another --out",
                file=sys.stderr,
            )
            return 2
        if args.retrain or not (run_dir / "summary.json").is_file():
            if args.retrain and run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            todo.append(run)
    try:
        walls = train_all(todo, args, out)
    except RuntimeError as err:
        print(f"grt compare: {err}", file=sys.stderr)
        return 3
    rows = [collect(run, seq_len, walls.get(run["label"]), args.exit_depth_factor) for run in runs]
    text = table(rows)
    print()
    print(text)
    atomic_write_text(out / f"comparison{suffix}.md", text + "\n")
    manifest = Manifest.load(args.data)
    data = {
        "train_fingerprint": manifest.fingerprint("train"),
        "vocab_size": manifest.vocab_size,
        "seq_len": seq_len,
        "tokenizer_sha256": manifest.tokenizer_sha256,
    }
    sizing_path = out / f"sizing{suffix}.json"
    sizing = json.loads(sizing_path.read_text()) if args.time_budget and sizing_path.is_file() else None
    atomic_write_text(
        out / f"comparison{suffix}.json",
        json.dumps(
            {"data": data, "argv": list(argv if argv is not None else sys.argv[1:]), "sizing": sizing, "runs": rows},
            indent=2,
        )
        + "\n",
    )
    plot(rows, out / f"loss_curves{suffix}.png")
    if sizing and walls:
        print(
            f"\ntime: planned {sizing['planned_s']:.0f} s for the runs, they took {sum(walls.values()):.0f} s; "
            f"the command ran {time.time() - started:.0f} s of its --time-budget {args.time_budget:.0f} s"
        )
    written = ", ".join(
        str(out / f"{name}{suffix}.{ext}")
        for name, ext in (("comparison", "md"), ("comparison", "json"), ("loss_curves", "png"))
    )
    print(f"\nwrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
