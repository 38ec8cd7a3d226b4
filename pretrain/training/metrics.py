"""TensorBoard scalars, a per-step JSON-lines record, MFU peaks and peak memory."""
from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch

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
    return peak, f"CPU estimate {peak / 1e9:.0f} GFLOP/s ({cores} cores x 2.5 GHz x 32 FLOP/cycle); set train.peak_tflops"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on CPU


class MetricsWriter:
    """Rank 0 writes TensorBoard events under <out>/tb; every rank writes one JSON line per
    step (metrics.jsonl on rank 0, metrics.rank<r>.jsonl elsewhere) so ranks can be compared."""

    def __init__(self, out: Path, rank: int):
        self.tb = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tb"))
        out.mkdir(parents=True, exist_ok=True)
        self.records = open(out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"), "a")

    def scalars(self, step: int, values: dict) -> None:
        if self.tb:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)

    def text(self, tag: str, text: str) -> None:
        if self.tb:
            self.tb.add_text(tag, f"```\n{text}\n```", 0)

    def step_record(self, step: int, values: dict) -> None:
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
