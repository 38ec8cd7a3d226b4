"""`grt launch ... --preflight` (the check, then training) and `--preflight-only` (the check alone): what
every rank of the launch can do, measured before a run starts, against the run's own settings. The
check is a launch of its own (launcher/cli.py): its processes end before training's start.

On every rank: a square GEMM at the training dtype (TFLOP/s), an all-reduce of the gradient's size
(the model's parameters at that dtype; bus bandwidth, GB/s) within each node and across nodes
(between the ranks of the same local index), the checkpoint's share written to the output folder
and synced (MB/s), and the first training shard this rank reads (MB/s); rank 0 checks the output
folder's free space against the checkpoints the run keeps. Rank 0 prints one table, the median of
each column, the slowest rank and node against it, and writes `<run dir>/launch/preflight.json`.

The check fails (every rank stops, exit 3, the reason in one line) when a value is below a limit of
`--preflight-limits`: `slow=0.8` (the default), a rank whose GEMM is below 0.8 times the ranks'
median; `tflops=`, `busbw=` GB/s, `write=` MB/s, `read=` MB/s, absolute floors (off by default:
an all-reduce's bandwidth is the same on every rank of its group, so a slow link shows as a low
number, not as one rank against the others; the file system's speeds vary from one write to the
next), or when the free space cannot hold the checkpoints the run keeps. CPU runs measure the same
on gloo (the all-reduce capped at `--allreduce-mb`, default 64 there). The write is this rank's
share of a checkpoint, between 32 and 256 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

COLUMNS = {  # key: (heading, limit name)
    "gemm_tflops": ("GEMM TFLOP/s", "tflops"),
    "node_busbw": ("all-reduce in node GB/s", "busbw"),
    "cross_busbw": ("across nodes GB/s", "busbw"),
    "write_mbs": ("write MB/s", "write"),
    "read_mbs": ("first shard MB/s", "read"),
}
ALLREDUCE_CALLS = 5  # timed, after one warm-up: the same count on every rank of a group
DEFAULT_LIMITS = {"slow": 0.8, "tflops": 0.0, "busbw": 0.0, "write": 0.0, "read": 0.0}


def parse_limits(text: str) -> dict[str, float]:
    from grt_common.errors import ConfigError

    limits = dict(DEFAULT_LIMITS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        try:
            if key not in limits:
                raise ValueError
            limits[key] = float(value)
        except ValueError:
            raise ConfigError(
                f"--preflight-limits {item!r}: expected NAME=NUMBER with NAME one of {', '.join(DEFAULT_LIMITS)}"
            ) from None
    return limits


def _for_seconds(run: Any, sync: Any, seconds: float) -> tuple[int, float]:
    """Calls of `run` (after one warm-up) until `seconds` have passed, and their time: a rank slowed
    part of the time shows it (chunks growing to 64 calls between syncs)."""
    run()
    sync()
    calls, chunk, t0 = 0, 1, time.perf_counter()
    while True:
        for _ in range(chunk):
            run()
        sync()
        calls, took = calls + chunk, time.perf_counter() - t0
        if took >= seconds:
            return calls, took
        chunk = min(2 * chunk, 64)


def gemm_tflops(device: Any, dtype: Any, n: int) -> float:
    import torch

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    calls, took = _for_seconds(lambda: a @ b, sync, 0.5)
    return 2 * n**3 * calls / took / 1e12


def groups(node_of: list[int], rank: int) -> tuple[tuple[Any, int], tuple[Any, int]]:
    """(this rank's node group, its size) and (its cross-node group of the same local index, its size);
    every rank creates every group, in the same order (torch's rule)."""
    import torch.distributed as dist

    nodes = sorted(set(node_of))
    members = {n: [r for r, m in enumerate(node_of) if m == n] for n in nodes}
    mine: dict[str, tuple[Any, int]] = {}
    for n in nodes:
        g = dist.new_group(members[n])
        if rank in members[n]:
            mine["node"] = (g, len(members[n]))
    for i in range(max(len(m) for m in members.values())):
        across = [members[n][i] for n in nodes if i < len(members[n])]
        g = dist.new_group(across)
        if rank in across:
            mine["cross"] = (g, len(across))
    return mine["node"], mine["cross"]


def write_mbs(folder: Path, nbytes: int, rank: int) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".preflight-rank{rank}.tmp"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as fh:
            for _ in range(max(1, nbytes >> 20)):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return max(1, nbytes >> 20) / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)


def read_mbs(url: str) -> float:
    from data_pipeline.shards import open_stream

    t0, n = time.perf_counter(), 0
    with open_stream(url) as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
    return n / 2**20 / (time.perf_counter() - t0)


def measure(cfg: Any, rank: int, world: int, node_of: list[int], allreduce_mb: float) -> dict[str, Any]:
    """This rank's row (module doc)."""
    import torch

    from data_pipeline.manifest import Manifest
    from pretrain.distributed import bus_bandwidth
    from pretrain.model import build_model
    from pretrain.model.flops import count_params

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda and cfg.train.precision != "fp32" else torch.float32
    with torch.device("meta"):
        params = count_params(build_model(cfg.model))["params"]
    size = 4 if dtype == torch.float32 else 2
    numel = min(params, int(allreduce_mb * 2**20) // size) if allreduce_mb else params
    (node_group, node_size), (cross_group, cross_size) = groups(node_of, rank)
    ckpt_bytes = params * (16 if dtype != torch.float32 else 12)  # weights, fp32 master, Adam's two moments
    shards = Manifest.load(cfg.data_spec.paths[0]).shards("train")
    row: dict[str, Any] = {
        "rank": rank,
        "host": socket.gethostname(),
        "node": node_of[rank],
        "gemm_tflops": gemm_tflops(device, dtype, 4096 if cuda else 384),
        "node_busbw": bus_bandwidth(numel, dtype, node_group, node_size, ALLREDUCE_CALLS),
        "cross_busbw": bus_bandwidth(numel, dtype, cross_group, cross_size, ALLREDUCE_CALLS),
        "write_mbs": write_mbs(Path(cfg.out) / "launch", min(max(ckpt_bytes // world, 32 << 20), 256 << 20), rank),
        "read_mbs": read_mbs(shards[rank % len(shards)].url),
    }
    if rank == 0:
        out = Path(cfg.out)
        while not out.exists():
            out = out.parent
        keep = cfg.train.keep_checkpoints + 1  # the kept ones and the one being written
        row.update(free_bytes=shutil.disk_usage(out).free, need_bytes=ckpt_bytes * keep, keep=keep, params=params)
        row.update(dtype=str(dtype).replace("torch.", ""), allreduce_numel=numel)
    return row


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def verdict(rows: list[dict[str, Any]], limits: dict[str, float]) -> tuple[list[str], list[str]]:
    """The table's lines and the failures (empty: passed)."""
    head = rows[0]
    mb = head["allreduce_numel"] * (4 if head["dtype"] == "float32" else 2) / 2**20
    lines = [
        f"preflight: {len(rows)} rank(s) on {len({r['node'] for r in rows})} node(s); {head['params'] / 1e6:.1f} M "
        f"parameters, {head['dtype']}, all-reduce of {mb:.1f} MB",
        "rank  host            " + "  ".join(f"{h:>24}" for h, _ in COLUMNS.values()),
    ]

    def fmt(v: float | None) -> str:
        return f"{v:>24.3g}" if v is not None else f"{'-':>24}"

    for r in rows:
        lines.append(f"{r['rank']:<5} {r['host'][:15]:<15} " + "  ".join(fmt(r[k]) for k in COLUMNS))
    medians = {k: statistics.median(v) if (v := [r[k] for r in rows if r[k] is not None]) else None for k in COLUMNS}
    lines.append(f"{'median':<21} " + "  ".join(fmt(medians[k]) for k in COLUMNS))
    failures, worst = [], (1.0, "")
    for k, (heading, floor) in COLUMNS.items():
        for r in rows:
            v, m = r[k], medians[k]
            if v is None or not m:
                continue
            who, ratio = f"rank {r['rank']} on {r['host']}", v / m
            if ratio < worst[0]:
                worst = (ratio, f"slowest rank: {who} ({heading} {ratio:.2f}x the median)")
            if k == "gemm_tflops" and ratio < limits["slow"]:  # the others: floors (a collective's is shared)
                failures.append(f"{who}: {heading} {v:.3g}, {ratio:.2f}x the median (slow={limits['slow']:g})")
            if v < limits[floor]:
                failures.append(f"{who}: {heading} {v:.3g} below {floor}={limits[floor]:g}")
    nodes = sorted({r["node"] for r in rows})
    if len(nodes) > 1:
        speed = {n: statistics.mean(r["gemm_tflops"] for r in rows if r["node"] == n) for n in nodes}
        slow = min(nodes, key=lambda n: speed[n])
        host = next(r["host"] for r in rows if r["node"] == slow)
        ratio = speed[slow] / statistics.median(speed.values())
        lines.append(f"slowest node: {slow} ({host}), GEMM {ratio:.2f}x the nodes' median")
    lines.append(worst[1] or "every rank at the median or above")
    free, need, keep = head["free_bytes"], head["need_bytes"], head["keep"]
    lines.append(f"free space for the run: {_gib(free)}; {keep} checkpoint(s) need {_gib(need)}")
    if free < need:
        failures.append(f"the output folder has {_gib(free)} free; {keep} checkpoints need {_gib(need)}")
    return lines, failures


def main(argv: list[str] | None = None) -> int:
    import torch

    from grt_common.errors import Stopped
    from pretrain.distributed import all_reduce, comm_device, gather_floats, gather_text, init_distributed
    from pretrain.runs.run_config import RunConfig
    from pretrain.runs.trusted_files import forbid_code_in_files

    forbid_code_in_files()
    p = argparse.ArgumentParser(prog="grt launch --preflight")
    p.add_argument("--limits", default="", help="slow=0.8,tflops=..,busbw=..,write=..,read=..")
    p.add_argument("--allreduce-mb", type=float, default=None, help="cap on the all-reduce (default: 64 on CPU)")
    p.add_argument("--config-json", required=True)
    args, _rest = p.parse_known_args(argv)  # (--resume: the training's)
    limits = parse_limits(args.limits)
    cfg = RunConfig.load(args.config_json)
    info = init_distributed(timeout_s=cfg.train.dist_timeout_s)
    node_of = [int(n) for n in gather_floats(float(info.node_rank))]
    cap = args.allreduce_mb if args.allreduce_mb is not None else (0.0 if torch.cuda.is_available() else 64.0)
    row = measure(cfg, info.rank, info.world_size, node_of, cap)
    rows = [json.loads(text) for text in gather_text(json.dumps(row), 4096)]
    failed, reason = 0.0, ""
    if info.rank == 0:
        lines, failures = verdict(rows, limits)
        print("\n".join(lines + ([f"FAILED: {f}" for f in failures] if failures else ["passed"])), flush=True)
        record = Path(cfg.out) / "launch" / "preflight.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"rows": rows, "limits": limits, "failures": failures}, indent=1) + "\n")
        failed = float(bool(failures))
        reason = "; ".join(failures[:3])
    if all_reduce(torch.tensor([failed], device=comm_device()), op="max").item():
        raise Stopped(f"preflight failed: {reason}" if info.rank == 0 else "preflight failed (rank 0 says why)")
    return 0


if __name__ == "__main__":
    from pretrain.distributed import run_command

    sys.exit(run_command(main, prog="grt launch --preflight"))
