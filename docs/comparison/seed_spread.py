"""The seed spread of `grt compare` runs: per label, the mean and standard deviation over seeds of
the final validation loss and of the loss at r = 0 (the loop's contribution is their gap), as a
Markdown table. docs/comparison.md's sweep table:

    python docs/comparison/seed_spread.py runs/sweep-s1234/comparison-sweep-s1234.json \\
        runs/sweep-s2/comparison-sweep-s2.json runs/sweep-s3/comparison-sweep-s3.json
"""

from __future__ import annotations

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    runs: dict[str, list[dict]] = {}
    for path in paths:
        for run in json.load(open(path))["runs"]:
            runs.setdefault(run["label"], []).append(run)
    print(
        "| label | layout | depth sampling | train MFLOPs/tok (mean) | val loss, mean +- sd over seeds | each seed "
        "| val loss at r = 0 (mean) | loop's gain r = 0 -> R (mean) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, group in runs.items():
        final = [r["val_loss"] for r in group]
        at_zero = [r["val_loss_by_depth"]["0"] for r in group]
        sd = statistics.stdev(final) if len(final) > 1 else 0.0
        gain = statistics.mean(z - f for z, f in zip(at_zero, final))
        print(
            f"| {label} | {group[0]['layout']} | {group[0]['depth_sampling']} | "
            f"{statistics.mean(r['train_flops_per_token'] for r in group) / 1e6:.2f} | "
            f"{statistics.mean(final):.3f} +- {sd:.3f} | "
            f"{' / '.join(f'{x:.3f}' for x in final)} | {statistics.mean(at_zero):.3f} | {gain:.3f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
