"""`grt eval`'s results as a table (a row per exit depth, a column per measure; the adaptive
exit's thresholds below it) and as a plot of the loss against the exit depth."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


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

    from grt_common.files import atomic_savefig

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
