"""The fused linear cross-entropy (training's loss, pretrain/model/loss.py) against the plain
loss on materialised logits: the same loss and gradients, chunked or not, with padded vocab
rows, unscored targets and bf16."""

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.model import build_model
from pretrain.model.loss import linear_cross_entropy, lm_loss


def _both(dtype, chunk, padded=8, ignore_every=5):
    torch.manual_seed(0)
    vocab, d, n = 37, 16, 50
    h = torch.randn(2, n // 2, d, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(vocab + padded, d)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (2, n // 2))
    targets.view(-1)[::ignore_every] = -100
    fused = linear_cross_entropy(h, w, targets, vocab, chunk=chunk)
    fused.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    plain = lm_loss((h @ w.t())[..., :vocab], targets)
    plain.backward()
    return (fused, *grads), (plain, h.grad, w.grad)


@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
def test_linear_cross_entropy_equals_the_plain_loss_and_gradients_in_fp32(chunk):
    fused, plain = _both(torch.float32, chunk)
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()
    assert fused[2][-8:].abs().max() == 0  # the padded rows get no gradient


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
