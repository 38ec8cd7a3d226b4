"""`grt compare`: train several methods on the same shards for the same number of tokens
(each with `grt train`, one run directory per method), then tabulate and plot.

    grt compare --data shards/manifest.json --out runs/compare \\
        --configs tiny-grt,tiny-dense,tiny-huginn,tiny-rrt,tiny-ouro,tiny-mor --tokens 2e6 \\
        --match flops --set model.d_model=64 --set model.n_heads=2

A config is a preset name or a JSON file: a model config, or {"label": ..., "model":
<preset name or model config>, "train": {...overrides}}. `--match flops` changes each
looped config's loop count R (a dense config's layer count) to come closest to the
reference's forward FLOPs per token (the first config, or --reference); `--match params`
changes the core size C (dense: the layer count) to come closest to its parameter count.
Each method trains with its own recipe's depth sampling (METHOD_TRAIN; override with --set
or a JSON config): GRT and the ladder r ~ U{1..R}, Huginn the heavy-tail Poisson, RRT,
Ouro and MoR the full depth R.

Writes <out>/<label>/ (the run: config.json, metrics.jsonl, summary.json, tb/),
<out>/comparison.json, <out>/comparison.md (the table) and <out>/loss_curves.png.
Runs that already finished (summary.json present) are not trained again, so the table
and plot can be rebuilt with the same command; an interrupted run is resumed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pretrain.config import ConfigError, ModelConfig, load_json_object
from pretrain.presets import PRESETS, get_preset
from pretrain.training.run_config import RunConfig, apply_overrides

REPO = Path(__file__).resolve().parents[2]  # the checkout (this file is in pretrain/<pkg>/)

# each method's own training recipe for the loop depth (spec section 4 / the papers)
METHOD_TRAIN: dict[str, dict] = {
    "grt": {"depth_sampling": "uniform"},
    "dense": {},
    "huginn": {"depth_sampling": "poisson"},  # poisson_mean set from R below
    "rrt": {"depth_sampling": "fixed"},
    "ouro": {"depth_sampling": "fixed"},
    "mor": {"depth_sampling": "fixed"},
}

METHOD_NAMES = {"grt": "GRT", "dense": "dense GPT-2", "huginn": "Huginn (heavy-tail Poisson)", "rrt": "RRT",
                "ouro": "Ouro", "mor": "MoR"}


def describe_method(cfg: ModelConfig) -> str:
    if cfg.variant != "grt":
        return METHOD_NAMES[cfg.variant]
    parts = []
    layout = cfg.parsed_layout
    parts.append("prelude/coda" if layout.prelude or layout.coda else "whole stack looped")
    if cfg.state_noise_std > 0:
        parts.append("noise")
    if cfg.reinject_anchor:
        parts.append("re-injection")
    if cfg.gate:
        parts.append("gate")
    if parts == ["whole stack looped"]:
        return "loop only"
    return "GRT" if len(parts) == 4 else "loop + " + ", ".join(parts)


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
            raise ConfigError(f"config {spec!r}: unknown key(s) {', '.join(sorted(unknown))}; accepted: label, model, train")
        model = data.get("model", "tiny-grt")
        cfg = get_preset(model) if isinstance(model, str) else ModelConfig.from_dict(model)
        return str(data.get("label", cfg.name if cfg.name != "custom" else path.stem)), cfg, dict(data.get("train", {}))
    cfg = ModelConfig.from_dict(data)
    return (cfg.name if cfg.name != "custom" else path.stem), cfg, {}


def model_flops(cfg: ModelConfig, seq_len: int, n_loops: int | None = None) -> int:
    from pretrain.model.baselines import flops_per_token

    return flops_per_token(cfg, seq_len, n_loops)


def model_params(cfg: ModelConfig) -> int:
    import torch

    from pretrain.model.flops import count_params
    from pretrain.model import GPT

    with torch.device("meta"):
        return count_params(GPT(cfg))["params"]


def _with_layout(cfg: ModelConfig, **parts) -> ModelConfig:
    layout = cfg.parsed_layout
    if not layout.looped:
        return cfg.replace(layout=str(parts.get("n", layout.prelude)))
    p, c, r, k = layout.prelude, parts.get("c", layout.core), parts.get("r", layout.loops), layout.coda
    text = f"{c}x{r}" if p == 0 and k == 0 else f"{p}+{c}x{r}+{k}"
    return cfg.replace(layout=text)


def match(cfg: ModelConfig, target: float, what: str, seq_len: int) -> ModelConfig:
    """The layout change (R for looped, N for dense; C for looped under params) closest to target."""
    if what == "flops":
        key = "r" if cfg.parsed_layout.looped else "n"
        measure = lambda c: model_flops(c, seq_len)  # noqa: E731
    else:
        key = "c" if cfg.parsed_layout.looped else "n"
        measure = model_params
    best = min((_with_layout(cfg, **{key: v}) for v in range(1, 65)), key=lambda c: abs(measure(c) - target))
    return best


def build_runs(args) -> list[dict]:
    from data_pipeline.manifest import Manifest

    manifest = Manifest.load(args.data)
    seq_len = manifest.seq_len
    specs = [s for item in args.configs for s in item.split(",") if s.strip()]
    if not specs:
        raise ConfigError("--configs: give at least one preset or JSON file")
    loaded = [load_spec(s.strip()) for s in specs]
    labels = [label for label, _, _ in loaded]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--configs: labels must be unique, got {labels} (give JSON configs a \"label\")")
    runs = []
    for label, model, train in loaded:
        cfg = RunConfig(model=model, data=str(args.data), ds_config=args.ds_config, out=str(Path(args.out) / label))
        model_sets = [s for s in args.overrides if s.startswith("model.")]
        apply_overrides(cfg, model_sets)
        cfg.model.vocab_size = manifest.vocab_size
        runs.append({"label": label, "cfg": cfg, "train": train})
    if args.match != "none":
        ref_label = args.reference or labels[0]
        if ref_label not in labels:
            raise ConfigError(f"--reference {ref_label!r} is not one of the labels {labels}")
        ref = next(r for r in runs if r["label"] == ref_label)["cfg"].model
        target = model_flops(ref, seq_len) if args.match == "flops" else model_params(ref)
        for run in runs:
            if run["label"] != ref_label:
                before = run["cfg"].model.layout
                run["cfg"].model = match(run["cfg"].model, target, args.match, seq_len)
                run["matched_from"] = before
    tokens_per_step = args.micro_batch_size * args.grad_accum * args.nproc * seq_len
    steps = max(1, int(round(float(args.tokens) / tokens_per_step)))
    for run in runs:
        cfg: RunConfig = run["cfg"]
        t = cfg.train
        t.steps, t.micro_batch_size, t.grad_accum = steps, args.micro_batch_size, args.grad_accum
        t.lr, t.min_lr, t.warmup_steps = args.lr, args.lr / 10, max(1, int(0.05 * steps))
        t.seed, t.log_every = args.seed, args.log_every
        t.eval_every = max(1, steps // max(1, args.evals))
        t.eval_batches, t.save_every, t.keep_checkpoints = args.eval_batches, 0, 1
        r = cfg.model.max_loops
        for key, value in METHOD_TRAIN.get(cfg.model.variant, {}).items():
            setattr(t, key, value)
        if cfg.model.variant == "huginn":  # mean depth (rbar + 1) = GRT's mean (R + 1) / 2
            t.poisson_mean = max(0.5, (r - 1) / 2)
        for key, value in run["train"].items():
            apply_overrides(cfg, [f"train.{key}={json.dumps(value) if not isinstance(value, str) else value}"])
        apply_overrides(cfg, [s for s in args.overrides if not s.startswith("model.")])
        cfg.validate()
    return runs


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
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            if nproc > 1:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log if rank == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT))
    return procs


def _lock(run_dir: Path) -> Path:
    """Refuse to train a run that another live `grt compare` is training (same --out)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / "compare.lock"
    try:
        pid = int(lock.read_text().strip())
        os.kill(pid, 0)
        if pid != os.getpid():
            raise RuntimeError(f"{run_dir} is being trained by another grt compare (pid {pid}); wait for it, "
                               f"or remove {lock} if that process is gone")
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass  # no lock, or a stale one
    lock.write_text(f"{os.getpid()}\n")
    return lock


def train_all(todo: list[dict], args, out: Path) -> dict[str, float]:
    """Train the runs, up to --parallel at a time; {label: wall seconds}. Raises on a failed run."""
    pending, running, walls = list(todo), {}, {}
    while pending or running:
        while pending and len(running) < max(1, args.parallel):
            run = pending.pop(0)
            _lock(Path(run["cfg"].out))
            print(f"training {run['label']} ...", flush=True)
            running[run["label"]] = (start_run(run["cfg"], args.nproc, out / f"{run['label']}.log", args.threads),
                                     time.time())
        time.sleep(1.0)
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


def train_flops_per_token(cfg: ModelConfig, seq_len: int, depth: int) -> float:
    """Forward + backward (3x forward) at the sampled depth; Ouro decodes every step in training;
    Huginn differentiates only the last k steps (the others cost one forward)."""
    fwd = model_flops(cfg, seq_len, depth)
    if cfg.variant == "ouro" and depth > 1:
        layout, d = cfg.parsed_layout, cfg.d_model
        block = (8 + 4 * cfg.mlp_ratio) * d * d + 4 * seq_len * d
        fwd += (depth - 1) * (layout.coda * block + 2 * d * cfg.padded_vocab_size)
    if cfg.variant == "huginn":
        k = int(cfg.xget("backprop_steps"))
        if depth > k:
            no_grad = model_flops(cfg, seq_len, depth) - model_flops(cfg, seq_len, k)
            return 3 * fwd - 2 * no_grad
    return 3 * fwd


def collect(run: dict, seq_len: int, wall_s: float | None) -> dict:
    cfg: RunConfig = run["cfg"]
    out = Path(cfg.out)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tb = _tb_scalars(out)
    tps = [v for _, v in tb.get("perf/tokens_per_s", [])][1:] or [v for _, v in tb.get("perf/tokens_per_s", [])]
    peak = [v for _, v in tb.get("memory/peak_bytes", [])]
    by_depth = {int(k): v for k, v in summary.get("val_loss_by_depth", {}).items()}
    r = cfg.model.max_loops
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * seq_len * max(1, run.get("nproc", 1))
    train_flops = [train_flops_per_token(cfg.model, seq_len, rec.get("depth", r)) for rec in records]
    return {
        "label": run["label"], "method": describe_method(cfg.model), "variant": cfg.model.variant,
        "layout": cfg.model.layout, "matched_from": run.get("matched_from"), "d_model": cfg.model.d_model,
        "params": model_params(cfg.model), "flops_per_token": model_flops(cfg.model, seq_len),
        "train_flops_per_token": sum(train_flops) / max(1, len(train_flops)),
        "depth_sampling": cfg.train.depth_sampling if r else "-",
        "val_loss": by_depth.get(r, by_depth.get(0)) if by_depth else None,
        "val_loss_by_depth": by_depth,
        "val_curve": [(s, v) for s, v in tb.get("val/loss", [])],
        "train_curve": [(rec["step"], rec["loss"]) for rec in records],
        "tokens_per_step": tokens_per_step, "steps": summary.get("steps"),
        "tokens": summary.get("steps", 0) * tokens_per_step,
        "tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,  # median: windows with an eval are slow
        "peak_memory_mb": max(peak) / 2**20 if peak else None,
        "wall_s": wall_s,
    }


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ("| method | label | layout | params | fwd MFLOPs/tok | train MFLOPs/tok | val loss | "
            "early exit (val loss at r = 0, 1, ..., R) | tokens/s | peak mem MB |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        exits = " / ".join(f"{v:.3f}" for _, v in sorted(r["val_loss_by_depth"].items())) if r["val_loss_by_depth"] else "-"
        if r["variant"] == "dense":
            exits = "-"
        layout = r["layout"] + (f" (from {r['matched_from']})" if r.get("matched_from") and r["matched_from"] != r["layout"] else "")
        lines.append(f"| {r['method']} | {r['label']} | {layout} | {r['params']:,} | {r['flops_per_token'] / 1e6:.2f} | "
                     f"{r['train_flops_per_token'] / 1e6:.2f} | {_fmt(r['val_loss'], '.3f')} | {exits} | "
                     f"{_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['peak_memory_mb'], ',.0f')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, smooth: float = 0.9) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val, ax_exit) = plt.subplots(1, 3, figsize=(18, 5.5))
    for r in rows:
        xs, ys, ema = [], [], None
        for step, loss in r["train_curve"]:
            if not math.isfinite(loss):
                continue
            ema = loss if ema is None else smooth * ema + (1 - smooth) * loss
            xs.append(step * r["tokens_per_step"] / 1e6)
            ys.append(ema)
        style = "--" if r["label"].startswith("ladder") else "-"
        (line,) = ax_train.plot(xs, ys, style, label=r["label"], linewidth=1.2)
        if r["val_curve"]:
            ax_val.plot([s * r["tokens_per_step"] / 1e6 for s, _ in r["val_curve"]], [v for _, v in r["val_curve"]],
                        style + "o", color=line.get_color(), label=r["label"], markersize=3)
        if r["val_loss_by_depth"] and r["variant"] != "dense":
            depths = sorted(r["val_loss_by_depth"])
            ax_exit.plot(depths, [r["val_loss_by_depth"][d] for d in depths], style + "o", color=line.get_color(),
                         label=r["label"], markersize=3)
        elif r["val_loss"] is not None:
            ax_exit.axhline(r["val_loss"], color=line.get_color(), linestyle=":", label=f"{r['label']} (dense)")
    ax_train.set(title=f"training loss (EMA {smooth})", xlabel="tokens (M)", ylabel="loss")
    ax_val.set(title="validation loss at full depth", xlabel="tokens (M)", ylabel="loss")
    ax_exit.set(title="early exit: validation loss after r loop steps", xlabel="loop steps r", ylabel="loss")
    finals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
    if finals:
        lo = min(finals)
        ax_train.set_ylim(lo - 0.2, lo + 2.5)
        ax_val.set_ylim(lo - 0.1, lo + 1.5)
        ax_exit.set_ylim(lo - 0.1, lo + 2.5)
    for ax in (ax_train, ax_val, ax_exit):
        ax.grid(alpha=0.3)
    ax_train.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grt compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", action="append", required=True,
                   help="comma-separated presets or JSON files (repeatable); the first is the reference")
    p.add_argument("--data", required=True, help="manifest.json from `grt data prepare` (every run reads it)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokens", type=float, default=1e6, help="training tokens per run (default 1e6)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (min = lr / 10, warmup 5%%)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--match", choices=("none", "flops", "params"), default="none",
                   help="adjust layouts to the reference's forward FLOPs per token or parameter count")
    p.add_argument("--reference", help="label of the reference config (default: the first)")
    p.add_argument("--ds-config", default=str(REPO / "ds_configs" / "zero2.json"))
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (local processes)")
    p.add_argument("--parallel", type=int, default=1, help="runs trained at the same time (default 1)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS per process (0: leave as is)")
    p.add_argument("--tag", default="", help="name suffix of the table/JSON/plot files (comparison-TAG.md ...)")
    p.add_argument("--evals", type=int, default=4, help="validation evaluations per run")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5, help="TensorBoard logging interval (tokens/s, memory)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run, e.g. model.d_model=64 or train.lr=1e-3 (repeatable)")
    p.add_argument("--retrain", action="store_true", help="train again runs that already finished")
    p.add_argument("--dry-run", action="store_true", help="print the runs (layout, params, FLOPs) and exit")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        runs = build_runs(args)
    except (ConfigError, ValueError, OSError) as err:
        print(f"grt compare: error: {err}", file=sys.stderr)
        return 2
    from data_pipeline.manifest import Manifest

    seq_len = Manifest.load(args.data).seq_len
    for run in runs:
        run["nproc"] = args.nproc
        c = run["cfg"]
        print(f"{run['label']:<24} {c.model.variant:<7} {c.model.layout:<10} params {model_params(c.model):>10,}  "
              f"fwd FLOPs/token {model_flops(c.model, seq_len) / 1e6:8.2f}M  steps {c.train.steps}  "
              f"depth {c.train.depth_sampling if c.model.max_loops else '-'}", flush=True)
    if args.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    for run in runs:
        run_dir = Path(run["cfg"].out)
        saved = run_dir / "compare_run_config.json"
        if not args.retrain and saved.is_file() and RunConfig.load(saved).to_dict() != run["cfg"].to_dict():
            print(f"grt compare: error: {run_dir} holds a run of a different config; pass --retrain to replace it "
                  "or choose another --out", file=sys.stderr)
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
    rows = [collect(run, seq_len, walls.get(run["label"])) for run in runs]
    text = table(rows)
    print()
    print(text)
    suffix = f"-{args.tag}" if args.tag else ""
    (out / f"comparison{suffix}.md").write_text(text + "\n")
    manifest = Manifest.load(args.data)
    data = {"train_fingerprint": manifest.fingerprint("train"), "vocab_size": manifest.vocab_size,
            "seq_len": seq_len, "tokenizer_sha256": manifest.tokenizer_sha256}
    (out / f"comparison{suffix}.json").write_text(json.dumps({"data": data, "argv": list(argv if argv is not None else sys.argv[1:]),
                                                    "runs": rows}, indent=2) + "\n")
    plot(rows, out / f"loss_curves{suffix}.png")
    print(f"\nwrote {out / f'comparison{suffix}.md'}, {out / f'comparison{suffix}.json'}, {out / f'loss_curves{suffix}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
