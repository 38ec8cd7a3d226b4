"""The language-model loss: cross-entropy of the head's logits, in fp32.

`lm_loss` takes logits that exist. `linear_cross_entropy` is the training loss straight from
the final hidden states: the head's matmul and the cross-entropy are computed chunk by chunk
of tokens, and each chunk's gradients (of the hidden states and of the head's weight) are
computed right away, so the [tokens x vocabulary] logits, their fp32 copy and their gradient
never exist at once (at GPT-2's vocabulary and 16 x 1024 tokens, 3.3 GB each in fp32). Same
FLOPs as the plain loss (no recompute). A chunk is a multiple of 256 tokens (the matmuls' tiles),
the chunks of a call equal: on CUDA its buffers (8 bytes a logit) within a quarter of the memory
free at the first call (after the engine, with the forward's activations live; one chunk on a
large card), elsewhere 256 MiB of fp32 logits. The weight's gradient is summed over chunks in fp32 inside the matmul
(`addmm_fp32`: bf16 products, fp32 accumulation, no product rounded to bf16, no cast-and-add).

The matmuls run on the whole (padded) weight, 50,304 rows for GPT-2's 50,257: an aligned width
for the GPU's fast matmul kernels; the padded logits are -inf (no probability, no gradient).
How a chunk is computed (`impl`): `compiled`, the per-chunk function under torch.compile (the
mask, log-sum-exp, softmax and its cast fused into a few kernels between the matmuls);
`eager`, the same function run op by op; `cce`, cut-cross-entropy's fused kernel where it is
installed (CUDA; the `fused-loss` extra). `auto` picks cce, else compiled (where its start-up
trial built a kernel: kernels/probe.py), on CUDA, and eager on the CPU, where the compile
(10-60 s a process) costs more than it saves at CPU sizes. Every impl gives the plain loss's
value and gradients (tests/model/test_loss.py; `grt bench loss` times them).
"""

from __future__ import annotations

import os
import shutil
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pretrain.kernels.matmul import addmm_fp32, mm_fp32
from pretrain.kernels.probe import FusedPath, fused_path_works, register_fused_path

try:  # optional: Apple's cut-cross-entropy (CUDA, Triton)
    from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy
except Exception:  # noqa: BLE001 - any import failure means "not available"
    cce_linear_cross_entropy = None

IGNORE_INDEX = -100  # a target that is not scored
CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits, off CUDA (and the memory plan's least)
CHUNK_MULTIPLE = 256  # tokens: whole tiles of the matmuls
FREE_SHARE = 0.25  # of the free CUDA memory, for one chunk's buffers
CUDA_LOGIT_BYTES = 8  # a chunk's buffers per logit on CUDA: its bf16 product, fp32 value and bf16 gradient
LOSS_IMPLS = ("auto", "cce", "compiled", "eager")

ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor | None]]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [B, T, V] against targets [B, T] (-100 = not scored), in fp32;
    reduction 'none' gives the per-token losses [B, T]."""
    flat = targets.flatten()
    how = "sum" if reduction == "mean" else reduction
    loss = F.cross_entropy(logits.float().flatten(0, 1), flat, ignore_index=IGNORE_INDEX, reduction=how)
    if reduction == "mean":  # over the scored targets; none scored (a loss mask's): 0, not 0/0
        return loss / scored_count(flat)
    return loss if reduction != "none" else loss.view(targets.shape)


def is_scored(targets: torch.Tensor) -> torch.Tensor:
    """Which targets the loss scores (the others are IGNORE_INDEX: a loss mask's, a window's
    context): the one test behind every figure that counts or averages the loss's tokens."""
    return targets != IGNORE_INDEX


def scored_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many targets the loss scores: an int64 tensor on targets' device (no host sync), for the
    counters that sum it until a log point (`grt analyze`, `grt eval`, validation)."""
    return is_scored(targets).sum()


def scored_count(targets: torch.Tensor) -> torch.Tensor:
    """How many targets the loss scores, at least 1 (a micro-batch whose loss mask scores nothing
    then has loss 0 and no gradient, not NaN); an fp32 device tensor: no host sync."""
    return scored_tokens(targets).clamp(min=1).to(torch.float32)


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The most tokens whose fp32 logits fit in chunk_bytes, a multiple of CHUNK_MULTIPLE (at least one)."""
    return max(CHUNK_MULTIPLE, chunk_bytes // (4 * vocab) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def cuda_chunk_tokens(width: int, free_bytes: int) -> int:
    """The most tokens a CUDA chunk may have with `free_bytes` free: its buffers within FREE_SHARE."""
    return chunk_tokens(width, int(FREE_SHARE * free_bytes) * 4 // CUDA_LOGIT_BYTES)


_cuda_chunks: dict[tuple[torch.device, int, int], int] = {}  # (device, tokens, width) -> chunk, decided once


def loss_chunk(tokens: int, width: int, device: torch.device) -> int:
    """Tokens per chunk for `tokens` tokens at `width` logits: equal chunks, a multiple of
    CHUNK_MULTIPLE, each within the budget (module docstring). On CUDA the free memory is read once
    per (tokens, width), so every later micro-batch takes the same chunk (one compiled shape)."""
    key = (device, tokens, width)
    if device.type == "cuda" and key not in _cuda_chunks and not torch.compiler.is_compiling():
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's cache
        _cuda_chunks[key] = cuda_chunk_tokens(width, free)
    most = _cuda_chunks.get(key) or chunk_tokens(width)
    count = max(1, -(-tokens // most))
    per = max(1, -(-tokens // count))
    return -(-per // CHUNK_MULTIPLE) * CHUNK_MULTIPLE


def chunk_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of tokens: (the summed loss, d(summed loss)/d(logits) in h's dtype, or None
    without want_grad). The logits of weight's rows from `vocab` on (the padding) are -inf."""
    logits = (h @ weight.t()).float()
    if vocab < weight.shape[0]:
        logits.masked_fill_(torch.arange(weight.shape[0], device=h.device) >= vocab, float("-inf"))
    scored = is_scored(targets)
    target = targets.clamp_min(0)[:, None]
    lse = logits.logsumexp(-1)
    loss = ((lse - logits.gather(1, target).squeeze(1)) * scored).sum()
    if not want_grad:
        return loss, None
    # softmax - one_hot(target), zero for unscored tokens (in place: eagerly one [chunk x V] fp32 buffer)
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=grad.dtype))
    return loss, grad.mul_(scored[:, None]).to(h.dtype)


_compiled_chunk: ChunkFn | None = None


def compiled_chunk_loss() -> ChunkFn:
    """`chunk_loss` under torch.compile, built once per process (a second chunk size, the last
    chunk's, makes its token dimension dynamic: no recompile per batch after that)."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(chunk_loss)
    return _compiled_chunk


def compile_available(device: torch.device) -> bool:
    """Whether torch.compile can build the chunk here: Triton on CUDA, a C++ compiler on the CPU
    (the static check), and a tiny compiled chunk built and ran on this device (`_trial_compile`)."""
    return _compile_applies(device) and fused_path_works("loss-compiled", device)


def _compile_applies(device: torch.device) -> bool:
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _trial_compile(device: torch.device) -> None:
    """One small function compiled and run here: inductor's code generation and build (on CUDA a
    Triton kernel and its launcher: a C compiler and Python's headers; on the CPU a C++ build), the
    toolchain the chunk needs, at the cost of one small kernel (the chunk's own compile, several
    kernels, follows at the first batch and reuses what this one loaded)."""
    fresh = types.FunctionType(_trial_fn.__code__.replace(), globals())  # its own code: compiled, not found compiled
    torch.compile(fresh)(torch.randn(8, 64, device=device))


def _trial_fn(x: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(x) * x).logsumexp(-1)


register_fused_path(
    "loss-compiled",
    FusedPath(
        "the compiled loss chunk (torch.compile)",
        "the loss runs each chunk op by op (impl 'eager'): the same numbers, about twice the loss's "
        "element-wise passes over the [chunk x vocabulary] logits",
        lambda device: device.type == "cuda" and cce_linear_cross_entropy is None and _compile_applies(device),
        _trial_compile,
    ),
)


def resolve_impl(impl: str, h: torch.Tensor, weight: torch.Tensor) -> str:
    """The implementation `impl` names on these inputs; `auto` as the module's docstring says.
    An impl that cannot run here is refused in one line."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r}: accepted values are {', '.join(LOSS_IMPLS)}")
    cce_ok = cce_linear_cross_entropy is not None and h.is_cuda and h.dtype == weight.dtype
    if impl == "auto":
        if not h.is_cuda:
            return "eager"
        return "cce" if cce_ok else "compiled" if compile_available(h.device) else "eager"
    if impl == "cce" and not cce_ok:
        raise RuntimeError("loss impl 'cce' needs the cut-cross-entropy package, CUDA tensors and one dtype")
    if impl == "compiled" and not compile_available(h.device):
        raise RuntimeError(f"loss impl 'compiled': torch.compile cannot build code on {h.device.type} here")
    return impl


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
        step: ChunkFn,
    ) -> torch.Tensor:
        count = scored_count(targets)
        # needs_input_grad follows requires_grad alone: under no_grad (evaluation) no gradient is made
        want_h, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w: torch.Tensor | None = None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            part = slice(start, start + chunk)
            loss, grad = step(h[part], weight, targets[part], vocab, want_h or want_w)
            total += loss
            if grad is None:
                continue
            if grad_h is not None:
                grad_h[part] = grad @ weight
            if want_w:  # an fp32 sum over chunks, in the GEMM (bf16 products, fp32 accumulation)
                gt = grad.t()
                grad_w = mm_fp32(gt, h[part]) if grad_w is None else addmm_fp32(grad_w, gt, h[part])
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count
        dh = (grad_h * scale).to(grad_h.dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    chunk: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """The mean cross-entropy of `h @ weight.T` over the first `vocab` of weight's rows (h [..., d],
    targets [...], -100 not scored; the rows after `vocab` are padding) without materialising the
    logits: `chunk` tokens at a time (default: `loss_chunk`). Equals
    `lm_loss((h @ weight.T)[..., :vocab], targets)`, gradients included."""
    h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    how = resolve_impl(impl, h2, weight)
    if how == "cce":
        # the padding sliced off (a view: no copy); cce tiles the vocabulary itself, so the width does
        # not matter to it. No gradient filtering (filter_eps=None): the exact gradients
        total = cce_linear_cross_entropy(
            h2, weight[:vocab], t2, ignore_index=IGNORE_INDEX, reduction="sum", filter_eps=None
        ).float()
        return total / scored_count(t2)
    # inside a compiled graph already (a whole-model compile): the eager function, which it traces
    step = compiled_chunk_loss() if how == "compiled" and not torch.compiler.is_compiling() else chunk_loss
    return _LinearCrossEntropy.apply(
        h2,
        weight,
        t2,
        vocab,
        chunk or loss_chunk(h2.shape[0], weight.shape[0], h2.device),
        torch.is_grad_enabled(),
        step,
    )
