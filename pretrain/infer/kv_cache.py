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

A model whose core attends to keys and values of the anchor (core_kv='anchor', CART) has one
set of them per core block whatever the step: its cache is the shared slots, exact, whichever
strategy is asked for (`cache_strategy` names it `anchor`); training and decode agree.

The decoder runs the model's own forward pieces (embed, prelude, `run_loop`, coda, head):
it hands the model an AttentionContext whose `kv` is the decoder, so every attention layer
stores its keys/values in its cache slot and attends to the slot (slots are assigned in
call order: prelude, core blocks step by step, coda). Every strategy attends to a slice of
its preallocated slot: no cache is copied per token (a shared slot's own-step position is
written in place, then overwritten by the fold).

Cache bytes: 2 (K and V) * slots * batch * max_len * d_model * bytes per element, with
slots = P + C*R + K (full), P + C + K (shared strategies, anchor), or L (dense). P or K may be 0 (the
loop at the bottom or the top of the stack, pretrain/model_config.py): the slots are numbered the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from grt_common.errors import ConfigError
from pretrain.infer.adaptive import adaptive_loop, check_criterion
from pretrain.model import GPT
from pretrain.model.layers import AttentionContext

STRATEGIES = ("full", "first", "last", "average")

KV = tuple[torch.Tensor, torch.Tensor]  # the keys and values of one layer

# cuDNN attention, which PyTorch prefers on Hopper/Blackwell with CUDA 13, builds and caches an
# execution plan per shape and stride: a decode step has a new key length every token, so it
# built a plan for every token and layer shape (the H200 figures of issue 12: ~10x slower
# tokens for whichever model or strategy met a shape first). Flash/memory-efficient kernels
# take any length without a plan.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


ANCHORED = "anchor"  # the cache of a core_kv='anchor' model, whatever strategy was asked for


def cache_strategy(model: GPT, strategy: str) -> str:
    """The cache a decode of `model` keeps for a requested strategy: the anchor's keys and values
    (one shared slot per core block, exact) when the core attends to them, else the strategy."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}: accepted values are {', '.join(STRATEGIES)}")
    return ANCHORED if model.cfg.core_kv == "anchor" else strategy


def cache_slots(model: GPT, strategy: str, n_loops: int) -> int:
    layout = model.cfg.parsed_layout
    if model.loop is None:
        return layout.prelude + layout.coda
    full = cache_strategy(model, strategy) == "full"
    core = layout.core * (n_loops if full else (1 if n_loops > 0 else 0))
    return layout.prelude + core + layout.coda


def cache_bytes_formula(model: GPT, strategy: str, n_loops: int, batch: int, max_len: int, dtype: torch.dtype) -> int:
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * cache_slots(model, strategy, n_loops) * batch * max_len * model.cfg.d_model * elt


class KVCache:
    """Preallocated keys and values: [slots, B, H, max_len, head_dim] each."""

    def __init__(
        self, slots: int, batch: int, heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (slots, batch, heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int) -> torch.Tensor:
    """q [B,H,t,D] at positions past..past+t-1; keys/values [B,H,past+t,D]."""
    t = q.shape[2]
    if t == 1:
        return F.scaled_dot_product_attention(q, keys, values)
    if past == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    allowed = torch.arange(past + t, device=q.device)[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)


def compile_for_decode(model: GPT) -> GPT:
    """torch.compile, in place, the modules a decode runs (each prelude and coda block, the loop
    step, the final norm and head), with dynamic shapes: one graph for the prompt and one for a
    token. The cache's reads and writes (`CachedDecoder.attend`) stay eager, a graph break in
    each attention: they index the cache by Python counters that change every call."""
    for module in [*model.prelude, model.loop, *model.coda, model.exit_norm, model.ln_f, model.lm_head]:
        if module is not None:
            module.compile(dynamic=True)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether compile_for_decode (or any Module.compile) compiled a module of the model."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


class CachedDecoder:
    """Prefill a prompt, then decode one token at a time; returns next-token logits [B, V]."""

    def __init__(
        self,
        model: GPT,
        batch: int,
        max_len: int | None = None,
        strategy: str = "full",
        n_loops: int | None = None,
        exit_threshold: float | None = None,
        exit_rule: str = "update",
    ) -> None:
        if not model.runs_grt_loop():  # the decoder replays the GRT's forward piece by piece
            raise ConfigError(
                f"the KV cache decodes models whose loop is the GRT's; variant {model.cfg.variant!r} runs its "
                "own: decode it without a cache (--no-cache)"
            )
        self.model = model.eval()
        cfg = model.cfg
        self.strategy = cache_strategy(model, strategy)
        self.n = 0 if model.loop is None else model.depth(n_loops)
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        p = next(model.parameters())
        layout = cfg.parsed_layout
        self.n_pre, self.n_core, self.n_coda = layout.prelude, layout.core, layout.coda
        self.cache = KVCache(
            cache_slots(model, strategy, self.n), batch, cfg.n_heads, self.max_len, cfg.head_dim, p.dtype, p.device
        )
        if exit_threshold is not None:
            check_criterion(model, exit_rule)
        self.exit_threshold, self.exit_rule = exit_threshold, exit_rule
        self.pos = 0
        self._calls = 0  # attention calls so far in the current forward
        self._fold: list[KV | None] = []  # per core block: the keys/values to fold (first: step 1's; average: the sum)
        self._active: torch.Tensor | None = None  # adaptive exit: [B, t] tokens still looping in the current step
        self._steps: torch.Tensor | None = None  # adaptive exit: [B, t] loop steps each token of this forward ran
        # adaptive exit: per core block, each token's keys/values of its latest step
        self._exit_kv: list[KV | None] = []
        self.decoded_tokens = 0  # adaptive exit: tokens decoded, and the loop steps they used
        self.decoded_steps = 0
        if is_compiled(model):  # the compiled blocks call attend: a graph break there, not a trace of it
            self.attend = torch.compiler.disable(self.attend)  # type: ignore[method-assign]

    @torch.no_grad()
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B, t] at positions pos..pos+t-1; logits [B, V] for the last one."""
        model, t = self.model, idx.shape[1]
        if self.pos + t > self.max_len:
            raise ValueError(f"sequence of {self.pos + t} tokens exceeds the cache/context of {self.max_len}")
        self._calls, self._fold = 0, [None] * self.n_core
        ctx = AttentionContext(kv=self)
        threshold = self.exit_threshold if self.pos > 0 else None  # the prompt is prefilled at full depth
        with sdpa_kernel(DECODE_BACKENDS):
            e = model.run_prelude(model.embed(idx, start=self.pos), ctx)
            s = self._adaptive_loop(e, ctx, threshold) if threshold is not None else model.run_loop(e, ctx, self.n)
            h = model.final_hidden(s, ctx)
        expected = self.n_pre + self.n * self.n_core + self.n_coda
        if self._calls != expected:  # the slot numbering assumes the model's layer order
            raise RuntimeError(f"the KV cache saw {self._calls} attention calls, expected {expected}")
        self._fold_shared(t)
        self._steps = None
        self.pos += t
        return model.head(h[:, -1])

    def _adaptive_loop(self, e: torch.Tensor, ctx: AttentionContext, threshold: float) -> torch.Tensor:
        """Per-token adaptive exit (pretrain/infer/adaptive.py, rule `exit_rule`): a token stops
        once its change is below `threshold` (exit_threshold); its state is frozen. Cache rule:
        the slots of the steps a token did not run hold the keys/values of its exit step (`full`:
        those steps' slots; `last`: the shared slot), `average` is the mean over the steps it ran,
        `first` is unchanged. So a token's cache entries never depend on which other tokens
        share its batch. `kl` decodes every step's state through the coda (`_probe`)."""
        s, step = self.model.recurrence(e, ctx)
        active = torch.ones(e.shape[:2], dtype=torch.bool, device=e.device)
        steps = torch.zeros(e.shape[:2], dtype=torch.long, device=e.device)
        self._active, self._steps = active, steps
        self._exit_kv = [None] * self.n_core
        s, ran = adaptive_loop(
            s,
            step,
            self.n,
            threshold,
            self.exit_rule,
            lambda state: self._probe(state, ctx),
            active,
            steps,
        )
        self._active = None
        if self.strategy == "full":  # the steps no token of the batch ran
            p0, t = self.pos, e.shape[1]
            for r in range(ran, self.n):
                for block, kv in enumerate(self._exit_kv):
                    k, v = _stored(kv, block)
                    slot = self.n_pre + r * self.n_core + block
                    self.cache.k[slot, :, :, p0 : p0 + t] = k
                    self.cache.v[slot, :, :, p0 : p0 + t] = v
        self._calls = self.n_pre + self.n * self.n_core  # the coda's slots follow every step's
        self.decoded_tokens += steps.numel()
        self.decoded_steps += int(steps.sum())
        return s

    def _probe(self, s: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Logits of a loop state of the tokens being fed, for the `kl` rule: the coda attends to
        the past positions' coda keys/values and to the state's own, written at the new
        positions of the coda's slots, which the final coda pass overwrites."""
        calls, self._calls = self._calls, self.n_pre + self.n * self.n_core
        logits = self.model.decode(s, ctx)
        self._calls = calls
        return logits

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of one layer (called by the model, in layer order): store k, v [B, H, t, D]
        at positions pos..pos+t-1 of the layer's slot and attend to the slot up to them."""
        slot, core_block, step = self._slot(self._calls)
        self._calls += 1
        p0, t = self.pos, k.shape[2]
        own_k, own_v = k, v
        if core_block is not None and self._active is not None:  # exited tokens keep their exit step's k, v
            active = self._active[:, None, :, None]
            kept = self._exit_kv[core_block]
            if kept is not None:
                k, v = torch.where(active, k, kept[0]), torch.where(active, v, kept[1])
            self._exit_kv[core_block] = (k, v)
            own_k, own_v = own_k * active, own_v * active  # what `average` sums: the steps actually run
        ck, cv = self.cache.k[slot], self.cache.v[slot]
        ck[:, :, p0 : p0 + t] = k
        cv[:, :, p0 : p0 + t] = v
        if core_block is not None and self.strategy in ("first", "average"):
            folded = self._fold[core_block]
            if self.strategy == "first":
                if step == 0:
                    self._fold[core_block] = (own_k, own_v)
            elif folded is None:  # average: the first step of this forward
                self._fold[core_block] = (own_k, own_v)
            else:
                self._fold[core_block] = (folded[0] + own_k, folded[1] + own_v)
        return _attend(q, ck[:, :, : p0 + t], cv[:, :, : p0 + t], p0)

    def _slot(self, call: int) -> tuple[int, int | None, int | None]:
        """(cache slot, core block or None, loop step or None) of the call-th attention call.
        Slots: prelude 0..P-1, then the core (C per step for `full`, C shared otherwise), then coda."""
        if call < self.n_pre:
            return call, None, None
        core_calls = self.n * self.n_core
        if call < self.n_pre + core_calls:
            step, block = divmod(call - self.n_pre, self.n_core)
            return self.n_pre + (step * self.n_core if self.strategy == "full" else 0) + block, block, step
        core_slots = core_calls if self.strategy == "full" else (self.n_core if self.n > 0 else 0)
        return self.n_pre + core_slots + call - self.n_pre - core_calls, None, None

    def _fold_shared(self, t: int) -> None:
        """The shared slots hold the last step's keys/values of the tokens just fed (`last` is
        done); `first` and `average` write step 1's or the mean over the steps instead."""
        if self.strategy not in ("first", "average") or self.n == 0:
            return
        scale: float | torch.Tensor = 1.0 / self.n if self.strategy == "average" else 1.0
        if self.strategy == "average" and self._steps is not None:  # adaptive exit: the mean over the steps run
            scale = 1.0 / self._steps[:, None, :, None].to(self.cache.k.dtype)
        for block, kv in enumerate(self._fold):
            k, v = _stored(kv, block)
            slot = self.n_pre + block
            self.cache.k[slot, :, :, self.pos : self.pos + t] = k * scale
            self.cache.v[slot, :, :, self.pos : self.pos + t] = v * scale


def _stored(kv: KV | None, block: int) -> KV:
    """The keys/values kept for core block `block`: every core block attends at every loop step
    run, so a step that ran left them there."""
    if kv is None:
        raise RuntimeError(f"the KV cache kept no keys/values of core block {block}")
    return kv
