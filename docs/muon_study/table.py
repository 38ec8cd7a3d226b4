"""The Muon-against-AdamW table of docs/performance.md from `grt compare` output folders (one per
seed, each with the AdamW runs tiny-grt and tiny-dense and their Muon runs tiny-grt-muon and
tiny-dense-muon): per model and seed, the final validation loss of each optimizer and the tokens
Muon took to reach AdamW's final validation loss of the same seed (linear between evaluations;
"not reached" when it did not). A run still training (no summary.json) counts with the
evaluations it has: its tokens to the target are known once it has crossed it.
docs/muon_study/run.sh runs it:

    python docs/muon_study/table.py runs/muon-study/s1234 runs/muon-study/s2 runs/muon-study/s3
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def run_of(folder: Path) -> dict[str, Any]:
    """A run's validation curve [(tokens, loss)], whether it finished, and its final loss."""
    cfg = json.loads((folder / "config.json").read_text())
    t = cfg["train"]
    seq_len = json.loads(Path(cfg["data"]).read_text())["seq_len"]  # the data's sequences (run from the checkout)
    per_step = t["micro_batch_size"] * t["grad_accum"] * seq_len
    curve = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val" in record:
            curve.append((record["step"] * per_step, record["val"]["val/loss"]))
    done = (folder / "summary.json").is_file()
    return {"curve": curve, "done": done, "final": curve[-1][1], "tokens": curve[-1][0], "steps": t["steps"]}


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first token count at which `curve` is at or below `target`."""
    previous: tuple[int, float] | None = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None:
                return float(tokens)
            (t0, l0), (t1, l1) = previous, (tokens, loss)
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
        previous = (tokens, loss)
    return None


def main(folders: list[str]) -> None:
    print(
        "| model | seed | AdamW val loss | Muon val loss | Muon's tokens to AdamW's final loss | "
        "AdamW tokens / Muon tokens |"
    )
    print("|---|---|---|---|---|---|")
    for model in ("tiny-grt", "tiny-dense"):
        ratios = []
        for folder in map(Path, folders):
            adamw, muon = run_of(folder / model), run_of(folder / f"{model}-muon")
            if not adamw["done"]:
                continue  # no target yet
            reached = tokens_to_reach(muon["curve"], adamw["final"])
            final = f"{muon['final']:.3f}" if muon["done"] else f"{muon['final']:.3f} (at {muon['tokens'] / 1e3:.0f}k)"
            ratio = "-" if reached is None else f"{adamw['tokens'] / reached:.2f}x"
            if reached is not None:
                ratios.append(adamw["tokens"] / reached)
            where = "not reached" + ("" if muon["done"] else " yet") if reached is None else f"{reached / 1e3:.0f}k"
            print(
                f"| {model} | {folder.name.lstrip('s')} | {adamw['final']:.3f} | {final} | "
                f"{where} of {adamw['tokens'] / 1e3:.0f}k | "
                f"{ratio} |"
            )
        if ratios:
            print(f"| {model} | mean | | | | {statistics.mean(ratios):.2f}x ({len(ratios)} seeds) |")


if __name__ == "__main__":
    main(sys.argv[1:])
