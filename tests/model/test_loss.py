"""The fused linear cross-entropy (training's loss, pretrain/model/loss.py) against the plain
loss on materialised logits (the reference: logits, then F.cross_entropy in fp32): the same loss
and gradients of the hidden states and of the weight, chunked or not, eager and compiled, with
and without padded vocab rows, with unscored targets, and in bf16."""

import logging

import pytest
import torch

from pretrain.model import build_model
from pretrain.model.loss import compile_available, linear_cross_entropy, lm_loss, resolve_impl
from pretrain.model_config import ModelConfig


def _both(dtype, chunk, padded=8, ignore_every=5, impl="eager"):
    torch.manual_seed(0)
    vocab, d, n = 37, 16, 50
    h = torch.randn(2, n // 2, d, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(vocab + padded, d)).to(dtype)
    w[vocab:] *= 10  # padded rows that would dominate the softmax if they took part
    w.requires_grad_()
    targets = torch.randint(0, vocab, (2, n // 2))
    targets.view(-1)[::ignore_every] = -100
    fused = linear_cross_entropy(h, w, targets, vocab, chunk=chunk, impl=impl)
    fused.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    plain = lm_loss((h @ w.t())[..., :vocab], targets)
    plain.backward()
    return (fused, *grads), (plain, h.grad, w.grad)


def _assert_equal_to_the_reference(fused, plain, padded):
    for what, a, b in zip(("loss", "grad of h", "grad of the weight"), fused, plain):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (what, (a - b).abs().max())
    if padded:
        assert fused[2][-padded:].abs().max() == 0  # the padded rows get no gradient


@pytest.mark.parametrize("padded", [0, 8])
@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
def test_linear_cross_entropy_equals_the_plain_loss_and_gradients_in_fp32(chunk, padded):
    fused, plain = _both(torch.float32, chunk, padded)
    _assert_equal_to_the_reference(fused, plain, padded)


@pytest.mark.skipif(not compile_available(torch.device("cpu")), reason="no C++ compiler for torch.compile")
def test_the_compiled_chunk_equals_the_plain_loss_and_gradients_in_fp32():
    """The per-chunk function under torch.compile, as CUDA runs it by default: padded (the mask in
    the compiled graph) and not, a last chunk shorter than the others (a second, dynamic shape)."""
    for padded in (8, 0):
        fused, plain = _both(torch.float32, 20, padded, impl="compiled")
        _assert_equal_to_the_reference(fused, plain, padded)


def test_loss_impls_are_chosen_by_device_and_refused_where_they_cannot_run():
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    assert resolve_impl("auto", h, w) == "eager"  # the CPU: a compile costs more than it saves
    with pytest.raises(RuntimeError, match="'cce' needs the cut-cross-entropy package, CUDA tensors"):
        resolve_impl("cce", h, w)
    with pytest.raises(ValueError, match="accepted values are auto, cce, compiled, eager"):
        resolve_impl("fused", h, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cut-cross-entropy runs on CUDA")
def test_cut_cross_entropy_equals_the_plain_loss_where_it_is_installed():
    pytest.importorskip("cut_cross_entropy")
    torch.manual_seed(0)
    vocab, padded = 1000, 24
    h = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.1 * torch.randn(vocab + padded, 64, device="cuda")).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (300,), device="cuda")
    targets[::7] = -100
    results = []
    for impl in ("cce", "eager"):
        loss = linear_cross_entropy(h, w, targets, vocab, impl=impl)
        loss.backward()
        results.append((loss.detach(), h.grad.float(), w.grad.float()))
        h.grad = w.grad = None
    for a, b in zip(*results):  # both in bf16: within a few roundings of each other
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), (a - b).abs().max()
    assert results[0][2][vocab:].abs().max() == 0


def test_linear_cross_entropy_in_bf16_is_as_close_as_the_plain_bf16_loss():
    fused, plain = _both(torch.bfloat16, 7)
    ref, _ = _both(torch.float32, 7)
    for a, b, r in zip(fused, plain, ref):
        assert a.dtype == b.dtype
        # both round to bf16 (spacing 2^-8 relative): each within a few roundings of fp32
        scale = r.abs().max()
        assert (a.float() - r).abs().max() <= 2e-2 * scale and (b.float() - r).abs().max() <= 2e-2 * scale


def test_the_model_trains_with_the_same_loss_and_gradients_without_logits():
    cfg = ModelConfig(
        layout="1+1x2+1",
        d_model=32,
        n_heads=2,
        vocab_size=97,
        pad_vocab_multiple=64,
        max_seq_len=16,
        state_noise_std=0,
        gate_noise_std=0,
    )
    torch.manual_seed(0)
    model = build_model(cfg).train()
    idx = torch.randint(0, 97, (3, 16))
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(idx, idx, return_logits=return_logits)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (with_logits, ref), (without, fused) = results
    assert without.logits is None and with_logits.logits is not None
    assert torch.allclose(with_logits.loss, without.loss, atol=1e-6)
    for name, g in ref.items():
        assert torch.allclose(fused[name], g, atol=1e-6, rtol=1e-4), name


def test_no_gradient_is_computed_without_grad_mode():
    """Validation runs the loss under no_grad: one matmul per chunk (the logits), not three."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 37, (40,))
    for grad_mode, expected in ((False, 4), (True, 12)):
        with torch.set_grad_enabled(grad_mode), CountMatmuls() as counter:
            loss = linear_cross_entropy(h, w, targets, 37, chunk=10)
        assert counter.count == expected, (grad_mode, counter.count)
        assert torch.allclose(loss, lm_loss((h @ w.t())[None], targets[None]).detach(), atol=1e-6)


def test_chunks_are_whole_tiles_sized_by_the_free_cuda_memory(monkeypatch):
    """Chunks of a multiple of 256 tokens, equal but the last: off CUDA 256 MiB of fp32 logits (1,280
    tokens at GPT-2's padded width); on CUDA within a quarter of the memory free at the first call
    (8 bytes a logit: its bf16 product, fp32 value and bf16 gradient), read once
    (the CUDA calls stubbed: the sizing is arithmetic on what they return)."""
    from pretrain.model import loss

    assert loss.loss_chunk(16384, 50304, torch.device("cpu")) == 1280
    assert loss.loss_chunk(1000, 50304, torch.device("cpu")) == 1024  # one chunk, a whole tile
    assert loss.loss_chunk(0, 50304, torch.device("cpu")) == 256
    reads = []

    def free(device):
        reads.append(device)
        return (free_bytes, 2**40)

    monkeypatch.setattr(torch.cuda, "mem_get_info", free)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2**30)  # 1 GiB cached, free to reuse
    monkeypatch.setattr(loss, "_cuda_chunks", {})
    free_bytes = 100 * 2**30  # an H200 after the engine: one chunk
    assert loss.loss_chunk(16384, 50304, torch.device("cuda", 0)) == 16384
    free_bytes = 3 * 2**30  # 4 GiB with the cache: 1 GiB at 8 bytes a logit, 2,668 tokens -> 7 chunks
    assert loss.loss_chunk(16384, 50304, torch.device("cuda", 1)) == 2560
    free_bytes = 0  # read once per device and size: later calls keep the first answer
    assert loss.loss_chunk(16384, 50304, torch.device("cuda", 1)) == 2560
    assert len(reads) == 2


def test_the_weight_gradient_is_summed_inside_the_matmul():
    """No pass over the [V, d] weight gradient besides the GEMMs that write it (the first chunk's mm,
    then each chunk's addmm into the fp32 sum): no zero-fill, no cast, no separate add."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightShapedOps(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.ops = shape, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == self.shape:
                self.ops.append(func)
            return out

    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 37, (40,))
    with WeightShapedOps(w.shape) as seen:
        loss = linear_cross_entropy(h, w, targets, 37, chunk=10)
    assert seen.ops == [torch.ops.aten.mm.default] + [torch.ops.aten.addmm.default] * 3, seen.ops
    loss.backward()
    h32, w32 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lm_loss((h32 @ w32.t())[None], targets[None]).backward()
    assert torch.allclose(w.grad, w32.grad, atol=1e-6, rtol=1e-5)


def test_a_compiled_loss_chunk_that_cannot_be_built_is_off_with_one_warning(monkeypatch, caplog):
    """The compiled chunk's trial (kernels/probe.py) on a machine whose C++ compiler is missing: the
    real inductor build fails, the path is off with one warning that names the compiler and the
    cost, `compiled` is refused in one line and the loss runs eagerly. Without the trial the first
    training step would fail there instead."""
    import torch._inductor.config as inductor

    from pretrain.kernels import probe

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent-c++",))
    monkeypatch.setattr(inductor, "force_disable_caches", True)  # a cached graph or kernel would need no build
    monkeypatch.setattr(probe, "_works", {})
    h, w, targets = torch.randn(300, 16), torch.randn(40, 16), torch.randint(0, 40, (300,))
    with caplog.at_level(logging.WARNING, logger="pretrain.kernels.probe"):
        assert not compile_available(torch.device("cpu")) and not compile_available(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="loss impl 'compiled': torch.compile cannot build code on cpu"):
            resolve_impl("compiled", h, w)
        loss = linear_cross_entropy(h, w, targets, 40)
    (said,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "the compiled loss chunk (torch.compile) is off on cpu" in said, said
    assert "missing: a C++ compiler" in said and "impl 'eager'" in said, said
    assert torch.allclose(loss, lm_loss((h @ w.t())[None], targets[None]), rtol=1e-5)
