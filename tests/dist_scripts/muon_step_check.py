"""train.optimizer=muon: DeepSpeed's engine (ZeRO stage N, W ranks, grad accumulation 2) against a
single-process reference step, DeepSpeed's own SingleDeviceMuonWithAuxAdam over the whole global
batch, with the groups the run config asks for: the matrices of muon.py on Muon at train.muon_lr
with train.muon_weight_decay, the embeddings on AdamW at train.lr with train.weight_decay, norms,
biases and gains on AdamW without decay; each at the rate the engine's scheduler gives its group.

usage: muon_step_check.py STAGE[,STAGE...] OUT_JSON   (run as W ranks; rank 0 writes, per stage,
{"lrs": [[muon, adamw], ...], "steps": [{"max_abs_diff", "worst", "moved"}, ...], "groups": {name: "muon"|"adam"}})
"""

import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

from pretrain.distributed import exit_process, init_distributed  # noqa: E402
from pretrain.model import build_model  # noqa: E402
from pretrain.model.baselines import noise_off  # noqa: E402
from pretrain.presets import get_preset  # noqa: E402
from pretrain.runs.run_config import RunConfig  # noqa: E402
from pretrain.training.engine.build import build_engine  # noqa: E402
from pretrain.training.engine.muon import muon_names  # noqa: E402

stages, out_path = [int(s) for s in sys.argv[1].split(",")], Path(sys.argv[2])
GA, B, T, DEPTH, STEPS = 2, 2, 16, 2, 4


def check(stage: int) -> dict[str, Any]:
    cfg = RunConfig(data="unused", ds_config=str(REPO / "ds_configs" / f"zero{stage}.json"))
    cfg.model = noise_off(get_preset("micro-grt").replace(max_seq_len=T))
    t = cfg.train
    t.micro_batch_size, t.grad_accum, t.activation_checkpointing = B, GA, "off"
    t.optimizer, t.grad_clip = "muon", 0.0
    # large rates and both decays on, so that a parameter in the wrong group shows
    t.lr, t.muon_lr, t.weight_decay, t.muon_weight_decay, t.warmup_steps, t.steps = 1e-2, 0.05, 0.1, 0.2, 0, 100
    torch.manual_seed(0)
    engine, _ = build_engine(cfg, world, torch.device("cpu"))
    params = dict(engine.module.named_parameters())
    reference = build_model(cfg.model).train()
    reference.load_state_dict(
        {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params.items()}, strict=False
    )
    muon = muon_names(reference)
    ref_params = dict(reference.named_parameters())
    adam = {"betas": t.betas, "eps": 1e-8, "use_muon": False}
    groups = [
        {"params": [ref_params[n] for n in muon], "momentum": t.muon_momentum, "weight_decay": t.muon_weight_decay},
        {
            **adam,
            "params": [p for n, p in ref_params.items() if n not in muon and p.dim() >= 2],
            "weight_decay": t.weight_decay,
        },
        {**adam, "params": [p for n, p in ref_params.items() if p.dim() < 2], "weight_decay": 0.0},
    ]
    ref_opt = SingleDeviceMuonWithAuxAdam([{"use_muon": True, **groups[0]}, *groups[1:]])

    def batch(step: int, micro: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + r)
        idx = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]

    report: dict[str, Any] = {
        "lrs": [],
        "steps": [],
        "groups": {n: "muon" if n in muon else "adam" for n in ref_params},
    }
    start = {n: p.detach().clone() for n, p in ref_params.items()}
    for step in range(STEPS):
        ref_opt.zero_grad(set_to_none=False)
        for micro in range(GA):
            for r in range(world):
                (reference(*batch(step, micro, r), n_loops=DEPTH).loss / (GA * world)).backward()
        # the rates the engine's scheduler set for this step, by its groups: decay, no_decay (AdamW), matrices (Muon)
        decay_lr, no_decay_lr, muon_lr = engine.get_lr()
        assert decay_lr == no_decay_lr, engine.get_lr()
        for group, lr in zip(ref_opt.param_groups, (muon_lr, decay_lr, no_decay_lr)):
            group["lr"] = lr
        report["lrs"].append([muon_lr, decay_lr])
        ref_opt.step()
        for micro in range(GA):
            engine.backward(engine(*batch(step, micro, rank), n_loops=DEPTH, return_logits=False).loss)
            engine.step()
        full = {n: safe_get_full_fp32_param(p) for n, p in params.items()}  # collective: every rank
        diffs = {n: (full[n] - ref_params[n].detach()).abs().max().item() for n in params}
        worst = max(diffs, key=diffs.__getitem__)
        moved = min((ref_params[n].detach() - start[n]).abs().max().item() for n in params)
        report["steps"].append({"max_abs_diff": diffs[worst], "worst": worst, "moved": moved})
    engine.destroy()
    return report


info = init_distributed(timeout_s=120)
rank, world = info.rank, info.world_size
reports = {stage: check(stage) for stage in stages}
if rank == 0:
    out_path.write_text(json.dumps(reports))
exit_process(0)
