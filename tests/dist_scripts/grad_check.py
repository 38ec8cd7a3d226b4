"""Compare DeepSpeed's full gradients (ZeRO stage N, W ranks, grad accumulation 2) with a
single-process reference on the same global batch, over several depths in a row.

usage: grad_check.py STAGE PRESET[,PRESET...] OUT_JSON [DEPTHS [CHECKPOINTING]]   (run as W ranks; writes a report from
rank 0: {"steps": [...], "trace_invalidations": N} for one preset, {preset: {...}} for several). A preset may
name extra settings of its model: micro-grt:backprop_steps=1.
Every random perturbation is off (baselines.noise_off). "trace_invalidations" counts the times
ZeRO-3 threw away its recorded module order after the first step. "unused_with_nonzero_grad"
lists the parameters a depth does not reach (the loop at depth 0, per-step LoRA adapters and
routers past the depth) whose gradient is not exactly zero: under ZeRO-3 they would be stale.
"""

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad  # noqa: E402

from pretrain.distributed import exit_process, init_distributed  # noqa: E402
from pretrain.model import build_model  # noqa: E402
from pretrain.model.baselines import noise_off  # noqa: E402
from pretrain.presets import get_preset  # noqa: E402
from pretrain.runs.run_config import RunConfig  # noqa: E402
from pretrain.training.engine import deepspeed_internals  # noqa: E402
from pretrain.training.engine.build import build_engine  # noqa: E402

stage, presets, out_path = int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3])
depths = [int(d) for d in (sys.argv[4] if len(sys.argv) > 4 else "3,1,0,2").split(",")]
checkpointing = sys.argv[5] if len(sys.argv) > 5 else "loop_step"
GA, B, T = 2, 2, 16


def unused(name: str, depth: int) -> bool:
    per_step = re.match(r"(?:loop\.lora|routers)\.(\d+)\.", name)
    if per_step:
        return int(per_step.group(1)) >= depth
    return name.startswith("loop.") and depth == 0


def ds_config_path() -> str:
    """The shipped config; for ZeRO-3 on several ranks with no persistence threshold, so that a
    micro model's parameters are sharded and gathered as a GPT-2-sized model's are (the pinned
    core included). One rank keeps the trainer's default: every parameter persistent, the whole
    model pinned."""
    shipped = REPO / "ds_configs" / f"zero{stage}.json"
    if stage != 3 or world == 1:
        return str(shipped)
    ds = json.loads(shipped.read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = out_path.with_name(f"zero3-threshold0-rank{os.environ.get('RANK', '0')}.json")
    path.write_text(json.dumps(ds))
    return str(path)


class Report(TypedDict):
    """One preset's report (written as JSON)."""

    steps: list[dict[str, Any]]
    trace_invalidations: NotRequired[int]


def check(preset: str) -> Report:
    cfg = RunConfig(data="unused", ds_config=ds_config_path())
    name, _, extra = preset.partition(":")  # micro-grt:backprop_steps=1
    model = get_preset(name)
    settings = {k: int(v) for k, v in (item.split("=") for item in extra.split("+") if item)}
    cfg.model = noise_off(model.replace(extra={**model.extra, **settings}, max_seq_len=T))
    cfg.train.micro_batch_size, cfg.train.grad_accum = B, GA
    cfg.train.activation_checkpointing = checkpointing
    cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps = 1e-2, 0, 100
    torch.manual_seed(0)
    engine, _ = build_engine(cfg, world, torch.device("cpu"))
    reference = build_model(cfg.model).train()
    names = [n for n, _ in engine.module.named_parameters()]
    params = dict(engine.module.named_parameters())

    def batch(step, micro, r):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + r)
        idx = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]

    report: Report = {"steps": []}
    for step, depth in enumerate(depths):
        # reference: the same weights as the engine, the whole global batch in one process
        reference.load_state_dict(
            {n: safe_get_full_fp32_param(params[n]).detach().clone() for n in names}, strict=False
        )
        reference.zero_grad(set_to_none=False)
        for micro in range(GA):
            for r in range(world):
                idx, tgt = batch(step, micro, r)
                (reference(idx, tgt, n_loops=depth).loss / (GA * world)).backward()
        for micro in range(GA):
            idx, tgt = batch(step, micro, rank)
            loss = engine(idx, tgt, n_loops=depth, return_logits=False).loss  # the trainer's loss, no logits
            engine.backward(loss)
            if micro == GA - 1:
                grads = {n: safe_get_full_grad(params[n]) for n in names}  # collective: every rank
            engine.step()
        ref = dict(reference.named_parameters())
        worst, unused_nonzero = {}, []
        for n in names:
            ref_param = ref[n]
            ref_grad = ref_param.grad if ref_param.grad is not None else torch.zeros_like(ref_param)
            diff = (grads[n].float() - ref_grad).abs().max().item()
            scale = ref_grad.abs().max().item()
            worst[n] = {"max_abs_diff": diff, "ref_max": scale}
            if unused(n, depth) and grads[n].abs().max().item() != 0:
                unused_nonzero.append(n)
        report["steps"].append({"depth": depth, "grads": worst, "unused_with_nonzero_grad": unused_nonzero})
        if step == 0:
            invalidations_after_first_step = deepspeed_internals.COUNTERS.trace_invalidations
    if stage == 3:
        report["trace_invalidations"] = (
            deepspeed_internals.COUNTERS.trace_invalidations - invalidations_after_first_step
        )
    return report


info = init_distributed(timeout_s=120)
rank, world = info.rank, info.world_size
reports = {p: check(p) for p in presets}
if rank == 0:
    out_path.write_text(json.dumps(reports[presets[0]] if len(presets) == 1 else reports))
exit_process(0)
