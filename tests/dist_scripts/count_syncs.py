"""Run `grt train ARGS...` in this process, counting host syncs per training step.

usage: count_syncs.py OUT_JSON grt-train-args...

A host sync is a call that makes the CPU wait for the device: Tensor.item, tolist,
__bool__, __float__, __int__, cpu, numpy. Each call is attributed to its innermost caller
of these: `deepspeed` (DeepSpeed's code, its hooks included), `data` (the host-side data
pipeline, whose tensors are on the CPU by construction) or `project` (the trainer and the
model, whose forward runs inside DeepSpeed's engine). The counts between
two per-step records (`MetricsWriter.step_record`, written once per step after its
logging) are that step's. At step 3 the run also issues two warnings that must be shown.
"""

import json
import sys
import warnings
from pathlib import Path
from types import FrameType

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pretrain.training.report.metrics import MetricsWriter  # noqa: E402

SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
counts = {"project": 0, "deepspeed": 0, "data": 0}
per_step: list[dict[str, int]] = []


def origin() -> str | None:
    """The innermost caller that is DeepSpeed's, the data pipeline's or the project's: the
    model's forward runs inside DeepSpeed's engine, and its syncs are the project's."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/deepspeed/" in name:
            return "deepspeed"
        if name.startswith(str(REPO / "data_pipeline")):
            return "data"
        if name.startswith(str(REPO / "pretrain")):
            return "project"
        frame = frame.f_back
    return None


def counting(original):
    def wrapper(self, *args, **kwargs):
        kind = origin()
        if kind:
            counts[kind] += 1
        return original(self, *args, **kwargs)

    return wrapper


for method in SYNCS:
    setattr(torch.Tensor, method, counting(getattr(torch.Tensor, method)))

out_json = Path(sys.argv[1])
original_record = MetricsWriter.step_record


def step_record(self, step, values):
    per_step.append({"step": step, **counts})
    for key in counts:
        counts[key] = 0
    if step == 3:
        warnings.warn("GRT-TEST a real UserWarning", UserWarning, stacklevel=1)
        warnings.warn("GRT-TEST a FutureWarning of another kind", FutureWarning, stacklevel=1)
    out_json.write_text(json.dumps(per_step))
    return original_record(self, step, values)


MetricsWriter.step_record = step_record  # type: ignore[method-assign]  # intentional runtime patch: records each step's sync counts

from pretrain.cli import main  # noqa: E402

sys.exit(main(["train", *sys.argv[2:]]))
