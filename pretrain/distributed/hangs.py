"""`grt hangs <out>/hangs/<time>`: which rank is behind, and in which collective the others wait.

Reads the `rank<R>.json` files one hang dump wrote (pretrain/training/report/forensics.py). A rank with no file did not
answer the dump (frozen, dead, or its host gone): it is named first. Among the ranks that wrote,
each process group's flight recorder says the last collective each rank entered (its sequence
number) and the last it completed: a rank that entered fewer is behind, and the collective the
others wait in is the one they entered past it; beside a silent rank, the one they entered last
(gloo marks a collective that timed out as completed). The dumps of a run that is not hung (a
SIGUSR2 while training goes on) are taken about a second apart and differ by the collectives run
in between. torch's own analyzer reads the same folder for
the full picture (`fr_trace_rank_<R>`, the command printed last).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FR_PREFIX = "fr_trace_rank_"  # + the rank: each rank's flight recorder pickle, as torch's analyzer reads it
FR_COMMAND = "python -m torch.distributed.flight_recorder.fr_trace {folder} --prefix " + FR_PREFIX


def read_ranks(folder: Path) -> dict[int, dict[str, Any]]:
    ranks = {}
    for path in sorted(folder.glob("rank*.json")):
        try:
            dump = json.loads(path.read_text())
            ranks[int(dump["rank"])] = dump
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a file cut off by a kill: the rank is counted as silent
    return ranks


def _seq(status: dict[str, Any], key: str) -> int:
    try:
        return int(status.get(key, -1))
    except (TypeError, ValueError):
        return -1


def _entry(fr: dict[str, Any], pg: str, seq: int) -> dict[str, Any] | None:
    for e in reversed(fr.get("entries", [])):
        if str(e.get("pg_id")) == pg and e.get("collective_seq_id") == seq:
            return e
    return None


def _named(entry: dict[str, Any] | None, pg: str, seq: int) -> str:
    what = entry.get("profiling_name", "?") if entry else "a collective no longer in the recorder"
    sizes = f", sizes {entry.get('input_sizes')}" if entry else ""
    return f"{what} (process group {pg}, collective {seq}{sizes})"


def analyze(folder: Path) -> list[str]:
    """The report's lines (module doc)."""
    ranks = read_ranks(folder)
    if not ranks:
        return [f"{folder}: no rank wrote a dump here (rank<R>.json)"]
    world = max(d.get("world", 1) for d in ranks.values())
    silent = [r for r in range(world) if r not in ranks]
    first = ranks[min(ranks)]
    lines = [f"{folder}: {len(ranks)} of {world} ranks wrote a dump; reason: {first.get('reason')}"]
    if silent:
        lines.append(
            f"behind: rank(s) {', '.join(map(str, silent))}: no dump (it did not answer: frozen, killed, or its "
            "host is gone)"
        )
    for r, d in sorted(ranks.items()):
        lines.append(
            f"rank {r} on {d.get('host')}: step {d.get('step')}, loop depth {d.get('depth')}, phase {d.get('phase')}"
        )
    recorded = {r: d["flight_recorder"] for r, d in ranks.items() if d.get("flight_recorder")}
    if not recorded:
        return [*lines, "no flight recorder in the dumps (TORCH_FR_BUFFER_SIZE=0, or a backend without one)"]
    pgs = sorted({pg for fr in recorded.values() for pg in fr.get("pg_status", {})})
    said = False
    for pg in pgs:
        entered = {r: _seq(fr["pg_status"].get(pg, {}), "last_enqueued_collective") for r, fr in recorded.items()}
        done = {r: _seq(fr["pg_status"].get(pg, {}), "last_completed_collective") for r, fr in recorded.items()}
        top = max(entered.values())
        ahead = [r for r, s in entered.items() if s == top]
        behind = [r for r, s in entered.items() if s < top]
        waiting = [r for r in ahead if done[r] < top]
        where = _named(_entry(recorded[ahead[0]], pg, top), pg, top)
        if behind:
            lines.append(
                f"behind in process group {pg}: rank(s) {', '.join(map(str, behind))} (entered collective "
                f"{', '.join(str(entered[r]) for r in behind)}); rank(s) {', '.join(map(str, ahead))} wait in {where}"
            )
            said = True
        elif silent:  # the one they entered last waits for the silent rank (a timeout retires it: completed)
            lines.append(f"rank(s) {', '.join(map(str, ahead))} wait in {where}, the last collective they entered")
            said = True
        elif waiting:
            lines.append(f"rank(s) {', '.join(map(str, waiting))} wait in {where}: not completed")
            said = True
    if not said:
        lines.append("every rank that wrote entered the same last collective of each process group, and completed it")
    return [*lines, "torch's analyzer of the same traces: " + FR_COMMAND.format(folder=folder)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grt hangs", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a hang dump: <out>/hangs/<time> (the stop line names it)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        print(f"grt hangs: error: {args.folder} is not a folder (a hang dump: <out>/hangs/<time>)", file=sys.stderr)
        return 2
    print("\n".join(analyze(args.folder)))
    return 0
