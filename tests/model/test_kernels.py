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
from pretrain.model_config import ModelConfig
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
from pretrain.model_config import ModelConfig
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
from pretrain.model_config import ModelConfig
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
from pretrain.model_config import ModelConfig
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


# The fused gate's trial where Triton's launcher cannot be built: on a GPU Triton compiles a C launcher
# at a kernel's first launch (a C compiler, Python's headers); interpreted here, so the trial runs that
# build itself (triton.runtime.build, the call the NVIDIA driver makes) before the kernel
GATE_BUILD = r"""
import dataclasses, json, logging, os, sys, sysconfig, tempfile, torch
import triton.runtime.build as build
from pretrain.kernels import gate, probe

said = []
class Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("pretrain.kernels.probe").addHandler(Said())
fused = []
apply = gate.FusedGateUpdate.apply
gate.FusedGateUpdate.apply = lambda *a: fused.append(1) or apply(*a)

LAUNCHER = '''#include <Python.h>
static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "grt_probe_launcher", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_grt_probe_launcher(void) { return PyModule_Create(&m); }
'''

def trial(device):
    build.compile_module_from_src(LAUNCHER, "grt_probe_launcher")
    gate._trial(device)

probe.register_fused_path("gate", dataclasses.replace(probe.PATHS["gate"], trial=trial))
paths = sysconfig.get_paths
results = {}
for case in ("builds", "no compiler", "no headers"):
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # no launcher built before
    os.environ.pop("CC", None)
    sysconfig.get_paths = paths
    build._find_compiler.cache_clear()
    if case == "no compiler":
        os.environ["CC"] = "/nonexistent/cc"
    if case == "no headers":
        sysconfig.get_paths = lambda *a, **k: {**paths(*a, **k), "include": "/nonexistent/include"}
    probe._works.clear()
    said.clear(), fused.clear()
    x = [torch.randn(2, 5, 8) for _ in range(3)]
    outs = [gate.gate_update(*x)[0] for _ in range(3)]
    verdicts = probe.probe_fused_paths(torch.device("cpu"))
    ref = gate.gate_update_reference(*x)[0]
    results[case] = {"said": list(said), "fused": len(fused), "verdicts": verdicts,
                     "close": all(torch.allclose(o, ref, rtol=1e-6, atol=1e-6) for o in outs)}
print(json.dumps(results))
"""


def test_the_fused_gate_falls_back_with_one_warning_when_its_launcher_cannot_be_built(tmp_path):
    """Three machines: one that builds the launcher (the kernel runs, 3 fused calls, no warning), one
    without a C compiler, one without Python's headers (gcc fails on Python.h): there the path is off
    after one warning naming what is missing and the cost, every call runs the eager formula with
    the same numbers, and the start-up probe tries nothing again."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", GATE_BUILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert results["builds"] == {"said": [], "fused": 3, "verdicts": {"gate": True}, "close": True}, results
    for case, what in (
        ("no compiler", "missing: a C compiler (CC='/nonexistent/cc' does not exist)"),
        ("no headers", "missing: Python's headers (no Python.h in /nonexistent/include"),
    ):
        got = results[case]
        assert got["fused"] == 0 and got["close"] and got["verdicts"] == {"gate": False}, (case, got)
        assert len(got["said"]) == 1, (case, got["said"])
        assert "the fused gate kernel (Triton) is off on cpu" in got["said"][0] and what in got["said"][0], got
        assert "eager formula" in got["said"][0], got


def test_flash_attn_that_fails_its_trial_is_off_with_one_warning_and_sdpa_runs(monkeypatch, caplog):
    """flash-attn installed but without a kernel for the GPU (a wheel built for another arch, torch or
    CUDA): its trial fails, `auto` takes SDPA from the first call with one warning, and asking for
    flash_attn by name is refused in one line. A flash-attn that works is taken."""
    import logging

    import torch
    import torch.nn.functional as F

    import pretrain.model.layers as layers
    from pretrain.kernels import probe

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(layers, "_flash_applies", lambda device: True)  # as if on CUDA with the package
    monkeypatch.setattr(layers, "flash_attn_func", broken)
    monkeypatch.setattr(probe, "_works", {})
    q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="pretrain.kernels.probe"):
        outs = [layers.attention(q, k, v, layers.AttentionContext(), "auto") for _ in range(3)]
        with pytest.raises(RuntimeError, match="attention='flash_attn' needs the flash-attn package"):
            layers.resolve_backend("flash_attn", q)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "flash-attn's attention is off on cpu" in said[0], said
    assert "missing: a kernel built for this GPU" in said[0] and "scaled_dot_product_attention" in said[0], said
    assert all(torch.equal(o, F.scaled_dot_product_attention(q, k, v, is_causal=True)) for o in outs)

    monkeypatch.setattr(layers, "flash_attn_func", lambda q, k, v, **kw: q)  # a flash-attn that runs
    monkeypatch.setattr(probe, "_works", {})
    assert layers.resolve_backend("auto", q) == "flash_attn"
