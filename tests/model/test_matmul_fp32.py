"""The gate's logits as bf16 GEMMs with fp32 accumulation (pretrain/kernels/matmul.py): the numbers
of the fp32 matmul of the same bf16 values, forward and backward, and the path the bf16 model
(DeepSpeed's bf16 mode) actually takes. On the CPU the upcast matmul stands in for cuBLAS's
out_dtype GEMM (the same arithmetic: exact products, fp32 sums); the CUDA test runs the GEMM."""

import pytest
import torch
import torch.nn.functional as F

import pretrain.model.layers as layers
from pretrain.kernels.matmul import addmm_fp32, fp32_linear, mm_fp32, tensor_core_fp32
from pretrain.model import build_model
from pretrain.presets import get_preset

BF16_ULP = 2.0**-7  # bf16's spacing relative to a value's power of two


def _operands(device="cpu", n=96, d_in=64, d_out=48):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, n // 3, d_in, device=device, generator=gen).to(torch.bfloat16)
    w = (0.1 * torch.randn(d_out, d_in, device=device, generator=gen)).to(torch.bfloat16)
    b = (4 + 0.1 * torch.randn(d_out, device=device, generator=gen)).to(torch.bfloat16)
    g = torch.randn(3, n // 3, d_out, device=device, generator=gen)  # an fp32 gradient of the logits
    return x, w, b, g


def _fp32_reference(x, w, b, g):
    """Today's FP32Linear: the operands upcast, F.linear in fp32, the gradients cast back."""
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = F.linear(x.float(), w.float(), b.float())
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


def _fast(x, w, b, g):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp32_linear(x, w, b)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


def _assert_same_numbers(fast, ref):
    y, dx, dw, db = fast
    y_ref, dx_ref, dw_ref, db_ref = ref
    assert y.dtype == torch.float32
    assert torch.allclose(y, y_ref, rtol=1e-6, atol=1e-6), (y - y_ref).abs().max()
    assert not torch.equal(y, y.to(torch.bfloat16).float())  # finer than bf16's grid
    for got, want in ((dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert got.dtype == want.dtype == torch.bfloat16
        # both are the fp32 gradient rounded to bf16: equal but where the fp32 values (within fp32's
        # rounding of each other, 1e-5 of the largest after cancellation) straddle a bf16 rounding
        # boundary, one bf16 step apart
        diff = (got.float() - want.float()).abs()
        assert (diff <= BF16_ULP * want.float().abs() + 1e-5 * want.float().abs().max()).all(), diff.max()
        assert (diff > 0).float().mean() < 0.01, (diff > 0).float().mean()


def test_the_gate_linear_gives_the_fp32_matmuls_numbers_forward_and_backward():
    x, w, b, g = _operands()
    _assert_same_numbers(_fast(x, w, b, g), _fp32_reference(x, w, b, g))


def test_a_bf16_gradient_would_not_pass_that_comparison():
    """The comparison can fail: a backward on the gradient rounded to bf16 (a plain bf16 linear's)
    is off in far more than 1% of the weight gradient's elements."""
    x, w, b, g = _operands()
    dw_bf16 = (g.to(torch.bfloat16).flatten(0, 1).float().t() @ x.flatten(0, 1).float()).to(torch.bfloat16)
    dw_ref = _fp32_reference(x, w, b, g)[2]
    assert (dw_bf16 != dw_ref).float().mean() > 0.05


def test_the_fp32_accumulating_addmm_equals_the_fp32_sum():
    x, w, _, _ = _operands()
    a, bt = x.flatten(0, 1), w.t().contiguous()
    acc = torch.randn(a.shape[0], bt.shape[1])
    want = acc + a.float() @ bt.float()
    assert torch.allclose(addmm_fp32(acc, a, bt), want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(mm_fp32(a, bt), a.float() @ bt.float(), rtol=1e-6, atol=1e-6)
    assert not tensor_core_fp32(a, bt)  # the CPU: the upcast matmul stands in


def test_the_bf16_model_takes_the_tensor_core_path_and_fp32_weights_do_not(monkeypatch):
    """The gate's operands must all be bf16 for the GEMM path; a dtype mismatch (the fp32 state, a
    gate input left in fp32) would silently send every step down the fp32 path. Count the calls."""
    calls = []

    def counting(x, w, b):
        calls.append((x.dtype, w.dtype))
        return fp32_linear(x, w, b)

    monkeypatch.setattr(layers, "fp32_linear", counting)
    cfg = get_preset("micro-grt").replace(gate_noise_std=0.0, state_noise_std=0.0)
    model = build_model(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx).loss.backward()
    assert calls == []  # fp32 weights: the fp32 matmul
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights under autocast: still fp32 (same numbers)
        model(idx, idx).loss.backward()
    assert calls == []
    model.to(torch.bfloat16)  # as DeepSpeed's bf16 mode casts it
    model(idx, idx).loss.backward()
    assert len(calls) == model.max_loops and set(calls) == {(torch.bfloat16, torch.bfloat16)}
    assert all(p.grad is not None for p in model.loop.gate_out.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's out_dtype GEMM runs on CUDA")
def test_on_cuda_the_gemm_gives_the_fp32_matmuls_numbers_eager_and_compiled():
    x, w, b, g = _operands("cuda", n=3 * 512, d_in=768, d_out=768)
    assert tensor_core_fp32(x, w)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _fp32_reference(x, w, b, g)
    _assert_same_numbers(_fast(x, w, b, g), ref)
    compiled = torch.compile(fp32_linear, fullgraph=True)
    xc, wc, bc = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = compiled(xc, wc, bc)
    y.backward(g)
    _assert_same_numbers((y.detach(), xc.grad, wc.grad, bc.grad), ref)


def test_a_gemm_form_without_a_kernel_here_is_off_with_one_warning_and_the_upcast_matmul_runs(monkeypatch, caplog):
    """The fp32-result GEMM's trials (kernels/probe.py) where torch has no kernel for them: the CPU,
    told that its bf16 tensors are tensor-core operands, is such a device (the dispatcher has no CPU
    kernel for `mm.dtype` or `addmm.dtype`). Each form's trial fails, the path is off with one
    warning naming the missing kernel and the cost, and the gate's logits come from the upcast
    matmul: the same numbers. Without the `mm` trial, `fp32_linear` raises here."""
    import logging

    import pretrain.kernels.matmul as matmul
    from pretrain.kernels import probe

    monkeypatch.setattr(matmul, "_bf16_on_cuda", lambda t: t.dtype == torch.bfloat16)
    monkeypatch.setattr(probe, "_works", {})
    x, w, b, _ = _operands()
    with caplog.at_level(logging.WARNING, logger="pretrain.kernels.probe"):
        ys = [fp32_linear(x, w, b) for _ in range(3)]
        assert not probe.fused_path_works("addmm-fp32", torch.device("cpu"))
        assert probe.probe_fused_paths(torch.device("cpu")) == {}  # neither applies off CUDA: nothing tried again
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2, said
    assert "the bf16 GEMM with an fp32 result (torch.mm out_dtype) is off on cpu" in said[0], said
    assert "missing: a kernel of this op for this device" in said[0] and "fp32 GEMMs" in said[0], said
    assert "the fp32-accumulating addmm" in said[1] and "one more pass" in said[1], said
    ref = F.linear(x.float(), w.float(), b.float())
    assert all(torch.allclose(y, ref, rtol=1e-6, atol=1e-6) for y in ys)
