"""`grt compare --seeds`' aggregation (pretrain/tools/compare/seeds.py): the mean ± sd per method
and the verdict of each of the paper's orderings against the seed spread."""

from __future__ import annotations

from pretrain.tools.compare.seeds import ordering_verdict, orderings_table, seed_table


def row(label: str, loss: float, gain: float | None = None) -> dict:
    loop = {"gain": gain, "gate_mean_by_step": [0.7, 0.8], "used": True} if gain is not None else None
    return {
        "label": label,
        "method": label,
        "layout": "1+2x2+1" if loop else "6",
        "loops": 2 if loop else 0,
        "val_loss": loss,
        "val_loss_by_depth": {0: loss + (gain or 0), 1: loss, 2: loss} if loop else {0: loss},
        "loop": loop,
    }


def runs(*losses: float) -> dict[int, dict]:
    return {seed: {"val_loss": v} for seed, v in enumerate(losses)}


def test_an_ordering_holds_only_when_every_seed_agrees_beyond_the_spread():
    assert ordering_verdict(runs(5.0, 5.1, 5.2), runs(4.9, 5.0, 5.1))[0] == "holds"
    assert ordering_verdict(runs(5.0, 5.1, 5.2), runs(5.1, 5.2, 5.3))[0] == "reversed"
    # one seed against the others: within the spread
    assert ordering_verdict(runs(5.0, 5.1, 5.2), runs(4.9, 5.2, 5.1))[0] == "within spread"
    verdict, mean, spread = ordering_verdict(runs(5.0, 5.0), runs(4.0, 4.5))
    assert verdict == "holds" and mean == -0.75 and round(spread, 3) == 0.354


def test_the_seed_table_gives_mean_and_spread_and_the_orderings_name_the_runs():
    per_seed = {
        0: [row("ladder-3-reinject", 5.0), row("ladder-4-gate", 4.8, 0.3)],
        1: [row("ladder-3-reinject", 5.2), row("ladder-4-gate", 5.0, 0.5)],
    }
    text = seed_table(per_seed)
    assert "| ladder-4-gate | 1+2x2+1 | 2 | 4.900 ± 0.141 | 0.400 ± 0.141 | 0.700 / 0.800 |" in text
    assert "| ladder-3-reinject | 6 | 2 | 5.100 ± 0.141 | - | - |" in text
    orders = orderings_table(per_seed)
    assert "a = ladder-3-reinject, b = ladder-4-gate) | -0.200 ± 0.000 | holds |" in orders
    assert "tiny-dense" not in orders  # an ordering whose runs were not made is left out
