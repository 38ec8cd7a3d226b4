"""The figures of `grt compare` (loss_curves.png) and `grt analyze` (gates.png, buckets.png) are
worth looking at: each panel its own y-range, every line in a legend that covers no line, loop
steps ticked at whole numbers, and the training curve smoothed without lag on a short run."""

import pytest

from pretrain.infer.analyze import report as analyze_report
from pretrain.tools.compare import plot as compare_plot


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save, kept open for the test."""
    saved = {}
    for module in (compare_plot, analyze_report):
        monkeypatch.setattr(module, "atomic_savefig", lambda fig, path, **kw: saved.setdefault(path.name, fig))
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig: None)
    return saved


def run_row(label, variant, steps=39, final=3.0):
    return {
        "label": label,
        "variant": variant,
        "val_loss": final,
        "val_loss_by_depth": {"0": 5.0, "1": 4.0, "2": 3.5, "3": final} if variant == "grt" else {"0": final},
        "val_curve": [(10, 4.5), (39, final)],
        "train_curve": [(s, 8.0 if s < 20 else 6.0) for s in range(1, steps + 1)],
        "tokens_per_step": 512,
    }


def test_the_smoothing_follows_a_short_run_without_lag():
    values = [8.0] * 19 + [6.0] * 20  # a 39-step run whose loss drops at step 20
    smoothed, window = compare_plot.smooth(values)
    assert window == 3 and smoothed[20] == 6.0  # one step after the drop (an EMA of 0.9 lags ten)
    assert smoothed[:18] == values[:18] and smoothed[-1] == 6.0
    assert compare_plot.smooth([1.0] * 1000)[1] == 41  # scaled to the run: 4% of its steps


def test_loss_curves_panels_have_their_own_range_and_label_every_line(figures, tmp_path):
    rows = [run_row("tiny-grt", "grt"), run_row("tiny-dense", "dense", final=3.2)]
    compare_plot.plot(rows, tmp_path / "loss_curves.png")
    fig = figures["loss_curves.png"]
    train, val, exit_ = fig.axes
    fig.canvas.draw()
    ranges = [ax.get_ylim() for ax in (train, val, exit_)]
    assert len(set(ranges)) == 3
    assert ranges[0][0] <= 6.0 and ranges[0][1] >= 8.0  # each holds its own data
    assert ranges[2][0] <= 3.0 and ranges[2][1] >= 5.0 and ranges[2][1] < 8.0
    for ax in (train, val, exit_):
        legend = ax.get_legend()
        labels = [t.get_text() for t in legend.get_texts()]
        assert len(labels) == len(ax.get_lines()) and all(labels), labels  # every line named
        assert not legend.get_window_extent().overlaps(ax.get_window_extent())  # under the panel
    assert "tiny-dense (dense, all layers)" in [t.get_text() for t in exit_.get_legend().get_texts()]
    assert all(float(t).is_integer() for t in exit_.get_xticks())


def test_gates_and_buckets_tick_loop_steps_at_whole_numbers_and_keep_the_legend_off_the_lines(figures, tmp_path):
    res = {
        "trained_loops": 3,
        "early_exit": {"grt": {"flops_per_token": [1e6, 2e6], "loss": [5.0, 4.0], "depths": [0, 3], "layout": "x"}},
        "cka": None,
        "buckets": {"rare": {"recovered_by_step": [0.1, 0.2, 0.3]}},
        "gate_mean_by_step": [0.99, 0.99, 0.99],
        "gate_state_share_by_step": [0.6, 0.58, 0.56],
    }
    analyze_report.plots(res, tmp_path)
    for name in ("gates.png", "buckets.png"):
        fig = figures[name]
        fig.canvas.draw()
        (ax,) = fig.axes
        assert [float(t) for t in ax.get_xticks() if 1 <= t <= 3] == [1.0, 2.0, 3.0], name
        assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent()), name
    (gates,) = figures["gates.png"].axes
    assert gates.get_ylim()[1] > 0.99 + 0.01  # the mean gate is drawn inside the frame, not on it
