"""`grt compare`'s results: each finished run's summary, metrics and TensorBoard curves collected
into one row (with the final checkpoint's early-exit, extrapolation and adaptive-exit evaluations),
and the rows as the Markdown table of comparison.md."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.infer.loop_health import LoopHealth, loop_health, run_settings
from pretrain.model.flops import flops_per_token, train_flops_per_token
from pretrain.model_config import ModelConfig
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import tokens_per_step
from pretrain.tools.compare.final_eval import ADAPTIVE_EXITS, EXTRAPOLATION_FACTORS, adaptive_label, final_evals
from pretrain.tools.compare.sizing import model_params
from pretrain.variants import get_variant


def describe_method(cfg: ModelConfig) -> str:
    return get_variant(cfg.variant).describe(cfg)


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
    step_tokens = tokens_per_step(cfg.train, max(1, run.get("nproc", 1)), seq_len)
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
        "loop": summary.get("loop"),  # the loop's health at the last validation (pretrain/infer/loop_health.py)
        "loop_settings": run_settings(cfg.model, cfg.train.depth_sampling, cfg.train.max_train_depth) if r else None,
        "control": run.get("control"),  # {"of": label, "kind": ...} for a control (pretrain/tools/compare/controls.py)
        "exit_curve": evals.get("exit_curve"),
        "extrapolation": evals.get("extrapolation"),
        "adaptive_exit": evals.get("adaptive_exit"),
        "learned_exit": evals.get("learned_exit"),
        "val_curve": [(s, v) for s, v in tb.get("val/loss", [])],
        "train_curve": [(rec["step"], rec["loss"]) for rec in records],
        "tokens_per_step": step_tokens,
        "steps": summary.get("steps"),
        "tokens": summary.get("steps", 0) * step_tokens,
        "tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,  # median: windows with an eval are slow
        "peak_memory_mb": max(peak) / 2**20 if peak else None,
        "wall_s": wall_s,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _at_steps(result: dict | None) -> str:
    return "-" if not result else f"{result['loss']:.3f} @ {result['mean_steps']:.2f}"


def row_health(row: dict) -> LoopHealth | None:
    """A row's loop health, from its validation loss by depth on the depths its run trained at (the
    final record's verdict, computed again so that a run saved under an older verdict reads alike)."""
    if not row.get("loops"):
        return None
    gates = (row.get("loop") or {}).get("gate_mean_by_step") or []
    return loop_health(row["val_loss_by_depth"], gates, None, row["loops"], row.get("loop_settings"))


def _loop_cell(row: dict) -> str:
    """The loop's health: what the steps after the first add, where the loss stops falling, the
    mean gate at step 1, the verdict."""
    health = row_health(row)
    if health is None:
        return "-"
    gate = f", gate@1 {health.gate_means[0]:.3f}" if health.gate_means else ""
    if health.gain_after_first is None:
        return ("R = 1" if health.first == health.loops == 1 else "fixed R: none trained below R") + gate
    stop = health.stops_after
    where = f", flat after step {stop}" if stop is not None else ", falls to R"
    return f"{health.gain_after_first:+.3f}{where}{gate}{'' if health.used else ' (add nothing)'}"


def table(rows: list[dict]) -> str:
    rules = " / ".join(adaptive_label(*a) for a in ADAPTIVE_EXITS)
    beyond = " / ".join(f"{f}R" for f in EXTRAPOLATION_FACTORS)
    head = (
        "| method | label | layout | params | fwd MFLOPs/tok | train MFLOPs/tok | val loss | "
        "loop: steps after the first, L(1) - L(R) (nats) | "
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
            f"{r['train_flops_per_token'] / 1e6:.2f} | {_fmt(r['val_loss'], '.3f')} | {_loop_cell(r)} | "
            f"{exits} | {beyond} | "
            f"{adaptive} | {_at_steps(r.get('learned_exit'))} | "
            f"{_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['peak_memory_mb'], ',.0f')} |"
        )
    return "\n".join(lines)
