"""Transformer building blocks shared by every model: linears that initialise
themselves (so the model can be built under `deepspeed.zero.Init`, which partitions
each module as soon as its constructor returns), attention with interchangeable
backends, MLP and the pre-norm block."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.kernels.matmul import fp32_linear
from pretrain.kernels.probe import FusedPath, fused_path_works, register_fused_path
from pretrain.model.loss import linear_cross_entropy
from pretrain.model_config import ModelConfig

log = logging.getLogger(__name__)

try:  # optional fast path: the flash-attn package (CUDA, fp16/bf16 only)
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_func = flash_attn_varlen_func = None


class Linear(nn.Linear):
    """nn.Linear with N(0, std) weights and constant biases, set in reset_parameters."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02, bias_init: float = 0.0
    ) -> None:
        self.std, self.bias_init = std, bias_init
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.constant_(self.bias, self.bias_init)


class FP32Linear(Linear):
    """A linear with fp32 results whatever the weights' dtype (bf16 under DeepSpeed's bf16 mode) and
    autocast; the gradients flow back to the weights in their own dtype, and ZeRO-3 gathers them as
    for any module. For the gate's logits (pretrain/model/gpt.py LoopStep): near the gate's +4 start a
    bf16 logit's step is 0.031, 1.5% of 1 - g. bf16 input, weights and bias (DeepSpeed's bf16 mode):
    bf16 GEMMs with fp32 accumulation (`fp32_linear`, tensor cores on CUDA), the fp32 matmul's
    numbers; any other mix (fp32 weights, under autocast too): the operands upcast, an fp32 matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            if all(t.dtype == torch.bfloat16 for t in (x, self.weight, self.bias) if t is not None):
                return fp32_linear(x, self.weight, self.bias)
            bias = self.bias.float() if self.bias is not None else None
            return F.linear(x.float(), self.weight.float(), bias)


class LMHead(Linear):
    """The output projection to the padded vocabulary (ModelConfig.padded_vocab_size: an aligned
    width for the matmuls). Given targets, its forward returns the training loss straight from the
    hidden states (`linear_cross_entropy`: no logits tensor, the padded logits masked out); as a
    module call either way, so that ZeRO-3's hooks gather its (tied) weight. Without targets, the
    padded logits: `GPT.head` slices them to the real vocabulary, which is all a user sees."""

    def __init__(self, d_model: int, padded_vocab: int, vocab: int, std: float = 0.02) -> None:
        super().__init__(d_model, padded_vocab, bias=False, std=std)
        self.vocab = vocab

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        return linear_cross_entropy(h, self.weight, targets, self.vocab)


class Embedding(nn.Embedding):
    def __init__(self, num: int, dim: int, std: float = 0.02) -> None:
        self.std = std
        super().__init__(num, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


def layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)


@dataclass
class AttentionContext:
    """Per-forward attention state, built once and shared by every block (and loop step).

    doc_ids [B, T] (optional) restricts attention to the token's own document in a
    packed sequence; the masks for each backend are derived from it lazily, once.
    kv (optional, at decode): an object whose `attend(q, k, v)` stores the keys/values in a
    cache and attends to it (pretrain.infer.kv_cache.CachedDecoder); every layer goes through it.
    """

    doc_ids: torch.Tensor | None = None
    kv: Any = None
    _cache: dict[str, Any] = field(default_factory=dict)

    def _docs(self) -> torch.Tensor:
        if self.doc_ids is None:
            raise ValueError("the attention masks of a packed sequence need doc_ids")
        return self.doc_ids

    def sdpa_mask(self) -> torch.Tensor:
        if "sdpa" not in self._cache:
            d = self._docs()
            t = d.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=d.device).tril()
            same_doc = d[:, :, None] == d[:, None, :]
            self._cache["sdpa"] = (same_doc & causal)[:, None]  # [B, 1, T, T]
        return self._cache["sdpa"]

    def varlen(self) -> tuple[torch.Tensor, int]:
        """cu_seqlens over the flattened batch: one segment per (row, document), and a bound on the
        longest segment: the row length (a segment never crosses a row), which flash-attn accepts
        as max_seqlen, instead of the exact maximum that a host read of the device would give.
        `nonzero` still waits for the device once (the count of segments sizes cu_seqlens)."""
        if "varlen" not in self._cache:
            d = self._docs()
            b, t = d.shape
            starts = torch.ones_like(d, dtype=torch.bool)
            starts[:, 1:] = d[:, 1:] != d[:, :-1]
            idx = torch.nonzero(starts.flatten(), as_tuple=False).flatten()
            cu = torch.cat([idx, idx.new_tensor([b * t])]).to(torch.int32)
            self._cache["varlen"] = (cu, t)
        return self._cache["varlen"]


_logged_backends: set[str] = set()


def _log_backend_once(name: str, why: str) -> None:
    # not while torch.compile traces: a logging call breaks the graph, and torch 2.13's
    # replay of the view outputs on either side of that break reads garbage sizes
    if name not in _logged_backends and not torch.compiler.is_compiling():
        _logged_backends.add(name)
        log.info("attention backend: %s (%s)", name, why)


def _flash_applies(device: torch.device) -> bool:
    return flash_attn_func is not None and device.type == "cuda"


def _flash_trial(device: torch.device) -> None:
    """Forward and backward of flash-attn's kernel at the model's dtype (a wheel built for another
    torch, CUDA or GPU fails here, not in the first step)."""
    q, k, v = (torch.randn(1, 128, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flash_attn_func(q, k, v, causal=True).float().sum().backward()


register_fused_path(
    "flash-attn",
    FusedPath(
        "flash-attn's attention",
        "attention runs on torch's scaled_dot_product_attention: its own flash kernel without document "
        "masks; with train.doc_mask=true a [B, 1, T, T] mask and SDPA's memory-efficient kernel instead",
        _flash_applies,
        _flash_trial,
    ),
)


def resolve_backend(requested: str, q: torch.Tensor) -> str:
    half = q.dtype in (torch.float16, torch.bfloat16)
    flash_ok = _flash_applies(q.device) and half and fused_path_works("flash-attn", q.device)
    if requested == "auto":
        name = "flash_attn" if flash_ok else "sdpa"
        _log_backend_once(
            name, "flash-attn package on a CUDA fp16/bf16 tensor" if flash_ok else "torch scaled_dot_product_attention"
        )
        return name
    if requested == "flash_attn" and not flash_ok:
        raise RuntimeError(
            "attention='flash_attn' needs the flash-attn package (passing its trial) and CUDA fp16/bf16 tensors; "
            "use attention='auto' to fall back to scaled_dot_product_attention"
        )
    _log_backend_once(requested, "requested in the model config")
    return requested


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext, backend: str, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention. q, k, v: [B, H, T, D] -> [B, H, T, D]."""
    if ctx.kv is not None:
        return ctx.kv.attend(q, k, v)
    backend = resolve_backend(backend, q)
    masked = ctx.doc_ids is not None
    if backend == "flash_attn":
        b, h, t, dh = q.shape
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D]
        if masked:
            cu, max_len = ctx.varlen()
            flat = [x.reshape(b * t, h, dh) for x in (qt, kt, vt)]
            out = flash_attn_varlen_func(*flat, cu, cu, max_len, max_len, dropout_p=dropout_p, causal=True)
            return out.view(b, t, h, dh).transpose(1, 2)
        return flash_attn_func(qt, kt, vt, dropout_p=dropout_p, causal=True).transpose(1, 2)
    if backend == "sdpa":
        if masked:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.sdpa_mask(), dropout_p=dropout_p)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    # naive: the reference the fast paths are tested against
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    allowed = ctx.sdpa_mask() if masked else torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1), p=dropout_p)
    return probs @ v


KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [B, H, T, D] each


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. `anchored` (a GRT core block under core_kv='anchor'):
    the query and the key/value projections are two linears (c_q, c_kv) instead of one (c_attn),
    so that the keys and values can be computed from another state than the queries, once
    (`keys_values`), and handed to every call (forward's kv)."""

    def __init__(self, cfg: ModelConfig, out_std: float, anchored: bool = False) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.backend, self.dropout = cfg.n_heads, cfg.attention, cfg.dropout
        if anchored:
            self.c_q = Linear(d, d, bias=cfg.bias, std=cfg.init_std)
            self.c_kv = Linear(d, 2 * d, bias=cfg.bias, std=cfg.init_std)
        else:
            self.c_attn = Linear(d, 3 * d, bias=cfg.bias, std=cfg.init_std)
        self.c_proj = Linear(d, d, bias=cfg.bias, std=out_std)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[B, T, n*d] -> [n, B, H, T, D]."""
        b, t, width = x.shape
        return x.view(b, t, n, self.n_heads, width // (n * self.n_heads)).permute(2, 0, 3, 1, 4)

    def keys_values(self, x: torch.Tensor) -> KV:
        """The keys and values of x [B, T, d] (an anchored block's c_kv)."""
        k, v = self.heads(self.c_kv(x), 2)
        return k, v

    def forward(self, x: torch.Tensor, ctx: AttentionContext, kv: KV | None = None) -> torch.Tensor:
        """x [B, T, d]; kv: the keys and values to attend to (an anchored block's, from
        `keys_values`), else those of x."""
        b, t, d = x.shape
        if kv is not None:
            q, (k, v) = self.heads(self.c_q(x), 1)[0], kv
        else:
            q, k, v = self.heads(self.c_attn(x), 3)
        y = attention(q, k, v, ctx, self.backend, self.dropout if self.training else 0.0)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.c_fc = Linear(cfg.d_model, hidden, bias=cfg.bias, std=cfg.init_std)
        self.c_proj = Linear(hidden, cfg.d_model, bias=cfg.bias, std=out_std)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh GELU: GPT-2's "gelu_new", so the dense model is Hugging Face's function
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). `anchored`: its
    attention takes the keys and values it attends to as an argument (`anchor_kv`, forward's kv)."""

    def __init__(self, cfg: ModelConfig, out_std: float, anchored: bool = False) -> None:
        super().__init__()
        self.ln_1 = layer_norm(cfg)
        self.attn = CausalSelfAttention(cfg, out_std, anchored)
        self.ln_2 = layer_norm(cfg)
        self.mlp = MLP(cfg, out_std)

    def anchor_kv(self, e: torch.Tensor) -> KV:
        """The keys and values this anchored block attends to, from the state e: its own ln_1 and
        key/value projection applied to e, as if e were its input."""
        return self.attn.keys_values(self.ln_1(e))

    def forward(self, x: torch.Tensor, ctx: AttentionContext, kv: KV | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx, kv)
        return x + self.mlp(self.ln_2(x))
