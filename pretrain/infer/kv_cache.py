"""Incremental decoding with a KV cache, for the dense model and the looped GRT core.

Looping the core R times at decode would keep R caches per core block. Strategies
(the paper's section on KV caches at decode; spec section 5):

    full     one cache per loop step (C*R core slots): exactly the model's function
    first    one cache per core block, holding the keys/values of loop step 1
    last     ... of the last loop step run (the exit depth)
    average  ... the mean over the loop steps run

With `first`/`last`/`average` a new token's query at loop step r attends to the shared
cache for the past positions and to its own step-r key/value for itself; once its loop
is done, its keys/values are folded into the shared slot (step 1, step n, or the mean).
The prompt is prefilled exactly (every loop step attends to its own step's keys, as
`full`), then folded the same way: only generated tokens see approximate caches.
The exit depth (loop steps per token) is chosen at decode and is fixed for a sequence.

Cache bytes: 2 (K and V) * slots * batch * max_len * d_model * bytes per element, with
slots = P + C*R + K (full), P + C + K (shared strategies), or L (dense).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.config import ConfigError
from pretrain.model import GPT
from pretrain.model.layers import Block

STRATEGIES = ("full", "first", "last", "average")


def cache_slots(model: GPT, strategy: str, n_loops: int) -> int:
    layout = model.cfg.parsed_layout
    if model.loop is None:
        return layout.prelude + layout.coda
    core = layout.core * (n_loops if strategy == "full" else (1 if n_loops > 0 else 0))
    return layout.prelude + core + layout.coda


def cache_bytes_formula(model: GPT, strategy: str, n_loops: int, batch: int, max_len: int,
                        dtype: torch.dtype) -> int:
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * cache_slots(model, strategy, n_loops) * batch * max_len * model.cfg.d_model * elt


class KVCache:
    """Preallocated keys and values: [slots, B, H, max_len, head_dim] each."""

    def __init__(self, slots: int, batch: int, heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (slots, batch, heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _qkv(block: Block, x: torch.Tensor):
    b, t, d = x.shape
    h = block.attn.n_heads
    q, k, v = block.attn.c_attn(block.ln_1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
    return q, k, v


def _attend(q, keys, values, past: int):
    """q [B,H,t,D] at positions past..past+t-1; keys/values [B,H,past+t,D]."""
    t = q.shape[2]
    if t == 1:
        return F.scaled_dot_product_attention(q, keys, values)
    if past == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    allowed = torch.arange(past + t, device=q.device)[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)


def _finish(block: Block, x, y):
    b, _, t, _ = y.shape
    x = x + block.attn.c_proj(y.transpose(1, 2).reshape(b, t, -1))
    return x + block.mlp(block.ln_2(x))


class CachedDecoder:
    """Prefill a prompt, then decode one token at a time; returns next-token logits [B, V]."""

    def __init__(self, model: GPT, batch: int, max_len: int | None = None, strategy: str = "full",
                 n_loops: int | None = None):
        if strategy not in STRATEGIES:
            raise ConfigError(f"strategy={strategy!r}: accepted values are {', '.join(STRATEGIES)}")
        if model.cfg.variant not in ("grt", "dense"):
            raise ConfigError(f"the KV cache supports the grt and dense variants, not {model.cfg.variant!r}: "
                             "decode it without a cache (--no-cache)")
        self.model = model.eval()
        cfg = model.cfg
        self.strategy = strategy
        self.n = 0 if model.loop is None else (model.max_loops if n_loops is None else int(n_loops))
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        p = next(model.parameters())
        layout = cfg.parsed_layout
        self.n_pre, self.n_core, self.n_coda = layout.prelude, layout.core, layout.coda
        self.cache = KVCache(cache_slots(model, strategy, self.n), batch, cfg.n_heads, self.max_len, cfg.head_dim,
                             p.dtype, p.device)
        self.pos = 0

    # slot numbering: prelude 0..P-1, then core slots, then coda
    def _core_slot(self, step: int, c: int) -> int:
        per_step = step if self.strategy == "full" else 0
        return self.n_pre + per_step * self.n_core + c

    def _coda_slot(self, j: int) -> int:
        core = self.n_core * (self.n if self.strategy == "full" else (1 if self.n > 0 else 0))
        return self.n_pre + core + j

    def _cached_block(self, block: Block, x, slot: int):
        """A block whose keys/values are written to the cache slot, attending to it."""
        q, k, v = _qkv(block, x)
        t, p0 = x.shape[1], self.pos
        ck, cv = self.cache.k[slot], self.cache.v[slot]
        ck[:, :, p0:p0 + t] = k
        cv[:, :, p0:p0 + t] = v
        return _finish(block, x, _attend(q, ck[:, :, : p0 + t], cv[:, :, : p0 + t], p0))

    def _shared_block(self, block: Block, x, slot: int):
        """A core block under a shared strategy; returns (output, this step's k, v). The tokens
        fed now attend to the folded cache of earlier positions and to this step's own keys
        (so a prompt fed at once is exact within itself)."""
        q, k, v = _qkv(block, x)
        p0 = self.pos
        keys = torch.cat([self.cache.k[slot, :, :, :p0], k], dim=2)
        values = torch.cat([self.cache.v[slot, :, :, :p0], v], dim=2)
        return _finish(block, x, _attend(q, keys, values, p0)), k, v

    @torch.no_grad()
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B, t] at positions pos..pos+t-1; logits [B, V] for the last one."""
        model, t = self.model, idx.shape[1]
        if self.pos + t > self.max_len:
            raise ValueError(f"sequence of {self.pos + t} tokens exceeds the cache/context of {self.max_len}")
        pos = torch.arange(self.pos, self.pos + t, device=idx.device)
        x = model.wte(idx) + model.wpe(pos)
        for i, block in enumerate(model.prelude):
            x = self._cached_block(block, x, i)
        if model.loop is not None:
            x = self._loop(x)
        for j, block in enumerate(model.coda):
            x = self._cached_block(block, x, self._coda_slot(j))
        self.pos += t
        return model.lm_head(model.ln_f(x[:, -1]))[..., : model.cfg.vocab_size]

    def _loop(self, e: torch.Tensor) -> torch.Tensor:
        loop, s = self.model.loop, e
        terms = loop.anchor_terms(e) if self.n > 0 else None  # the anchor halves, once per token
        acc = None  # per core block: the folded keys/values for the shared strategies
        for r in range(self.n):
            x = loop.project(s, terms)
            for c, block in enumerate(loop.core):
                if self.strategy == "full":
                    x = self._cached_block(block, x, self._core_slot(r, c))
                    continue
                x, k, v = self._shared_block(block, x, self._core_slot(r, c))
                if acc is None:
                    acc = [None] * self.n_core
                if self.strategy == "first" and r == 0 or self.strategy == "last" and r == self.n - 1:
                    acc[c] = (k, v)
                elif self.strategy == "average":
                    acc[c] = (k, v) if acc[c] is None else (acc[c][0] + k, acc[c][1] + v)
            if loop.has_gate:
                g = torch.sigmoid(loop.gate_logits(s, terms))
                s = g * s + (1 - g) * x
            else:
                s = x
        if acc is not None:
            t = e.shape[1]
            scale = 1.0 / self.n if self.strategy == "average" else 1.0
            for c, (k, v) in enumerate(acc):
                slot = self._core_slot(0, c)
                self.cache.k[slot, :, :, self.pos:self.pos + t] = k * scale
                self.cache.v[slot, :, :, self.pos:self.pos + t] = v * scale
        model = self.model
        return model.exit_norm(s) if model.exit_norm is not None else s
