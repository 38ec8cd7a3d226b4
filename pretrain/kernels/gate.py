"""The GRT state update as one fused operation.

    g = sigmoid(logits);  s_new = g * s + (1 - g) * o

Eagerly this is five elementwise kernels and three saved tensors per loop step; the fused
version reads logits, s and o once and writes s_new and g, and its backward recomputes g
from the logits. On CUDA it is a Triton kernel; elsewhere (and when Triton is missing) the
eager reference runs. `TRITON_INTERPRET=1` runs the Triton kernel on the CPU, which is how
CI checks it against the reference without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pretrain.kernels.probe import FusedPath, fused_path_works, register_fused_path

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _out_dtype(s: torch.Tensor, o: torch.Tensor) -> torch.dtype:
    """s_new's dtype: the state's and the core output's, not the logits' (fp32 in the model, which
    would otherwise make a bf16 state, ModelConfig.state_dtype='weights', fp32)."""
    return torch.promote_types(s.dtype, o.dtype)


def gate_update_reference(logits: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager formula, computed in fp32 as the kernel computes it: a bf16 sigmoid near the
    gate's 0.98 would round 1 - g (the share the step writes) to steps of 0.004, about 20% of it.
    Outputs: s_new in the promoted dtype of s and o, g in the logits' dtype."""
    g = torch.sigmoid(logits.float())
    return (g * s + (1 - g) * o).to(_out_dtype(s, o)), g.to(logits.dtype)


if triton is not None:
    # The kernels' parameters stay unannotated: Triton reads a kernel's annotations as its
    # argument types (`n: int` would pin n to i32, `BLOCK: tl.constexpr` is one of them).

    @triton.jit
    def _gate_fwd(logits_ptr, s_ptr, o_ptr, out_ptr, g_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        z = tl.load(logits_ptr + offs, mask=mask).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask).to(tl.float32)
        o = tl.load(o_ptr + offs, mask=mask).to(tl.float32)
        g = 1.0 / (1.0 + tl.exp(-z))
        tl.store(out_ptr + offs, (g * s + (1.0 - g) * o).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gate_bwd(grad_ptr, logits_ptr, s_ptr, o_ptr, dlogits_ptr, ds_ptr, do_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
        z = tl.load(logits_ptr + offs, mask=mask).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask).to(tl.float32)
        o = tl.load(o_ptr + offs, mask=mask).to(tl.float32)
        g = 1.0 / (1.0 + tl.exp(-z))
        tl.store(ds_ptr + offs, (dy * g).to(ds_ptr.dtype.element_ty), mask=mask)
        tl.store(do_ptr + offs, (dy * (1.0 - g)).to(do_ptr.dtype.element_ty), mask=mask)
        tl.store(dlogits_ptr + offs, (dy * (s - o) * g * (1.0 - g)).to(dlogits_ptr.dtype.element_ty), mask=mask)


BLOCK = 1024


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


class FusedGateUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of mixed dtypes are read as they are (the kernel computes in fp32): with bf16
        weights (DeepSpeed's bf16 mode, or autocast) the core output is bf16, the logits and the
        state fp32. The outputs take eager's dtypes: s_new that of s and o, g the logits'."""
        logits, s, o = logits.contiguous(), s.contiguous(), o.contiguous()
        out = torch.empty_like(s, dtype=_out_dtype(s, o))
        g = torch.empty_like(logits)
        n = s.numel()
        _gate_fwd[_grid(n)](logits, s, o, out, g, n, BLOCK=BLOCK)
        ctx.save_for_backward(logits, s, o)
        return out, g

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, _grad_g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, s, o = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dlogits, ds, do = torch.empty_like(logits), torch.empty_like(s), torch.empty_like(o)
        n = s.numel()
        _gate_bwd[_grid(n)](grad_out, logits, s, o, dlogits, ds, do, n, BLOCK=BLOCK)
        return dlogits, ds, do


def _applies(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or INTERPRET)


def _trial(device: torch.device) -> None:
    """Forward and backward on the model's dtypes (fp32 logits and state, bf16 core output): the
    kernel's compile, Triton's launcher build (a C compiler, Python's headers) and both launches."""
    logits, s = (torch.randn(4, 8, device=device, requires_grad=True) for _ in range(2))
    o = torch.randn(4, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
    out, _ = _apply(logits, s, o)
    out.float().sum().backward()


_apply = FusedGateUpdate.apply  # the trial's own reference: a count of the model's calls does not see it


register_fused_path(
    "gate",
    FusedPath(
        "the fused gate kernel (Triton)",
        "each loop step's gate update runs as the eager formula: about five element-wise kernels and three "
        "saved tensors instead of one kernel (a few % of a grt-small step)",
        _applies,
        _trial,
    ),
)


def fused_available(t: torch.Tensor) -> bool:
    return _applies(t.device) and fused_path_works("gate", t.device)


def fused_path(s: torch.Tensor) -> bool:
    """Whether `gate_update` runs the Triton kernel here. Not inside a torch.compile trace:
    there the eager formula is traced and the compiler fuses it with its neighbours (the
    kernel, an opaque autograd.Function, would break the graph); eagerly on CUDA, the kernel."""
    return fused_available(s) and not torch.compiler.is_compiling()


def gate_update(logits: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_new, g): the fused kernel where it can run (`fused_path`), the eager formula elsewhere.
    The returned g carries no gradient of its own in the fused path (it is for analysis).
    The dtypes may differ (bf16 weights with an fp32 state); the shapes may not (no broadcasting)."""
    if fused_path(s) and logits.shape == s.shape == o.shape:
        return FusedGateUpdate.apply(logits, s, o)
    return gate_update_reference(logits, s, o)
