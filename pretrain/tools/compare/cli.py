"""`grt compare`: train several methods on the same shards for the same number of tokens
(each with `grt train`, one run directory per method), then tabulate and plot.

    grt compare --data shards/manifest.json --out runs/compare \\
        --configs tiny-grt,tiny-dense,tiny-huginn,tiny-rrt,tiny-ouro,tiny-mor --tokens 2e6 \\
        --match flops --set model.d_model=64 --set model.n_heads=2

A config is a preset name or a JSON file: a model config, or {"label": ..., "model":
<preset name or model config>, "train": {...overrides}}; or a control of one, `CONFIG:CONTROL`
(`tiny-grt:dense-params`, `:dense-flops`, `:dense-train-flops`, `:r1`, `:fixed`, `:paper-start`:
pretrain/tools/compare/controls.py), labelled CONFIG-CONTROL. `--match flops` changes each
looped config's loop count R (a dense config's layer count) to come closest to the
reference's forward FLOPs per token (the first config, or --reference); `--match params`
changes the core size C (dense: the layer count) to come closest to its parameter count.
Each method trains with its own recipe (its Variant's, pretrain/variants/, as `grt train
--preset` does; override with --set or a JSON config): GRT and the ladder r ~ U{1..R}, Huginn
the heavy-tail Poisson, RRT, Ouro and MoR the full depth R.

Writes <out>/<label>/ (the run: config.json, metrics.jsonl, summary.json, tb/),
<out>/comparison.json, <out>/comparison.md (the table) and <out>/loss_curves.png.
Runs that already finished (summary.json written, not by a stop on a signal) are not trained again, so the table
and plot can be rebuilt with the same command; an interrupted run is resumed from its last
evaluation (each run saves a checkpoint there, the last one kept).

`--time-budget S` sizes the tokens by measurement instead of --tokens, so that the whole
command finishes within S seconds (pretrain/tools/compare/sizing.py). `--exit-depth-factor 2`
adds the early-exit curve beyond the trained R, up to 2R, evaluated on each final checkpoint.
Every looped run's final checkpoint also gets the loss at 2R and 4R, per-token adaptive
exit at fixed thresholds, and for Ouro its learned exit (pretrain/tools/compare/final_eval.py).
The runs train as `grt train` processes (pretrain/tools/compare/runs.py); their results are
collected and tabulated in pretrain/tools/compare/table.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from grt_common.files import atomic_write_text
from pretrain.model.flops import flops_per_token
from pretrain.model_config import ModelConfig, load_json_object
from pretrain.presets import PRESETS, get_preset
from pretrain.runs.config_layers import apply_overrides, apply_recipe, choose_model, is_model_override
from pretrain.runs.run_config import RunConfig, resolve
from pretrain.runs.train_config import budget_steps, saving_keys
from pretrain.tools.compare.command_line import build_parser as build_parser  # the command's parser, here too
from pretrain.tools.compare.command_line import check_comparison_folder, check_flags_and_sets, parse_args
from pretrain.tools.compare.controls import control_label, control_model, parse_control
from pretrain.tools.compare.plot import plot
from pretrain.tools.compare.runs import finished, other_data, train_all
from pretrain.tools.compare.sizing import match, model_params, run_tokens_per_step, sized_tokens
from pretrain.tools.compare.table import collect, table


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


def load_run(args: argparse.Namespace, spec: str, manifest: Any) -> dict[str, Any]:
    """One run of --configs: {"label", "cfg", "train"} (and "control" for `BASE:CONTROL`, derived
    from its base's resolved run: pretrain/tools/compare/controls.py)."""
    control = parse_control(spec)
    label, model, train = load_spec(control[0] if control else spec)
    cfg = RunConfig(data=str(args.data), ds_config=args.ds_config, out=str(Path(args.out) / label))
    choose_model(cfg, model, args.overrides)  # as `grt train --preset` does
    resolve(cfg, manifest)  # the trainer's rule: the tokenizer's vocabulary, a context that holds the shards
    if control is None:
        return {"label": label, "cfg": cfg, "train": train}
    base_label, kind = label, control[1]
    for key, value in train.items():  # the base's recipe as it trains (its depth draws set the FLOPs)
        apply_overrides(cfg, [f"train.{key}={json.dumps(value) if not isinstance(value, str) else value}"])
    model, extra = control_model(cfg, kind, manifest.seq_len)
    label = control_label(base_label, kind)
    cfg = RunConfig(data=str(args.data), ds_config=args.ds_config, out=str(Path(args.out) / label))
    choose_model(cfg, model, [])  # the base's model overrides are in it already
    resolve(cfg, manifest)
    return {"label": label, "cfg": cfg, "train": {**train, **extra}, "control": {"of": base_label, "kind": kind}}


def build_runs(args: argparse.Namespace, tokens: float) -> list[dict]:
    from data_pipeline.manifest import Manifest

    manifest = Manifest.load(args.data)
    seq_len = manifest.seq_len
    specs = [s.strip() for item in args.configs for s in item.split(",") if s.strip()]
    if not specs:
        raise ConfigError("--configs: give at least one preset or JSON file")
    runs = [load_run(args, spec, manifest) for spec in specs]
    labels = [run["label"] for run in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f'--configs: labels must be unique, got {labels} (give JSON configs a "label")')
    if args.match != "none":
        ref_label = args.reference or labels[0]
        if ref_label not in labels:
            raise ConfigError(f"--reference {ref_label!r} is not one of the labels {labels}")
        ref = next(r for r in runs if r["label"] == ref_label)["cfg"].model
        target = flops_per_token(ref, seq_len) if args.match == "flops" else model_params(ref)
        for run in runs:
            if run["label"] != ref_label and "control" not in run:  # a control is sized by its own rule
                before = run["cfg"].model.layout
                run["cfg"].model = match(run["cfg"].model, target, args.match, seq_len)
                run["matched_from"] = before
                apply_recipe(run["cfg"])  # the recipe of the matched model (Huginn's Poisson mean follows R)
    steps = budget_steps(float(tokens), run_tokens_per_step(args, seq_len))
    for run in runs:
        cfg = run["cfg"]
        t = cfg.train
        t.steps, t.micro_batch_size, t.grad_accum = steps, args.micro_batch_size, args.grad_accum
        t.lr, t.min_lr, t.warmup_steps = args.lr, args.lr / 10, max(1, int(0.05 * steps))
        t.seed, t.log_every = args.seed, args.log_every
        t.eval_every = max(1, steps // max(1, args.evals))
        # a checkpoint at each evaluation, the last one kept: a comparison cut off (a machine lost, a
        # job's time up) resumes its runs from there, not from step 0
        t.eval_batches, t.save_every, t.keep_checkpoints = args.eval_batches, t.eval_every, 1
        for key, value in run["train"].items():
            apply_overrides(cfg, [f"train.{key}={json.dumps(value) if not isinstance(value, str) else value}"])
        apply_overrides(cfg, [s for s in args.overrides if not is_model_override(s)])
        cfg.validate()
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_flags_and_sets(args)
    except ConfigError as err:
        print(f"grt compare: error: {err}", file=sys.stderr)
        return 2
    if not args.seeds:
        return compare(args, argv)[0]
    import copy

    from pretrain.tools.compare.seeds import orderings_table, seed_table

    per_seed: dict[int, list[dict]] = {}
    for seed in args.seeds:
        one = copy.copy(args)
        one.seed, one.out = seed, str(Path(args.out) / f"seed-{seed}")
        print(f"\n== seed {seed}: {one.out}", flush=True)
        rc, per_seed[seed] = compare(one, argv)
        if rc or args.dry_run:
            return rc
    command = "grt compare " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        f"{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}), mean ± standard deviation; command: `{command}`"
        f"\n\n{seed_table(per_seed)}\n\n{orderings_table(per_seed)}\n"
    )
    print("\n" + text)
    atomic_write_text(Path(args.out) / f"seeds{f'-{args.tag}' if args.tag else ''}.md", text)
    return 0


def compare(args: argparse.Namespace, argv: list[str] | None) -> tuple[int, list[dict]]:
    """One comparison (one seed): (exit code, the table's rows)."""
    started = time.time()
    out = Path(args.out)
    suffix = f"-{args.tag}" if args.tag else ""
    try:
        check_comparison_folder(out, str(args.data))
        if args.time_budget and (args.nproc != 1 or args.parallel != 1):
            raise ConfigError(
                "--time-budget times one process training one run at a time: use it with --nproc 1 --parallel 1"
            )
        if args.exit_depth_factor < 1 or args.timing_steps < 1:
            raise ConfigError("--exit-depth-factor and --timing-steps must be >= 1")
        tokens = float(args.tokens)
        if args.time_budget and not args.dry_run:
            tokens = sized_tokens(args, build_runs(args, args.min_tokens), out, suffix, started)
        runs = build_runs(args, tokens)
        if args.dry_run:  # each run as `grt train --dry-run` checks it
            from pretrain.training.trainer import dry_run

            checks = [dry_run(run["cfg"], resume=True)[0] for run in runs]
    except (ConfigError, ValueError, OSError) as err:
        print(f"grt compare: error: {err}", file=sys.stderr)
        return 2, []
    except RuntimeError as err:  # the step timing or the start-up probe failed
        print(f"grt compare: {err}", file=sys.stderr)
        return 3, []
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
        return 0, []
    out.mkdir(parents=True, exist_ok=True)
    try:
        walls = train_all(runs_to_train(runs, args.retrain), args, out)
    except ConfigError as err:
        print(f"grt compare: error: {err}", file=sys.stderr)
        return 2, []
    except RuntimeError as err:
        print(f"grt compare: {err}", file=sys.stderr)
        return 3, []
    rows = [collect(run, seq_len, walls.get(run["label"]), args.exit_depth_factor) for run in runs]
    write_results(args, argv, rows, walls, started)
    return 0, rows


def trained_as(cfg: RunConfig) -> dict[str, Any]:
    """The run config that decides what a run trains: all of it but how often and where it is saved
    (`saving_keys`): a run saved at another cadence (an older compare saved only at the end) is the same run."""
    d, saving = cfg.to_dict(), saving_keys()
    d["train"] = {k: v for k, v in d["train"].items() if k not in saving}
    return d


def runs_to_train(runs: list[dict], retrain: bool) -> list[dict]:
    """The runs not finished in their folders (all of them with `retrain`, their folders removed); a
    folder that holds a run of another config, or of other data (by identity, not by its path: a
    dataset prepared again there), is a ConfigError."""
    todo = []
    for run in runs:
        run_dir = Path(run["cfg"].out)
        saved = run_dir / "compare_run_config.json"
        if not retrain and saved.is_file() and trained_as(RunConfig.load(saved)) != trained_as(run["cfg"]):
            raise ConfigError(
                f"{run_dir} holds a run of a different config; pass --retrain to replace it or choose another --out"
            )
        changed = None if retrain else other_data(run_dir, run["cfg"].data)
        if changed is not None:
            raise ConfigError(
                f"{run_dir} holds a run trained on other data than {run['cfg'].data} ({changed}); "
                "pass --retrain to replace it or choose another --out"
            )
        if retrain or not finished(run_dir):
            if retrain and run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            todo.append(run)
    return todo


def write_results(
    args: argparse.Namespace, argv: list[str] | None, rows: list[dict], walls: dict[str, float], started: float
) -> None:
    """The comparison's table (printed, and <out>/comparison.md), its record (comparison.json: the
    data's identity, the command line, the time budget's sizing, the rows) and its loss curves."""
    from data_pipeline.manifest import Manifest

    out, suffix = Path(args.out), f"-{args.tag}" if args.tag else ""
    text = table(rows)
    print()
    print(text)
    atomic_write_text(out / f"comparison{suffix}.md", text + "\n")
    manifest = Manifest.load(args.data)
    data = {
        "train_fingerprint": manifest.fingerprint("train"),
        "vocab_size": manifest.vocab_size,
        "seq_len": manifest.seq_len,
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


if __name__ == "__main__":
    sys.exit(main())
