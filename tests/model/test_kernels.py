"""The fused gate kernel against the eager reference. TRITON_INTERPRET=1 runs the Triton
kernel on the CPU, so this runs in CI without a GPU (in a subprocess: the variable must be
set before Triton is imported)."""

import json
import os
import subprocess
import sys

import pytest
from multiproc import REPO

pytest.importorskip("triton")

CHECK = r"""
import json, torch
from pretrain.kernels.gate import FusedGateUpdate, gate_update_reference, fused_available
torch.manual_seed(0)
results = {}
for dtype in (torch.float32, torch.bfloat16):
    x = [torch.randn(3, 37, 48, dtype=dtype, requires_grad=True) for _ in range(3)]
    assert fused_available(x[1])
    out, g = FusedGateUpdate.apply(*x)
    w = torch.randn_like(out)
    (out * w).float().sum().backward()
    fused_grads = [t.grad.float().clone() for t in x]
    for t in x:
        t.grad = None
    ref, g_ref = gate_update_reference(*[t.float() for t in x])
    (ref * w.float()).sum().backward()
    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
    results[str(dtype)] = {"out": rel(out, ref), "gate": rel(g, g_ref),
                           "grads": [rel(a, t.grad) for a, t in zip(fused_grads, x)]}
print(json.dumps(results))
"""


def test_fused_gate_update_matches_eager_forward_and_backward():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    tolerance = {"torch.float32": 1e-5, "torch.bfloat16": 1e-2}  # bf16: 8 bits of mantissa
    for dtype, r in results.items():
        assert r["out"] <= tolerance[dtype] and r["gate"] <= tolerance[dtype], (dtype, r)
        assert all(e <= tolerance[dtype] for e in r["grads"]), (dtype, r)


def test_model_uses_the_fused_update_and_keeps_its_gradients():
    script = r"""
import torch
from pretrain.config import ModelConfig
from pretrain.model import build_model
import pretrain.kernels.gate as gate
calls = []
original = gate.FusedGateUpdate.apply
gate.FusedGateUpdate.apply = lambda *a: calls.append(1) or original(*a)
cfg = ModelConfig(
    layout="1+1x3+1", d_model=32, n_heads=2, vocab_size=97, max_seq_len=16, state_noise_std=0, gate_noise_std=0
)
torch.manual_seed(0)
model = build_model(cfg).train()
idx = torch.randint(0, 97, (2, 16))
loss = model(idx, idx).loss
loss.backward()
fused = {n: p.grad.clone() for n, p in model.named_parameters()}
assert len(calls) == 3, calls
gate.fused_available = lambda t: False
import pretrain.model.gpt as gpt
model.zero_grad()
model(idx, idx).loss.backward()
worst = max(
    ((fused[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
    for n, p in model.named_parameters()
)
assert worst < 1e-4, worst
print("ok", worst)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_fused_update_runs_under_bf16_autocast():
    """Under bf16 autocast the core output is bf16, the gate logits (an fp32 matmul, FP32Linear) and
    the state fp32: the fused kernel must take them as they are (it used to fall back to eager on any
    dtype mismatch, so it never ran in bf16 training), with eager's output dtypes and states, and
    gradients as close to fp32 as eager autocast's."""
    script = r"""
import torch
from pretrain.config import ModelConfig
from pretrain.model import build_model
import pretrain.kernels.gate as gate
seen = []
original = gate.FusedGateUpdate.apply
gate.FusedGateUpdate.apply = lambda *a: seen.append(tuple(str(t.dtype) for t in a)) or original(*a)
cfg = ModelConfig(
    layout="1+1x3+1", d_model=32, n_heads=2, vocab_size=97, max_seq_len=16, state_noise_std=0, gate_noise_std=0
)
torch.manual_seed(0)
model = build_model(cfg).train()
idx = torch.randint(0, 97, (2, 16))

def run(bf16=True):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(idx, idx, return_states=True)
    out.loss.backward()
    return out, {n: p.grad.float().clone() for n, p in model.named_parameters()}

fused_out, fused = run()
assert len(seen) == 3 and seen[0] == ("torch.float32", "torch.float32", "torch.bfloat16"), seen
gate.fused_available = lambda t: False
eager_out, eager = run()
_, fp32 = run(bf16=False)
assert [s.dtype for s in fused_out.states] == [s.dtype for s in eager_out.states], "state dtypes differ from eager"
def worst(grads, ref=fp32):
    return max(((grads[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item() for n in ref)
# the same fp32 formula on the same inputs: the kernel's states are eager's to fp32 round-off
for a, b in zip(fused_out.states, eager_out.states):
    assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 1e-5
# eager now reads the same fp32 logits (no bf16 sigmoid for the kernel to beat): both equally close to fp32
assert worst(fused) < 5e-2 and worst(eager) < 5e-2, (worst(fused), worst(eager))
assert worst(fused, eager) < 2e-2, worst(fused, eager)
print("ok", worst(fused), worst(eager), worst(fused, eager))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_compiled_loop_step_traces_the_eager_gate_and_eager_runs_the_kernel():
    """Which gate path runs where (kernels/gate.py `fused_path`): eagerly the Triton kernel, inside
    torch.compile the eager formula, which the compiler fuses (no opaque autograd.Function in the
    graph, no graph break). Both give the uncompiled reference's gradients."""
    script = r"""
import torch
from pretrain.config import ModelConfig
from pretrain.model import build_model
from pretrain.training.engine.parallelize import apply_compile
import pretrain.kernels.gate as gate
from torch._dynamo.utils import counters
calls = []
original = gate.FusedGateUpdate.apply
gate.FusedGateUpdate.apply = lambda *a: calls.append(1) or original(*a)
cfg = ModelConfig(
    layout="1+1x3+1", d_model=32, n_heads=2, vocab_size=97, max_seq_len=16, state_noise_std=0, gate_noise_std=0
)
idx = torch.randint(0, 97, (2, 16))
def grads(compiled):
    torch.manual_seed(0)
    model = build_model(cfg).train()
    if compiled:
        apply_compile(model)
    model(idx, idx, return_logits=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}
eager = grads(False)
eager_calls = len(calls)
compiled = grads(True)
assert eager_calls == 3 and len(calls) == 3, (eager_calls, len(calls))  # compiled: no kernel launch of ours
assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
worst = max(((compiled[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in eager.items())
assert worst < 1e-4, worst
print("ok", worst)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_fused_update_runs_with_bf16_weights_as_deepspeeds_bf16_mode_casts_them():
    """DeepSpeed's bf16 mode casts the whole model (no autocast): the core output is bf16, the gate's
    logits fp32 (gate_out upcasts its bf16 weights) and the state fp32. The kernel runs on those three
    dtypes at every loop step, forward and backward, and the logits it reads are the fp32 matmul's."""
    script = r"""
import torch
import torch.nn.functional as F
from pretrain.config import ModelConfig
from pretrain.model import build_model
import pretrain.kernels.gate as gate
seen = []
original = gate.FusedGateUpdate.apply
def spy(*a):
    seen.append((tuple(str(t.dtype) for t in a), a[0].detach().clone()))
    return original(*a)
gate.FusedGateUpdate.apply = spy
cfg = ModelConfig(
    layout="1+1x3+1", d_model=32, n_heads=2, vocab_size=97, max_seq_len=16, state_noise_std=0, gate_noise_std=0
)
torch.manual_seed(0)
model = build_model(cfg).to(torch.bfloat16).train()
idx = torch.randint(0, 97, (2, 16))
out = model(idx, idx, return_logits=False, return_states=True)
out.loss.backward()
assert [d for d, _ in seen] == [("torch.float32", "torch.float32", "torch.bfloat16")] * 3, [d for d, _ in seen]
assert [s.dtype for s in out.states] == [torch.float32] * 4
assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())
loop = model.loop
s1 = out.states[0].detach()
terms = loop.anchor_terms(s1)
h = F.silu(loop.gate_fc_state(loop.gate_norm_state(s1.to(torch.bfloat16))) + terms.gate)
fp32 = F.linear(h.float(), loop.gate_out.weight.float(), loop.gate_out.bias.float())
assert torch.equal(seen[0][1], fp32), (seen[0][1] - fp32).abs().max()
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
