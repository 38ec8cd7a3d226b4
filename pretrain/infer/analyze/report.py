"""`grt analyze`'s report: the plots and the Markdown of the results of
pretrain/infer/analyze/analysis.py (`analyze`), written next to its analysis.json."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from grt_common.files import atomic_savefig
from pretrain.infer.loop_health import loop_health

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plots(res: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    R = res["trained_loops"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ee = res["early_exit"]
    for key, mark, name in (("grt", "o", "GRT"), ("dense", "s", "dense")):
        if key not in ee:
            continue
        curve = ee[key]
        x = [f / 1e6 for f in curve["flops_per_token"]]
        ax.plot(x, curve["loss"], marker=mark, label=f"{name} ({curve['layout']})")
        for xi, yi, r in zip(x, curve["loss"], curve["depths"]):
            ax.annotate(str(r), (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("forward MFLOPs per token (labels: exit depth; dense: layers run)")
    ax.set_ylabel("validation loss")
    ax.set_title("early exit against compute")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, out / "loss_by_depth.png")
    files["loss_by_depth"] = "loss_by_depth.png"
    if res["cka"]:
        fig, ax = plt.subplots(figsize=(4.5, 4))
        im = ax.imshow(res["cka"], vmin=0, vmax=1, cmap="viridis")
        ax.set_xlabel("loop state s_r")
        ax.set_ylabel("loop state s_r")
        ax.set_title("linear CKA")
        fig.colorbar(im)
        _save(fig, out / "cka.png")
        files["cka"] = "cka.png"
    if res.get("cka_dense"):
        m = res["cka_dense"]["matrix"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xlabel("dense layer (0 = embeddings)")
        ax.set_ylabel("loop state s_r")
        ax.set_title("linear CKA: GRT loop states vs dense layers")
        fig.colorbar(im)
        _save(fig, out / "cka_dense.png")
        files["cka_dense"] = "cka_dense.png"
    if res["buckets"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, b in res["buckets"].items():
            ax.plot(range(1, R + 1), [100 * v for v in b["recovered_by_step"]], marker="o", label=name)
        _loop_step_axis(ax)
        ax.set_ylabel("% of depth-0 loss recovered")
        ax.grid(alpha=0.3)
        _legend_below(ax, 4)
        _save(fig, out / "buckets.png")
        files["buckets"] = "buckets.png"
    if res["gate_mean_by_step"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        steps = range(1, R + 1)
        ax.plot(steps, res["gate_mean_by_step"], marker="o", label="mean gate")
        if res["gate_state_share_by_step"]:
            ax.plot(steps, res["gate_state_share_by_step"], marker="s", label="state share of gate-input variance")
        _loop_step_axis(ax)
        ax.set_ylim(-0.02, 1.02)  # a gate near 1 drawn inside the frame, not on it
        ax.grid(alpha=0.3)
        _legend_below(ax, 1)  # the mean gate sits near 1: a legend inside the axes would cover it
        _save(fig, out / "gates.png")
        files["gates"] = "gates.png"
    return files


def _loop_step_axis(ax: Axes) -> None:
    """x: loop steps, whole numbers only (matplotlib would tick 1.5 and 2.5 at a small R)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("loop step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_below(ax: Axes, columns: int) -> None:
    """The legend under the axes, off every line."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=columns, fontsize=8, frameon=False)


def _save(fig: Figure, path: Path) -> None:
    """Lay the figure out, write it (complete or absent) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def _exit_table(name: str, curve: dict[str, Any]) -> str:
    """One model's early-exit rows: depth, FLOPs per token, loss, gain over the minimum depth."""
    unit = curve["depth_unit"]
    rows = [f"{name} (`{curve['layout']}`, depth = {unit}):", "", f"| depth ({unit}) | MFLOPs/token | loss | gain |"]
    rows.append("|---|---|---|---|")
    rows += [
        f"| {r} | {f / 1e6:.2f} | {v:.4f} | {curve['loss'][0] - v:+.4f} |"
        for r, f, v in zip(curve["depths"], curve["flops_per_token"], curve["loss"])
    ]
    return "\n".join(rows) + "\n"


def _half_line(h: dict[str, Any]) -> str:
    if h["depth"] is None:
        return "none: no exit depth at or under half the full depth's FLOPs"
    at = f"depth {h['depth']}, {h['flops'] / 1e6:.2f} of {2 * h['half_flops'] / 1e6:.2f} MFLOPs"
    if h["share"] is None:
        return f"undefined: no gain at the full depth ({at})"
    return f"{100 * h['share']:.1f}% ({at}; gain {h['gain']:.4f} of {h['full_gain']:.4f})"


def loop_verdict(res: dict[str, Any]) -> str:
    """The loop's health (pretrain.infer.loop_health) on the depths the run trained at, as training's
    validation states it, with the warning of a loop whose steps after the first add nothing (its
    advice names what the run's settings, res["loop_settings"], do not use)."""
    by_depth = {int(k): v for k, v in res["loss_by_depth"].items()}
    health = loop_health(by_depth, res["gate_mean_by_step"], None, res["trained_loops"], res.get("loop_settings"))
    if health is None:
        return "no loop"
    return health.line() + (f". {health.warning()}" if health.used is False else "")


def markdown(res: dict[str, Any], files: dict[str, str], title: str) -> str:
    """report.md: the loop's verdict, then a section per measure (those the analysis made)."""
    L = [
        f"# {title}",
        "",
        f"Layout `{res['layout']}`, R = {res['trained_loops']}; {res['tokens']:,} scored validation targets.",
        "",
        f"**Loop health**: {loop_verdict(res)}",
        "",
    ]
    for section in (_early_exit_section, _gate_sections, _cka_sections, _bucket_section, _half_section):
        L += section(res, files)
    L += ["", "Definitions: see `grt analyze --help` and docs/evaluation.md.", ""]
    return "\n".join(L)


def _early_exit_section(res: dict[str, Any], files: dict[str, str]) -> list[str]:
    """Loss by exit depth against compute, with the plot."""
    L: list[str] = []
    L += ["## Early exit: loss by exit depth, against compute", ""]
    ee = res["early_exit"]
    curves = [(name, ee[key]) for key, name in (("grt", "GRT"), ("dense", "dense")) if key in ee]
    L += [_exit_table(name, curve) for name, curve in curves]
    L += [
        f"Forward FLOPs per token at sequence length {ee['seq_len']} (the spec's formula, pretrain/model/flops.py); "
        "gain = loss at the minimum depth - loss at the depth. Share of the full-depth gain kept at half the "
        "compute (the depth with the most FLOPs not above half the full depth's; docs/evaluation.md):",
        "",
    ]
    L += [f"- {name}: {_half_line(curve['half_compute'])}" for name, curve in curves]
    if "loss_by_depth" in files:
        L += ["", f"![loss by depth]({files['loss_by_depth']})"]
    return L


def _gate_sections(res: dict[str, Any], files: dict[str, str]) -> list[str]:
    """Gate forcing, anchor replacement and the gates by loop step."""
    R = res["trained_loops"]
    L: list[str] = []
    if res["gate_forcing"]:
        g = res["gate_forcing"]
        L += [
            "",
            "## Gate forcing (at depth R)",
            "",
            "| gate | loss |",
            "|---|---|",
            f"| trained | {g['trained']:.4f} |",
            f"| forced to 0 (s_r = o_r) | {g['gate=0']:.4f} |",
            f"| forced to 1 (= prelude only, depth 0: {res['loss_by_depth'][0]:.4f}) | {g['gate=1']:.4f} |",
        ]
    L += ["", "## Anchor replacement (what the loop is fed as e, at depth R)", "", "| anchor | loss |", "|---|---|"]
    L += [f"| {a} | {v:.4f} |" for a, v in res["anchor"].items()]
    if res["gate_mean_by_step"]:
        L += [
            "",
            "## Gates by loop step",
            "",
            "| step | mean gate | state share of gate-input variance |",
            "|---|---|---|",
        ]
        shares = res["gate_state_share_by_step"] or [float("nan")] * R
        L += [f"| {r + 1} | {g:.4f} | {s:.3f} |" for r, (g, s) in enumerate(zip(res["gate_mean_by_step"], shares))]
        if "gates" in files:
            L += ["", f"![gates]({files['gates']})"]
    return L


def _cka_sections(res: dict[str, Any], files: dict[str, str]) -> list[str]:
    """Linear CKA between the loop states, and against a dense model."""
    L: list[str] = []
    if res["cka"]:
        n = len(res["cka"])
        L += [
            "",
            f"## Linear CKA between loop states s_0..s_{n - 1} ({res['cka_tokens']} tokens)",
            "",
            "| | " + " | ".join(f"s_{j}" for j in range(n)) + " |",
            "|---" * (n + 1) + "|",
        ]
        L += [f"| s_{i} | " + " | ".join(f"{v:.3f}" for v in row) + " |" for i, row in enumerate(res["cka"])]
        if "cka" in files:
            L += ["", f"![CKA]({files['cka']})"]
    if res.get("cka_dense"):
        cd = res["cka_dense"]
        L += [
            "",
            f"## Linear CKA against a dense model ({cd['layout']} layers)",
            "",
            "| loop state | best-aligned dense layer | CKA |",
            "|---|---|---|",
        ]
        L += [f"| s_{i} | {j} | {cd['matrix'][i][j]:.3f} |" for i, j in enumerate(cd["best_layer_by_state"])]
        if "cka_dense" in files:
            L += ["", f"![CKA vs dense]({files['cka_dense']})"]
    return L


def _bucket_section(res: dict[str, Any], files: dict[str, str]) -> list[str]:
    """The share of the depth-0 loss recovered per step, by token bucket."""
    R = res["trained_loops"]
    L: list[str] = []
    if res["buckets"]:
        L += [
            "",
            "## Share of the depth-0 loss recovered after each step, by token bucket",
            "",
            "| bucket | tokens | depth-0 loss | " + " | ".join(f"step {r}" for r in range(1, R + 1)) + " |",
            "|---" * (R + 3) + "|",
        ]
        for name, b in res["buckets"].items():
            L.append(
                f"| {name} | {b['tokens']} | {b['loss_by_depth'][0]:.3f} | "
                + " | ".join(f"{100 * v:.1f}%" for v in b["recovered_by_step"])
                + " |"
            )
        if "buckets" in files:
            L += ["", f"![buckets]({files['buckets']})"]
    return L


def _half_section(res: dict[str, Any], files: dict[str, str]) -> list[str]:
    """The state and anchor halves of the loop's input weights."""
    L: list[str] = []
    if res["half_cosines"]:
        L += [
            "",
            "## State half vs anchor half of the input weights",
            "",
            "| weight | cosine | mean row cosine | norm (state half) | norm (anchor half) "
            "| top singular value (state half) | top singular value (anchor half) |",
            "|---|---|---|---|---|---|---|",
        ]
        L += [
            f"| {k} | {v['cosine']:.4f} | {v['mean_row_cosine']:.4f} | {v['norm_state']:.3f} | {v['norm_anchor']:.3f} "
            f"| {v['singular_values_state'][0]:.3f} | {v['singular_values_anchor'][0]:.3f} |"
            for k, v in res["half_cosines"].items()
        ]
        L += [
            "",
            "Largest singular values of each half, in descending order:",
            "",
            "| weight | half | singular values |",
        ]
        L += ["|---|---|---|"]
        L += [
            f"| {k} | {half} | " + ", ".join(f"{x:.3f}" for x in v[f"singular_values_{half}"]) + " |"
            for k, v in res["half_cosines"].items()
            for half in ("state", "anchor")
        ]
    return L
