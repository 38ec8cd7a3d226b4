"""The optimizer the merged DeepSpeed config gives (pretrain/training/engine/ds_config.py): torch's fused
AdamW on CUDA as on the CPU, chosen by DeepSpeed itself under ZeRO-2 and ZeRO-3 with nothing built
(DeepSpeed's FusedAdam, the CUDA default before, compiles an extension on first use), and the
same update as FusedAdam's kernel (deepspeed/ops/csrc/adam/multi_tensor_adam.cu, AdamW mode)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from multiproc import REPO

from pretrain.runs.train_config import TrainConfig
from pretrain.training.engine.ds_config import build_ds_config, load_ds_json

# Builds a real engine per ZeRO stage from the config merged for CUDA (bf16, as the GPU runs it),
# with every DeepSpeed op build refused, and steps it; prints the optimizer DeepSpeed chose.
ENGINES = r"""
import json, sys, torch
from deepspeed.ops.op_builder.builder import OpBuilder

load = OpBuilder.load

def refuse(self, *args, **kwargs):
    # the CPU accelerator's shared-memory collectives are no CUDA op: the GPU never loads them
    if self.name != "deepspeed_shm_comm":
        raise RuntimeError(f"DeepSpeed would build its {self.name} op")
    return load(self, *args, **kwargs)

OpBuilder.load = refuse
from pretrain.distributed import exit_process, init_distributed
from pretrain.presets import get_preset
from pretrain.runs.run_config import RunConfig
from pretrain.training.engine.ds_config import build_ds_config, load_ds_json
from pretrain.training.engine.build import build_engine

init_distributed(timeout_s=120)
chosen = {}
for stage in (2, 3):
    cfg = RunConfig(data="unused", ds_config=f"ds_configs/zero{stage}.json")
    cfg.model = get_preset("micro-grt").replace(max_seq_len=16)
    cfg.train.micro_batch_size, cfg.train.activation_checkpointing = 2, "off"
    ds = build_ds_config(load_ds_json(cfg.ds_config), cfg.train, 1, use_cuda=True)
    engine, _ = build_engine(cfg, 1, torch.device("cpu"), 16, ds)
    for _ in range(2):
        idx = torch.randint(0, cfg.model.vocab_size, (2, 17))
        engine.backward(engine(idx[:, :-1], idx[:, 1:], return_logits=False).loss)
        engine.step()
    opt = engine.basic_optimizer
    chosen[stage] = {
        "class": f"{type(opt).__module__}.{type(opt).__qualname__}",
        "fused": opt.defaults.get("fused"),
        "bf16": engine.bfloat16_enabled(),
        "stepped": all(len(s) > 0 for s in opt.state.values()) and len(opt.state) > 0,
    }
print(json.dumps(chosen))
exit_process(0)
"""


@pytest.mark.slow
def test_deepspeed_uses_torchs_fused_adamw_on_cuda_under_zero2_and_zero3_without_a_build():
    r = subprocess.run(
        [sys.executable, "-c", ENGINES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chosen = json.loads(r.stdout.strip().splitlines()[-1])
    for stage in ("2", "3"):
        assert chosen[stage] == {"class": "torch.optim.adamw.AdamW", "fused": True, "bf16": True, "stepped": True}, (
            stage,
            chosen,
        )


def fused_adam_reference(p, grads, lr, betas, eps, weight_decay):
    """DeepSpeed's FusedAdam in AdamW mode (ADAM_MODE_1 of multi_tensor_adam.cu), step by step, fp32."""
    beta1, beta2 = betas
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, 1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = torch.sqrt(v / (1 - beta2**step)) + eps
        p = p - lr * ((m / (1 - beta1**step)) / denom + weight_decay * p)
    return p


def test_the_configured_optimizer_makes_fused_adams_update():
    """A few steps of the optimizer the merged config names, built as DeepSpeed builds it
    (`torch_adam` popped, the rest as keyword arguments), equal FusedAdam's. A large rate and
    weight decay, so that L2 mode instead of decoupled decay (or a missed bias correction) shows."""
    train = TrainConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    params = dict(
        build_ds_config(load_ds_json("ds_configs/zero2.json"), train, 1, use_cuda=True)["optimizer"]["params"]
    )
    assert params.pop("torch_adam") is True
    torch.manual_seed(0)
    start = torch.randn(4096)
    grads = [torch.randn(4096) * (0.1 + i) for i in range(5)]
    p = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([p], **params)
    assert opt.defaults["fused"] is True
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = fused_adam_reference(start, grads, train.lr, train.betas, params["eps"], train.weight_decay)
    assert (want - start).abs().max() > 1e-2  # the steps moved the weights: the comparison means something
    torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
