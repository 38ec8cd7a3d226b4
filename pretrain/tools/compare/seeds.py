"""`grt compare --seeds`: the same comparison trained once per seed, tabulated as mean and spread
per method, and the paper's orderings checked against the seed spread.

An ordering "b below a" holds beyond seed spread when b's validation loss is below a's in every
seed (the runs of one seed share the data order and the initial draw) and the mean of the paired
differences is larger than their standard deviation; it is reversed under the same rule with the
sign turned; otherwise it is within the spread.
"""

from __future__ import annotations

import statistics
from typing import Any

# the paper's orderings among the presets of the tiny ablation ladder (GRT_SPEC.md section 4): each
# rung lowers the loss; the GRT beats its ungated neighbour and the dense model of equal FLOPs
PAPER_ORDERINGS = (
    ("ladder-0-loop-only", "ladder-1-prelude-coda", "adding prelude/coda lowers the loss (-0.035)"),
    ("ladder-1-prelude-coda", "ladder-2-noise", "adding state noise lowers the loss (-0.018)"),
    ("ladder-2-noise", "ladder-3-reinject", "adding prelude re-injection lowers the loss (-0.022)"),
    ("ladder-3-reinject", "ladder-4-gate", "adding the gate lowers the loss (-0.048): GRT below its ungated neighbour"),
    ("tiny-dense", "ladder-4-gate", "the GRT is below the dense model of equal FLOPs (3.141 vs 3.157)"),
    ("ladder-0-loop-only", "tiny-dense", "the dense model is below loop only (0.107)"),
)


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: list[float], spec: str = ".3f") -> str:
    if not values:
        return "-"
    return f"{format(statistics.mean(values), spec)} ± {format(_spread(values), spec)}"


def by_label(per_seed: dict[int, list[dict[str, Any]]]) -> dict[str, dict[int, dict[str, Any]]]:
    """{label: {seed: row}} from each seed's rows (pretrain/tools/compare/table.py `collect`)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for seed, rows in per_seed.items():
        for row in rows:
            out.setdefault(row["label"], {})[seed] = row
    return out


def seed_table(per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """Markdown: per method, the mean ± standard deviation over seeds of the validation loss, the
    loop's gain (depth 0 -> R) and the mean gate at each loop step, and the loss at each exit depth."""
    lines = [
        "| method | label | layout | seeds | val loss | loop gain (nats) | gate mean by step "
        "| val loss by exit depth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in by_label(per_seed).items():
        rows = list(runs.values())
        loops = [r["loop"] for r in rows if r.get("loop")]
        gates = [lp["gate_mean_by_step"] for lp in loops if lp.get("gate_mean_by_step")]
        gate_cell = (
            " / ".join(f"{statistics.mean(g[i] for g in gates):.3f}" for i in range(len(gates[0]))) if gates else "-"
        )
        depths = sorted({int(d) for r in rows for d in r["val_loss_by_depth"]}) if rows[0]["loops"] else []
        exits = " / ".join(
            f"{statistics.mean(r['val_loss_by_depth'][d] for r in rows if d in r['val_loss_by_depth']):.3f}"
            for d in depths
        )
        lines.append(
            f"| {rows[0]['method']} | {label} | {rows[0]['layout']} | {len(rows)} | "
            f"{_cell([r['val_loss'] for r in rows if r['val_loss'] is not None])} | "
            f"{_cell([lp['gain'] for lp in loops])} | {gate_cell} | {exits or '-'} |"
        )
    return "\n".join(lines)


def ordering_verdict(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> tuple[str, float, float]:
    """('holds' | 'reversed' | 'within spread', mean of b - a, its standard deviation) over the seeds
    both ran."""
    diffs = [b[s]["val_loss"] - a[s]["val_loss"] for s in sorted(set(a) & set(b))]
    if not diffs:
        return "not run", float("nan"), float("nan")
    mean, spread = statistics.mean(diffs), _spread(diffs)
    if all(d < 0 for d in diffs) and -mean > spread:
        return "holds", mean, spread
    if all(d > 0 for d in diffs) and mean > spread:
        return "reversed", mean, spread
    return "within spread", mean, spread


def orderings_table(per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """Markdown: each of the paper's orderings whose two methods were run, with its verdict."""
    runs = by_label(per_seed)
    lines = ["| the paper says | b - a (val loss, mean ± sd over seeds) | here |", "|---|---|---|"]
    for a, b, claim in PAPER_ORDERINGS:
        if a in runs and b in runs:
            verdict, mean, spread = ordering_verdict(runs[a], runs[b])
            lines.append(f"| {claim} (a = {a}, b = {b}) | {mean:+.3f} ± {spread:.3f} | {verdict} |")
    return "\n".join(lines)
