"""`grt compare`'s figure, loss_curves.png: the training loss, the validation loss at full depth
and the validation loss by loop steps of every run, one colour per run. Each panel has its own
y-range and its own legend (under it, off the lines); the training curve is smoothed over a share
of the run's length, centred, so that it neither lags nor depends on how long the run was."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grt_common.files import atomic_savefig
from pretrain.variants import get_variant

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SMOOTH_SHARE = 0.04  # the training curve's window: this share of the run's logged steps


def smooth(values: list[float], share: float = SMOOTH_SHARE) -> tuple[list[float], int]:
    """(the centred moving mean of values over an odd window of `share` of them, the window)."""
    window = max(1, round(len(values) * share)) | 1
    half, prefix = window // 2, [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)  # shorter at the ends: no lag there either
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out, window


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_train, ax_val, ax_exit) = plt.subplots(1, 3, figsize=(18, 6))
    windows = set()
    for r in rows:
        curve = [(step, loss) for step, loss in r["train_curve"] if math.isfinite(loss)]
        ys, window = smooth([loss for _, loss in curve])
        windows.add(window)
        xs = [step * r["tokens_per_step"] / 1e6 for step, _ in curve]
        style = "--" if r["label"].startswith("ladder") else "-"
        (line,) = ax_train.plot(xs, ys, style, label=r["label"], linewidth=1.2)
        if r["val_curve"]:
            ax_val.plot(
                [s * r["tokens_per_step"] / 1e6 for s, _ in r["val_curve"]],
                [v for _, v in r["val_curve"]],
                style + "o",
                color=line.get_color(),
                label=r["label"],
                markersize=3,
            )
        # depths are ints in a live run, strings once read back from comparison.json
        exits = {
            int(d): v
            for d, v in {**(r.get("exit_curve") or r["val_loss_by_depth"]), **(r.get("extrapolation") or {})}.items()
        }
        if exits and get_variant(r["variant"]).looped:
            depths = sorted(exits)
            ax_exit.plot(
                depths, [exits[d] for d in depths], style + "o", color=line.get_color(), label=r["label"], markersize=3
            )
        elif r["val_loss"] is not None:  # a dense model has no loop steps: its loss at every layer, level
            ax_exit.axhline(
                r["val_loss"], color=line.get_color(), linestyle=":", label=f"{r['label']} (dense, all layers)"
            )
    steps = f"{windows.pop()} logged steps" if len(windows) == 1 else f"{SMOOTH_SHARE:.0%} of each run's logged steps"
    ax_train.set(title=f"training loss (mean over {steps}, centred)", xlabel="tokens (M)", ylabel="loss")
    ax_val.set(title="validation loss at full depth", xlabel="tokens (M)", ylabel="loss")
    ax_exit.set(
        title="validation loss after r loop steps (to 4R: past the trained R)", xlabel="loop steps r", ylabel="loss"
    )
    ax_exit.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_train, ax_val, ax_exit):
        ax.grid(alpha=0.3)
        _legend_below(ax)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
    plt.close(fig)


def _legend_below(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=7, frameon=False)
