"""A tiny per-rank program to check a launch path without training.

    grt launch --launcher slurm --nodes 2 --gpus-per-node 8 --entry launcher.probe -- --out runs/probe

Every rank calls `pretrain.distributed.init_distributed()`, all-reduces its rank, and
writes `OUT/probe-rank<R>.json` (what it discovered, the all-reduce result, its host).
With `--steps N` it also behaves like a pre-emptible trainer: one collective "step" every
`--step-time` seconds, progress in `OUT/probe-progress.json`; on SIGUSR1/SIGTERM every rank
agrees to stop at the next step, rank 0 writes `OUT/probe-checkpoint.json` and all exit 0;
a later start resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from types import FrameType


@dataclass
class _StopRequest:
    signal: str | None = None  # the name of the SIGUSR1/SIGTERM that asked the ranks to stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.probe")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank exits 3 (error paths)")
    args, _unknown = p.parse_known_args(argv)

    stop = _StopRequest()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.signal = signal.Signals(signum).name

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, on_signal)

    import torch
    import torch.distributed as dist

    from pretrain.distributed import all_reduce, barrier, comm_device, init_distributed, is_main

    info = init_distributed(timeout_s=120)
    if args.fail_rank is not None and info.rank == args.fail_rank:
        return 3
    os.makedirs(args.out, exist_ok=True)
    t = all_reduce(torch.tensor([float(info.rank + 1)], device=comm_device()))
    record = info.to_dict()
    record.update(
        allreduce_sum=t.item(),
        expected_sum=info.world_size * (info.world_size + 1) / 2,
        backend=dist.get_backend(),
        dist_rank=dist.get_rank(),
        dist_world_size=dist.get_world_size(),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        slurm_restart_count=os.environ.get("SLURM_RESTART_COUNT"),
    )
    if info.launcher == "mpi":
        from mpi4py import MPI

        record.update(mpi4py_rank=MPI.COMM_WORLD.Get_rank(), mpi4py_size=MPI.COMM_WORLD.Get_size())
    ckpt_path = os.path.join(args.out, "probe-checkpoint.json")
    start = 0
    if args.steps:
        if os.path.exists(ckpt_path):
            with open(ckpt_path) as f:
                start = json.load(f)["step"]
        record["resumed_from"] = start
        step = start
        while step < args.steps:
            time.sleep(args.step_time)
            # agree on the step and on stopping
            s = all_reduce(torch.tensor([float(step), float(stop.signal is not None)], device=comm_device()), op="max")
            step += 1
            if is_main():
                with open(os.path.join(args.out, "probe-progress.json"), "w") as f:
                    json.dump({"step": step, "world_size": info.world_size}, f)
            if s[1].item() > 0 and step < args.steps:
                if is_main():
                    with open(ckpt_path + ".tmp", "w") as f:
                        json.dump({"step": step, "signal": stop.signal}, f)
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                record["stopped_at"] = step
                break
        else:
            record["finished"] = True
            if is_main():
                with open(ckpt_path + ".tmp", "w") as f:
                    json.dump({"step": step, "finished": True}, f)
                os.replace(ckpt_path + ".tmp", ckpt_path)
        record["signal"] = stop.signal
    with open(os.path.join(args.out, f"probe-rank{info.rank}.json"), "w") as f:
        json.dump(record, f, indent=1)
    barrier()
    print(f"probe rank {info.rank}/{info.world_size} via {info.launcher}: all_reduce {t.item()}", flush=True)
    return 0


if __name__ == "__main__":
    from pretrain.distributed import run_command

    sys.exit(run_command(main))
