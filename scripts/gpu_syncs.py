"""Run `grt train ARGS...` in this process and list its host syncs by call site (the GPU check's
`syncs-*` rows, docs/gpu.md "Host syncs on CUDA"): every call that makes the CPU wait for the
device, the CUDA-only ones included (`torch.cuda.synchronize`, which DeepSpeed's accelerator
calls, and a stream's or event's `synchronize`), with the seconds the host waited in each, over
the steps after the first two (warm-up). A site is the innermost DeepSpeed or project frame.

    python3 scripts/gpu_syncs.py OUT_JSON grt-train-args...
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pretrain.training.report.metrics import MetricsWriter  # noqa: E402

WARMUP_STEPS = 2
TENSOR_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
sites: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # site -> [calls, seconds waited]
steps = 0


def site() -> str | None:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/deepspeed/" in name:
            return f"deepspeed/{name.split('/deepspeed/', 1)[1]}:{frame.f_lineno}"
        if name.startswith(str(REPO)) and not name.endswith("gpu_syncs.py"):
            return f"{Path(name).relative_to(REPO)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def counting(kind: str, original):
    def wrapper(*args, **kwargs):
        where = site() if steps >= WARMUP_STEPS else None
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if where:
            entry = sites[f"{kind} {where}"]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
        return result

    return wrapper


for method in TENSOR_SYNCS:
    setattr(torch.Tensor, method, counting(f"Tensor.{method}", getattr(torch.Tensor, method)))
torch.cuda.synchronize = counting("cuda.synchronize", torch.cuda.synchronize)
torch.cuda.Stream.synchronize = counting("Stream.synchronize", torch.cuda.Stream.synchronize)  # type: ignore[method-assign]
torch.cuda.Event.synchronize = counting("Event.synchronize", torch.cuda.Event.synchronize)  # type: ignore[method-assign]

out_json = Path(sys.argv[1])
original_record = MetricsWriter.step_record


def step_record(self, step, values):
    global steps
    steps = step
    measured = max(step - WARMUP_STEPS, 1)
    table = {k: {"per_step": v[0] / measured, "ms_per_step": 1e3 * v[1] / measured} for k, v in sites.items()}
    out_json.write_text(json.dumps({"measured_steps": measured, "sites": table}, indent=1))
    return original_record(self, step, values)


MetricsWriter.step_record = step_record  # type: ignore[method-assign]  # records the sites after each step

from pretrain.cli import main  # noqa: E402

code = main(["train", *sys.argv[2:]])
report: dict[str, Any] = json.loads(out_json.read_text()) if out_json.exists() else {"measured_steps": 0, "sites": {}}
print(f"# reproduce: python3 scripts/gpu_syncs.py {' '.join(sys.argv[1:])}")
print(f"host syncs per step over {report['measured_steps']} steps after {WARMUP_STEPS}, by call site")
print("| per step | host waited, ms/step | call site |\n|---|---|---|")
for key, v in sorted(report["sites"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
    print(f"| {v['per_step']:.2f} | {v['ms_per_step']:.3f} | {key} |")
sys.exit(code)
