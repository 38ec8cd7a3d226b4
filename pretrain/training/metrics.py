"""TensorBoard scalars, a per-step JSON-lines record, throughput and MFU, norms, memory."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from pretrain.distributed import all_reduce, comm_device
from pretrain.model.flops import flops_per_token
from pretrain.training.deepspeed_internals import local_shares

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from pretrain.config import ModelConfig

# bf16 dense peak FLOP/s by device name (substring match)
GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12, "V100": 125e12}


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> tuple[float, str]:
    if override_tflops > 0:
        return override_tflops * 1e12, f"{override_tflops} TFLOP/s (train.peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak, f"{peak / 1e12:.0f} TFLOP/s bf16 dense ({name})"
        return 312e12, f"unknown GPU {name!r}: assuming 312 TFLOP/s; set train.peak_tflops"
    cores = len(os.sched_getaffinity(0))
    peak = cores * 2.5e9 * 32  # fp32 AVX2: 2 FMA units x 8 lanes x 2 FLOPs per cycle at ~2.5 GHz
    return (
        peak,
        f"CPU estimate {peak / 1e9:.0f} GFLOP/s ({cores} cores x 2.5 GHz x 32 FLOP/cycle); set train.peak_tflops",
    )


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on CPU


def memory_scalars(device: torch.device) -> dict[str, int]:
    """Peak memory, and on CUDA the caching allocator's allocated and reserved bytes now (no sync)."""
    values = {"memory/peak_bytes": peak_memory_bytes(device)}
    if device.type == "cuda":
        values.update(
            {
                "memory/allocated_bytes": int(torch.cuda.memory_allocated(device)),
                "memory/reserved_bytes": int(torch.cuda.memory_reserved(device)),
            }
        )
    return values


class Throughput:
    """Tokens, executed FLOPs and wall time of the steps since the last read. MFU is the
    executed FLOPs summed over the window's steps, each at its own sampled depth and by the
    model variant's own formula (`flops_per_token`), over the window's time."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        seq_len: int,
        peak_flops_all_ranks: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg, self.seq_len, self.peak, self.clock = model_cfg, seq_len, peak_flops_all_ranks, clock
        self.flops_per_token: dict[int, int] = {}  # depth -> executed forward FLOPs per token
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens, self.flops, self.steps = self.clock(), 0, 0, 0

    def add(self, tokens: int, depth: int) -> None:
        if depth not in self.flops_per_token:
            self.flops_per_token[depth] = flops_per_token(self.cfg, self.seq_len, n_loops=depth, executed=True)
        self.tokens += tokens
        self.flops += 3 * tokens * self.flops_per_token[depth]  # forward + backward
        self.steps += 1

    def read(self) -> dict[str, float]:
        """The window's figures; starts the next window."""
        elapsed = max(self.clock() - self.start, 1e-9)
        values = {
            "perf/tokens_per_s": self.tokens / elapsed,
            "perf/samples_per_s": self.tokens / self.seq_len / elapsed,
            "perf/step_time_s": elapsed / max(self.steps, 1),
            "perf/mfu": self.flops / elapsed / self.peak,
        }
        self.reset()
        return values


BLOCKS = ("prelude", "core", "gate", "coda")


def block_of(name: str) -> str:
    """The part of the model a parameter belongs to (embeddings count with the prelude)."""
    if "gate" in name or "router" in name:
        return "gate"
    if name.startswith("loop."):
        return "core"
    if name.startswith(("coda.", "exit_norm", "ln_f", "lm_head")):
        return "coda"
    return "prelude"


def norms(model: torch.nn.Module, world: int) -> dict[str, float]:
    """The parameter norm and each block's gradient norm, from every rank's local share
    (`local_shares`: a ZeRO-3 partition is never gathered): one all-reduce of a few numbers.
    For logging steps, between the last backward and `engine.step()`."""
    param_squares: list[torch.Tensor] = []
    grad_squares: list[tuple[int, torch.Tensor]] = []  # (block, gradient squares)
    for name, p in model.named_parameters():
        param, param_split, grad, grad_split = local_shares(p)
        block = BLOCKS.index(block_of(name))
        param_squares.append(param.float().pow(2).sum() / (1 if param_split else world))
        if grad is not None:
            grad_squares.append((block, grad.float().pow(2).sum() / (1 if grad_split else world)))
    device = param_squares[0].device
    totals = torch.zeros(1 + len(BLOCKS), dtype=torch.float64, device=device)
    totals[0] = torch.stack(param_squares).sum()
    for block, value in grad_squares:
        totals[1 + block] += value.to(device)
    values = all_reduce(totals.to(comm_device())).tolist()
    return {
        "train/param_norm": math.sqrt(values[0]),
        **{f"grad_norm/{b}": math.sqrt(v) for b, v in zip(BLOCKS, values[1:])},
    }


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def human_duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Rank 0 writes TensorBoard events under <out>/tb; every rank writes one JSON line per
    step (metrics.jsonl on rank 0, metrics.rank<r>.jsonl elsewhere) so ranks can be compared."""

    def __init__(self, out: Path, rank: int) -> None:
        self.tb: SummaryWriter | None = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tb"))
        out.mkdir(parents=True, exist_ok=True)
        self.records: TextIO | None = open(out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"), "a")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if self.tb:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)

    def scalars_by_tokens(self, tokens: int, values: Mapping[str, float]) -> None:
        """The same curves against tokens seen, a second x-axis (series under by_tokens/)."""
        self.scalars(tokens, {f"by_tokens/{key}": value for key, value in values.items()})

    def text(self, tag: str, text: str) -> None:
        if self.tb:
            self.tb.add_text(tag, f"```\n{text}\n```", 0)

    def step_record(self, step: int, values: Mapping[str, Any]) -> None:
        if self.records:
            self.records.write(json.dumps({"step": step, **values}) + "\n")
            self.records.flush()

    def close(self) -> None:
        if self.tb:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.records:
            self.records.close()
            self.records = None
