"""`grt compare --seeds`' aggregation (pretrain/tools/compare/seeds.py): the mean ± sd per method,
the paired difference of each ordering (and of each control against its base) with its verdict
against the seed spread, and the seeds that would detect the paper's difference."""

from __future__ import annotations

import pytest

from pretrain.tools.compare.seeds import ordering_verdict, orderings_table, seed_table, seeds_needed


def row(label: str, loss: float, later: float | None = None, control: dict | None = None) -> dict:
    """A table row (table.py `collect`); later: what the loop's steps after the first add."""
    looped = later is not None
    return {
        "label": label,
        "method": label,
        "layout": "1+2x2+1" if looped else "6",
        "loops": 2 if looped else 0,
        "val_loss": loss,
        "val_loss_by_depth": {0: loss + 5.0, 1: loss + (later or 0.0), 2: loss} if looped else {0: loss},
        "loop": {"gate_mean_by_step": [0.7, 0.8]} if looped else None,
        "loop_settings": {"train.depth_sampling": "uniform"} if looped else None,
        "control": control,
    }


def runs(*losses: float) -> dict[int, dict]:
    return {seed: {"val_loss": v} for seed, v in enumerate(losses)}


def test_an_ordering_holds_only_when_every_seed_agrees_beyond_the_spread():
    assert ordering_verdict(runs(5.0, 5.1, 5.2), runs(4.9, 5.0, 5.1))["verdict"] == "holds"
    assert ordering_verdict(runs(5.0, 5.1, 5.2), runs(5.1, 5.2, 5.3))["verdict"] == "reversed"
    # one seed against the others: within the spread
    assert ordering_verdict(runs(5.0, 5.1, 5.2), runs(4.9, 5.2, 5.1))["verdict"] == "within spread"
    v = ordering_verdict(runs(5.0, 5.0), runs(4.0, 4.5))  # paired: the differences -1.0 and -0.5
    assert v["verdict"] == "holds" and v["diffs"] == [-1.0, -0.5]
    assert v["mean"] == -0.75 and v["sd"] == pytest.approx(0.35355, abs=1e-5)


def test_one_seed_gives_no_spread_and_no_verdict():
    v = ordering_verdict(runs(5.0), runs(5.0))
    assert v["verdict"] == "one seed: no verdict" and v["sd"] is None and v["diffs"] == [0.0]
    per_seed = {0: [row("ladder-3-reinject", 5.0), row("ladder-4-gate", 5.0, 0.3)]}
    text = seed_table(per_seed)
    assert "±" not in text and "| 5.000 (1 seed) | 0.300 (1 seed) |" in text
    orders = orderings_table(per_seed)
    assert "| +0.000 | +0.000 | one seed: no verdict | - |" in orders
    body = "\n".join(orders.splitlines()[2:])  # the rows, under the header
    assert "reversed" not in body and "±" not in body


def test_seeds_needed_is_the_paired_t_sample_size():
    # Guenther's approximation: ((1.95996 + 0.84162) * sd / delta)^2 + 1.95996^2 / 2, rounded up
    assert seeds_needed(0.037, -0.016) == 44  # the loop study's GRT - dense spread at the paper's -0.016
    assert seeds_needed(0.1, 0.1) == 10  # effect size 1: the exact paired t-test needs 10 too
    assert seeds_needed(0.0, -0.05) == 2 and seeds_needed(None, -0.05) is None and seeds_needed(0.1, None) is None


def test_the_seed_table_gives_mean_and_spread_and_the_orderings_name_the_runs():
    per_seed = {
        0: [row("ladder-3-reinject", 5.0), row("ladder-4-gate", 4.8, 0.3)],
        1: [row("ladder-3-reinject", 5.2), row("ladder-4-gate", 5.0, 0.5)],
    }
    text = seed_table(per_seed)
    # the loop column is L(1) - L(R): depth 0 (5 nats above) is out of it
    assert "| ladder-4-gate | 1+2x2+1 | 2 | 4.900 ± 0.141 | 0.400 ± 0.141 | 0.700 / 0.800 |" in text
    assert "| ladder-3-reinject | 6 | 2 | 5.100 ± 0.141 | - | - |" in text
    orders = orderings_table(per_seed)
    gate = "a = ladder-3-reinject, b = ladder-4-gate) | -0.048 | -0.200 ± 0.000 | -0.200, -0.200 | holds | 2 |"
    assert gate in orders
    assert "tiny-dense" not in orders  # an ordering whose runs were not made is left out


def test_a_control_is_compared_with_its_base_paired_by_seed():
    control = {"of": "tiny-grt", "kind": "dense-params"}
    per_seed = {
        0: [row("tiny-grt", 4.80, 0.01), row("tiny-grt-dense-params", 4.90, control=control)],
        1: [row("tiny-grt", 4.85, 0.01), row("tiny-grt-dense-params", 4.90, control=control)],
    }
    orders = orderings_table(per_seed)
    line = next(li for li in orders.splitlines() if "dense model of equal parameters" in li)
    # b - a: -0.10 and -0.05, sd 0.0354; the paper's -0.08 needs ((2.80 * 0.0354 / 0.08)^2 + 1.92) -> 4 seeds
    assert "(a = tiny-grt-dense-params, b = tiny-grt) | -0.080 | -0.075 ± 0.035 | -0.100, -0.050 | holds | 4 |" in line
