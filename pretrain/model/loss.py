"""The language-model loss: cross-entropy of the head's logits, in fp32.

`lm_loss` takes logits that exist. `linear_cross_entropy` is the training loss straight from
the final hidden states: the head's matmul and the cross-entropy are computed chunk by chunk
of tokens, and each chunk's gradients (of the hidden states and of the head's weight) are
computed right away, so the [tokens x vocabulary] logits, their fp32 copy and their gradient
never exist at once (at GPT-2's vocabulary and 16 x 1024 tokens, 3.3 GB each in fp32). Same
FLOPs as the plain loss (no recompute); the loss and gradients equal the plain loss's to fp32
round-off (tests/model/test_loss.py; `grt bench loss` measures the memory).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target that is not scored
CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [B, T, V] against targets [B, T] (-100 = not scored), in fp32;
    reduction 'none' gives the per-token losses [B, T]."""
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )
    return loss if reduction != "none" else loss.view(targets.shape)


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab: int,
        chunk: int,
        grad_enabled: bool,
    ) -> torch.Tensor:
        w = weight[:vocab]  # the padded rows take no part (the plain head slices its logits)
        scored = targets != IGNORE_INDEX
        count = scored.sum().to(torch.float32)  # a device tensor: no host sync
        safe_targets = targets.clamp_min(0)
        # needs_input_grad follows requires_grad alone: under no_grad (evaluation) no gradient is made
        want_h, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = (h[part] @ w.t()).float()
            lse = logits.logsumexp(-1)
            target = safe_targets[part, None]
            total += ((lse - logits.gather(1, target).squeeze(1)) * scored[part]).sum()
            if not (want_h or want_w):
                continue
            # d(sum of losses)/d(logits) = softmax - one_hot(target), zero for unscored tokens
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=grad.dtype))
            grad = grad.mul_(scored[part, None]).to(h.dtype)
            if grad_h is not None:  # want_h
                grad_h[part] = grad @ w
            if grad_w is not None:  # want_w
                grad_w += (grad.t() @ h[part]).float()
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.padded_rows = weight.shape[0] - vocab
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count
        dh = (grad_h * scale).to(grad_h.dtype) if grad_h is not None else None
        dw = None
        if grad_w is not None:
            vocab = grad_w.shape[0]
            dw = torch.zeros((vocab + ctx.padded_rows, grad_w.shape[1]), dtype=ctx.weight_dtype, device=grad_w.device)
            dw[:vocab] = grad_w * scale
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, chunk: int | None = None
) -> torch.Tensor:
    """The mean cross-entropy of `h @ weight[:vocab].T` (h [..., d], targets [...], -100 not
    scored) without materialising the logits: `chunk` tokens at a time (default: 256 MiB of
    fp32 logits). Equals `lm_loss(h @ weight.T[..., :vocab], targets)`, gradients included."""
    h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    return _LinearCrossEntropy.apply(h2, weight, t2, vocab, chunk or chunk_tokens(vocab), torch.is_grad_enabled())
