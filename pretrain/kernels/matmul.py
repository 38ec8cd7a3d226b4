"""Matmuls of bf16 values with an fp32 result, on tensor cores where the GPU has them.

A product of two bf16 numbers is exact in fp32 (8-bit mantissas), so a bf16 GEMM that
accumulates in fp32 and writes fp32 (cuBLAS through `torch.mm(..., out_dtype=torch.float32)`,
CUDA only) gives the numbers of the fp32 matmul of the upcast values, at the tensor cores'
speed instead of fp32's (about 15x apart on an H100/H200). Elsewhere (the CPU, fp32 inputs,
a torch without the overload) the upcast fp32 matmul runs: the same numbers, which is how
the CPU tests check the CUDA path's arithmetic.

`fp32_linear` is the gate's logits (pretrain/model/layers.py FP32Linear): forward one such
GEMM; backward splits the fp32 gradient into two bf16 parts (hi + lo, 16 mantissa bits
between them) so that its two products are within fp32's rounding of the fp32 matmul's too.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.kernels.probe import FusedPath, fused_path_works, register_fused_path

_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads() and "dtype" in torch.ops.aten.addmm.overloads()


def tensor_core_fp32(*tensors: torch.Tensor) -> bool:
    """Whether the tensor-core path runs on these operands: CUDA, all bf16, a torch with out_dtype
    whose `mm` form passed its trial on this device (kernels/probe.py)."""
    return _HAS_OUT_DTYPE and all(map(_bf16_on_cuda, tensors)) and fused_path_works("mm-fp32", tensors[0].device)


def _bf16_on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.bfloat16


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 (a [m, k], b [k, n]): bf16 products, fp32 accumulation and result."""
    if tensor_core_fp32(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b, acc fp32: on CUDA the sum is the GEMM's epilogue (one pass over acc, no bf16
    product, no separate cast-and-add) where this torch's addmm accepts an fp32 acc."""
    if tensor_core_fp32(a, b):
        if fused_path_works("addmm-fp32", acc.device):
            return torch.addmm(acc, a, b, out_dtype=torch.float32)
        return acc + torch.mm(a, b, out_dtype=torch.float32)
    return torch.addmm(acc, a.float(), b.float())


def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones(16, 16, device=device, dtype=torch.bfloat16)


def _trial_mm(device: torch.device) -> None:
    out = torch.mm(_ones(device), _ones(device), out_dtype=torch.float32)
    if out.dtype != torch.float32 or not bool((out == 16).all()):  # one host read, at start-up
        raise RuntimeError(f"mm with out_dtype=float32 gave {out.dtype} values other than 16")


def _trial_addmm(device: torch.device) -> None:
    """torch 2.8-2.10's addmm.dtype wants acc in the inputs' dtype; later ones take fp32 (the out
    dtype). 0.25 + 16 ones: an fp32 acc read as fp32 (a bf16 one would be an error or misread)."""
    out = torch.addmm(torch.full((16, 16), 0.25, device=device), _ones(device), _ones(device), out_dtype=torch.float32)
    if not bool((out == 16.25).all()):
        raise RuntimeError("addmm with an fp32 acc and out_dtype=float32 misread the acc")


def _applies(device: torch.device) -> bool:
    return _HAS_OUT_DTYPE and device.type == "cuda"


register_fused_path(
    "mm-fp32",
    FusedPath(
        "the bf16 GEMM with an fp32 result (torch.mm out_dtype)",
        "the gate's logits and the loss's head gradient run as fp32 GEMMs of upcast copies (same numbers; "
        "fp32 GEMMs are about 15x slower than bf16 tensor cores on an H100/H200)",
        _applies,
        _trial_mm,
    ),
)
register_fused_path(
    "addmm-fp32",
    FusedPath(
        "the fp32-accumulating addmm (torch.addmm out_dtype with an fp32 acc)",
        "the sum into an fp32 gradient takes one more pass over it (a GEMM with an fp32 result, then an add)",
        _applies,
        _trial_addmm,
    ),
)


def _split(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g (fp32) as hi + lo, both bf16: hi holds g's first 8 mantissa bits, lo the next 8."""
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


class _FP32Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = mm_fp32(x, weight.t())
        return y + bias.float() if bias is not None else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        hi, lo = _split(grad.float())
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = addmm_fp32(mm_fp32(hi, weight), lo, weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = addmm_fp32(mm_fp32(hi.t(), x), lo.t(), x).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.float().sum(0).to(weight.dtype)
        return dx, dw, db


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in fp32 from bf16 x, weight and bias (x [..., in]): the fp32 linear's
    numbers, its three matmuls as bf16 GEMMs with fp32 accumulation (the module docstring)."""
    y = _FP32Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
