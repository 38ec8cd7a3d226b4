"""`grt compare --seeds`: the same comparison trained once per seed, tabulated as mean and spread
per method, and the paper's orderings (and each control against its base) checked against the
seed spread.

Two methods are compared by their PAIRED difference: b - a in each seed (the runs of one seed share
the data order and the initial draw), then the mean and standard deviation of those differences.
An ordering "b below a" holds beyond seed spread when b is below a in every seed and the mean
difference is larger than its standard deviation; it is reversed under the same rule with the sign
turned; otherwise it is within the spread. One seed has no spread: its difference is shown, with no
verdict. Beside each, the seeds a paired comparison would need to detect the paper's difference at
the spread measured here (`seeds_needed`).
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist
from typing import Any

from pretrain.tools.compare.controls import CONTROLS
from pretrain.tools.compare.table import row_health

# the paper's orderings among the presets of the tiny ablation ladder (GRT_SPEC.md section 4): each
# rung lowers the loss; the GRT beats its ungated neighbour and the dense model of equal FLOPs.
# (a, b, the claim "b below a", the paper's b - a)
PAPER_ORDERINGS: tuple[tuple[str, str, str, float | None], ...] = (
    ("ladder-0-loop-only", "ladder-1-prelude-coda", "adding prelude/coda lowers the loss", -0.035),
    ("ladder-1-prelude-coda", "ladder-2-noise", "adding state noise lowers the loss", -0.018),
    ("ladder-2-noise", "ladder-3-reinject", "adding prelude re-injection lowers the loss", -0.022),
    ("ladder-3-reinject", "ladder-4-gate", "adding the gate lowers the loss: GRT below its ungated neighbour", -0.048),
    ("tiny-dense", "ladder-4-gate", "the GRT is below the dense model of equal FLOPs (3.141 vs 3.157)", -0.016),
    ("ladder-0-loop-only", "tiny-dense", "the dense model is below loop only", -0.107),
)
ALPHA, POWER = 0.05, 0.80  # seeds_needed: a two-sided test at 5%, 80% power


def seeds_needed(sd: float | None, delta: float | None, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds for a paired comparison to detect a true mean difference `delta` at the per-seed
    differences' standard deviation `sd`: the paired t-test's sample size by Guenther's (1981)
    approximation, n = ((z_{1-alpha/2} + z_{power}) * sd / delta)^2 + z_{1-alpha/2}^2 / 2, rounded
    up (at least 2, the fewest with a spread). None without a spread or a difference to detect."""
    if sd is None or not delta:
        return None
    z_a, z_b = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    return max(2, math.ceil(((z_a + z_b) * sd / delta) ** 2 + z_a**2 / 2))


def _spread(values: list[float]) -> float | None:
    """The standard deviation over seeds; None for one seed (no spread to give)."""
    return statistics.stdev(values) if len(values) > 1 else None


def _cell(values: list[float], spec: str = ".3f") -> str:
    if not values:
        return "-"
    spread = _spread(values)
    mean = format(statistics.mean(values), spec)
    return f"{mean} (1 seed)" if spread is None else f"{mean} ± {format(spread, spec)}"


def by_label(per_seed: dict[int, list[dict[str, Any]]]) -> dict[str, dict[int, dict[str, Any]]]:
    """{label: {seed: row}} from each seed's rows (pretrain/tools/compare/table.py `collect`)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for seed, rows in per_seed.items():
        for row in rows:
            out.setdefault(row["label"], {})[seed] = row
    return out


def seed_table(per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """Markdown: per method, the mean ± standard deviation over seeds of the validation loss, what the
    loop's steps after the first add (L(1) - L(R), pretrain/infer/loop_health.py: depth 0 is never
    trained, out of it), the mean gate at each loop step, and the loss at each exit depth."""
    lines = [
        "| method | label | layout | seeds | val loss | loop: steps after the first, L(1) - L(R) (nats) "
        "| gate mean by step | val loss by exit depth (0 untrained) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in by_label(per_seed).items():
        rows = list(runs.values())
        healths = [h for h in map(row_health, rows) if h is not None]
        gates = [h.gate_means for h in healths if h.gate_means]
        gate_cell = (
            " / ".join(f"{statistics.mean(g[i] for g in gates):.3f}" for i in range(len(gates[0]))) if gates else "-"
        )
        depths = sorted({int(d) for r in rows for d in r["val_loss_by_depth"]}) if rows[0]["loops"] else []
        exits = " / ".join(
            f"{statistics.mean(r['val_loss_by_depth'][d] for r in rows if d in r['val_loss_by_depth']):.3f}"
            for d in depths
        )
        later = [h.gain_after_first for h in healths if h.gain_after_first is not None]
        lines.append(
            f"| {rows[0]['method']} | {label} | {rows[0]['layout']} | {len(rows)} | "
            f"{_cell([r['val_loss'] for r in rows if r['val_loss'] is not None])} | "
            f"{_cell(later)} | {gate_cell} | {exits or '-'} |"
        )
    return "\n".join(lines)


def ordering_verdict(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The paired comparison of b with a over the seeds both ran: {"verdict": 'holds' | 'reversed'
    | 'within spread' | 'one seed: no verdict' | 'not run', "diffs": b - a per seed, "mean", "sd"
    (None for one seed)}."""
    seeds = sorted(set(a) & set(b))
    diffs = [b[s]["val_loss"] - a[s]["val_loss"] for s in seeds]
    if not diffs:
        return {"verdict": "not run", "diffs": [], "mean": None, "sd": None}
    mean, spread = statistics.mean(diffs), _spread(diffs)
    if spread is None:
        verdict = "one seed: no verdict"
    elif all(d < 0 for d in diffs) and -mean > spread:
        verdict = "holds"
    elif all(d > 0 for d in diffs) and mean > spread:
        verdict = "reversed"
    else:
        verdict = "within spread"
    return {"verdict": verdict, "diffs": diffs, "mean": mean, "sd": spread}


def comparisons(per_seed: dict[int, list[dict[str, Any]]]) -> list[tuple[str, str, str, float | None]]:
    """(a, b, claim "b below a", the paper's b - a): the paper's orderings whose two methods were run,
    then each control against its base (pretrain/tools/compare/controls.py)."""
    runs = by_label(per_seed)
    out = [o for o in PAPER_ORDERINGS if o[0] in runs and o[1] in runs]
    for label, rows in runs.items():
        control = next(iter(rows.values())).get("control")
        if control and control["of"] in runs:
            _, claim, paper = CONTROLS[control["kind"]]
            out.append((label, control["of"], claim, paper))
    return out


def orderings_table(per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """Markdown: each comparison whose two methods were run, paired by seed, with its verdict and
    the seeds that would detect the paper's difference at this spread."""
    runs = by_label(per_seed)
    lines = [
        "| the paper says (b below a) | paper's b - a | b - a here: paired, mean ± sd over seeds | per seed | here "
        f"| seeds to detect the paper's b - a ({POWER:.0%} power, alpha {ALPHA}) |",
        "|---|---|---|---|---|---|",
    ]
    for a, b, claim, paper in comparisons(per_seed):
        v = ordering_verdict(runs[a], runs[b])
        if v["mean"] is None:
            continue
        diff = f"{v['mean']:+.3f}" + ("" if v["sd"] is None else f" ± {v['sd']:.3f}")
        per = ", ".join(f"{d:+.3f}" for d in v["diffs"])
        need = seeds_needed(v["sd"], paper)
        lines.append(
            f"| {claim} (a = {a}, b = {b}) | {'-' if paper is None else f'{paper:+.3f}'} | {diff} | {per} | "
            f"{v['verdict']} | {'-' if need is None else need} |"
        )
    return "\n".join(lines)
