"""The Gated Recurrent Transformer and the dense GPT-2 it generalises, in one file.

    tokens -> embeddings -> prelude (P blocks, once) = e, the anchor
           -> loop step r = 1..n (shared weights, `LoopStep`):
                x_r = W_proj [s_{r-1} + eps_x ; e]
                o_r = Core(x_r)                 (core_kv='anchor': keys and values of e)
                g_r = sigmoid(f_g([LN(s_{r-1}); LN(e)]) / tau + eps_g)
                s_r = g_r * s_{r-1} + (1 - g_r) * o_r          (s_0 = e)
           -> exit norm -> coda (K blocks, once) -> final norm -> tied LM head

A dense model is a prelude with no loop. P or K may be 0 (layouts `CxR`, `0+CxR+K`,
`P+CxR+0`: the loop at the whole stack, the bottom, the top; pretrain/model_config.py): an
empty prelude returns its input, so without a prelude the anchor e is the embeddings;
without a coda the exit norm, final norm and head follow the loop's last state. The
number of loop steps is an argument of `forward` (0 = prelude straight to coda), so
training can sample it and evaluation can exit early. Activation checkpointing and
compilation are applied from outside (`pretrain.training.engine.parallelize`); `LoopStep` is
the recompute/compile unit.

Why one file past the ~400-line rule: it is the model read top to bottom, nanoGPT-style, from
the anchor projection to the loop step to `GPT` and its forward; each part is used by the next
and by nothing else, so a split would send its reader between files for one computation. What
is not this forward lives beside it (layers.py's blocks, the baselines, the HF export, the loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from grt_common.errors import ConfigError
from pretrain.kernels.gate import gate_update
from pretrain.model.layers import KV, AttentionContext, Block, Embedding, FP32Linear, Linear, LMHead, layer_norm
from pretrain.model.loss import lm_loss
from pretrain.model_config import ANCHOR_MODES, ModelConfig
from pretrain.variants import get_variant


class ModelOutput(NamedTuple):
    """A named tuple, so that ZeRO-3's module hooks see the tensors inside it."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    states: list[torch.Tensor] = []  # s_0..s_n, when asked for
    gates: list[torch.Tensor] = []  # g_1..g_n, when asked for


@dataclass
class LoopTrace:
    """What a forward's loop (`GPT.loop_forward`, the hook each variant overrides) hands the
    epilogue (`GPT.finish`) besides the final state."""

    states: list[torch.Tensor] | None = None  # s_0..s_n, when asked for
    gates: list[torch.Tensor] | None = None  # g_1..g_n, when asked for
    # terms of a training loss (auxiliary losses, zero-weighted touches), added in order; computed
    # after the head, as they were written, so that random draws (dropout) keep the forward's order
    loss_terms: list[Callable[[], torch.Tensor]] = field(default_factory=list)
    # (logits, loss) of a loop that decodes its own exit (Ouro): the epilogue decodes nothing more
    decoded: tuple[torch.Tensor | None, torch.Tensor | None] | None = None


class IdentityLinear(Linear):
    """A square linear that starts as the identity (ModelConfig.proj_init='residual': W_proj's state
    half), set in reset_parameters so that ZeRO-3's partitioned construction starts it alike."""

    def reset_parameters(self) -> None:
        nn.init.eye_(self.weight)


class AnchorTerms(NamedTuple):
    proj: torch.Tensor | None  # W_proj's anchor half applied to e
    gate: torch.Tensor | None  # the gate MLP's first layer, anchor half, applied to LN(e)
    kv: list[KV] | None = None  # core_kv='anchor': each core block's keys and values of e


class AnchorProjection(nn.Module):
    """The anchor halves of the projection and of the gate's first layer. With a fixed
    anchor they are the same at every loop step, so they are computed once per forward
    (W [s; e] = W_s s + W_e e): the loop step pays for its state half only."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        # proj_init='residual': the anchor half starts at zero (the step reads its state alone)
        anchor_std = 0.0 if cfg.proj_init == "residual" else cfg.init_std
        self.proj = Linear(d, d, bias=False, std=anchor_std) if cfg.reinject_anchor else None
        if cfg.gate:
            self.gate_norm = layer_norm(cfg)
            self.gate_fc = Linear(d, d, bias=False, std=cfg.init_std)
        self.has_gate = cfg.gate

    def forward(self, e: torch.Tensor) -> AnchorTerms:
        return AnchorTerms(
            self.proj(e) if self.proj is not None else None, self.gate_fc(self.gate_norm(e)) if self.has_gate else None
        )


class LoopStep(nn.Module):
    """One loop step (projection, shared core, gate): the unit of recompute and compile.

    Parameters: W_proj = [proj_state | anchor.proj] (2d x d, no bias), the gate MLP
    f_g = gate_out(SiLU([gate_fc_state | anchor.gate_fc] [LN(s); LN(e)])), output bias +4; gate_out
    computes in fp32 whatever the weights' dtype (`FP32Linear`), so the gate's logits, and 1 - g, which
    the update writes, are not rounded to bf16.
    """

    def __init__(self, cfg: ModelConfig, out_std: float, block_cls: type[Block] = Block) -> None:
        super().__init__()
        d, layout = cfg.d_model, cfg.parsed_layout
        self.state_noise_std, self.gate_noise_std, self.gate_tau = cfg.state_noise_std, cfg.gate_noise_std, cfg.gate_tau
        self.relative_noise = cfg.state_noise_scale == "relative"
        self.anchor = AnchorProjection(cfg)
        state_half = IdentityLinear if cfg.proj_init == "residual" else Linear
        self.proj_state = state_half(d, d, bias=False, std=cfg.init_std) if cfg.reinject_anchor else None
        # core_kv='anchor' (CART's context-anchored keys): every core block attends to keys and values of
        # the anchor e, computed once per forward (`anchor_terms`), with queries from the step's own input
        self.anchored_kv = cfg.core_kv == "anchor"
        self.core = nn.ModuleList(block_cls(cfg, out_std, self.anchored_kv) for _ in range(layout.core))
        if cfg.gate:
            self.gate_norm_state = layer_norm(cfg)
            self.gate_fc_state = Linear(d, d, bias=True, std=cfg.init_std)
            self.gate_out = FP32Linear(d, d, bias=True, std=cfg.init_std, bias_init=cfg.gate_bias_init)
        self.has_gate = cfg.gate

    def project(self, x: torch.Tensor, terms: AnchorTerms) -> torch.Tensor:
        """x_r = W_proj [x ; e] (x is the state, plus noise in training)."""
        return self.proj_state(x) + terms.proj if self.proj_state is not None else x

    def gate_logits(self, s: torch.Tensor, terms: AnchorTerms) -> torch.Tensor:
        """The gate's logits, in fp32 (gate_out's matmul and everything after it)."""
        h = F.silu(self.gate_fc_state(self.gate_norm_state(s)) + terms.gate)
        return self.gate_out(h) / self.gate_tau

    def noisy_gate_logits(self, s: torch.Tensor, terms: AnchorTerms) -> torch.Tensor:
        logits = self.gate_logits(s, terms)
        if self.training and self.gate_noise_std > 0:
            logits = logits + self.gate_noise_std * torch.randn_like(logits)
        return logits

    def gate(self, s: torch.Tensor, terms: AnchorTerms, override: float | None = None) -> torch.Tensor:
        if override is not None:
            return torch.full_like(s, float(override))
        return torch.sigmoid(self.noisy_gate_logits(s.to(self.weight_dtype()), terms).float())

    def weight_dtype(self) -> torch.dtype:
        """The dtype the step computes in (bf16 under DeepSpeed's bf16 mode); the state may be fp32."""
        return cast(Block, self.core[0]).ln_1.weight.dtype  # core holds block_cls instances

    def anchor_terms(self, e: torch.Tensor) -> AnchorTerms:
        """What every loop step takes from the anchor e, computed once per forward: the anchor halves
        of the projection and the gate, and under core_kv='anchor' each core block's keys and values."""
        e = e.to(self.weight_dtype())
        terms = self.anchor(e)
        if self.anchored_kv:
            terms = terms._replace(kv=[cast(Block, block).anchor_kv(e) for block in self.core])
        return terms

    def forward(
        self,
        s: torch.Tensor,
        e: torch.Tensor,
        ctx: AttentionContext,
        gate_override: float | None = None,
        terms: AnchorTerms | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step from state s with anchor e; `terms` = anchor_terms(e) when precomputed.
        The projection, core and gate MLP compute in the weights' dtype; the gated update
        keeps the state's dtype (fp32 under bf16 weights by default: ModelConfig.state_dtype)."""
        if terms is None:
            terms = self.anchor_terms(e)
        dtype = self.weight_dtype()
        x = s
        if self.training and self.state_noise_std > 0:
            noise = self.state_noise_std * torch.randn_like(x)
            if self.relative_noise:  # per token, against the state's RMS (no gradient through the scale)
                noise = noise * s.detach().float().pow(2).mean(-1, keepdim=True).sqrt().to(s.dtype)
            x = x + noise
        x = self.project(x.to(dtype), terms)
        for i, block in enumerate(self.core):
            x = block(x, ctx, terms.kv[i]) if terms.kv is not None else block(x, ctx)
        if not self.has_gate:
            return x, None
        if gate_override is None:  # sigmoid and update fused into one kernel on GPU (kernels/gate.py)
            return gate_update(self.noisy_gate_logits(s.to(dtype), terms), s, x)
        g = torch.full_like(s, float(gate_override))
        # g * s + (1 - g) * o, written out so that g = 1 returns s exactly and g = 0 returns o exactly
        return g * s + (1 - g) * x, g


MODEL_CLASSES: dict[str, type[GPT]] = {}  # variant name -> the class that builds it


M = TypeVar("M", bound="type[GPT]")


def builds(*variants: str) -> Callable[[M], M]:
    """Class decorator: the model class of these variants (the Variants of pretrain/variants/);
    pretrain.model.build_model builds it for them."""

    def register(cls: M) -> M:
        for variant in variants:
            MODEL_CLASSES[variant] = cls
        return cls

    return register


@builds("grt", "dense")
class GPT(nn.Module):
    """The GRT (variant grt) and the dense GPT-2 (variant dense). The comparison baselines
    subclass it (pretrain.model.baselines); build any variant with pretrain.model.build_model.

    The public pieces, which evaluation, the KV cache and the baselines compose instead of
    copying: `embed`, `run_prelude`, `loop_step` (one loop step), `run_loop` (n steps),
    `decode` (a state to logits: exit norm -> coda -> final norm -> head -> vocabulary
    slice), itself `head(final_hidden(s))`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        if MODEL_CLASSES.get(cfg.variant) is not type(self):
            raise ConfigError(
                f"{type(self).__name__} does not build variant {cfg.variant!r}: "
                "build models with pretrain.model.build_model(cfg)"
            )
        self.cfg = cfg
        layout = cfg.parsed_layout
        d, vocab = cfg.d_model, cfg.padded_vocab_size
        # GPT-2's scaled init of residual projections, by the depth the residual stream sees
        out_std = cfg.init_std / math.sqrt(2 * layout.effective_depth())
        self.wte = Embedding(vocab, d, std=cfg.init_std)
        self.wpe = Embedding(cfg.max_seq_len, d, std=cfg.init_std)
        self.drop = nn.Dropout(cfg.dropout)
        self.prelude = nn.ModuleList(Block(cfg, out_std) for _ in range(layout.prelude))
        self.loop: nn.Module | None = self.build_loop(cfg, out_std) if layout.looped else None
        self.exit_norm = layer_norm(cfg) if layout.looped and cfg.exit_norm else None
        self.coda = nn.ModuleList(Block(cfg, out_std) for _ in range(layout.coda))
        self.ln_f = layer_norm(cfg)
        self.lm_head = LMHead(d, vocab, cfg.vocab_size, std=cfg.init_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def build_loop(self, cfg: ModelConfig, out_std: float) -> nn.Module:
        """The loop-step module (the unit of recompute); baselines override it."""
        return LoopStep(cfg, out_std)

    @property
    def max_loops(self) -> int:
        return self.cfg.max_loops

    def depth(self, n_loops: int | None) -> int:
        """The loop steps to run: n_loops, or the layout's R when None."""
        n = self.max_loops if n_loops is None else int(n_loops)
        if n < 0:
            raise ValueError(f"n_loops={n}: must be >= 0")
        return n

    def dense_exit(self, n: int) -> int | None:
        """The blocks a dense model runs at exit depth n (forward's n_loops): 1..N, its first n
        blocks, then the final norm and head (the dense model cut at the GRT's depth, the paper's
        comparison); 0, what training and a model without a loop step pass, runs all N. None:
        every block (a looped model, or the full depth)."""
        blocks = len(self.prelude)  # a dense layout `N` is a prelude of N blocks
        if self.loop is not None or n in (0, blocks):
            return None
        if n > blocks:
            raise ValueError(f"n_loops={n}: a dense model of {blocks} layers exits after 1..{blocks} of them (0: all)")
        return n

    # -- the pieces of a forward pass -----------------------------------------------------
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token plus position embeddings of idx [B, t] at positions start..start+t-1."""
        end = start + idx.shape[1]
        if end > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len={self.cfg.max_seq_len}")
        pos = torch.arange(start, end, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def run_prelude(self, x: torch.Tensor, ctx: AttentionContext, blocks: int | None = None) -> torch.Tensor:
        """The prelude's output e, the anchor; x itself (the embeddings) when P = 0. `blocks`: only
        the first ones (a dense model's early exit, `dense_exit`)."""
        for block in self.prelude[:blocks]:
            x = block(x, ctx)
        return x

    def loop_step(
        self,
        s: torch.Tensor,
        e: torch.Tensor,
        ctx: AttentionContext,
        step: int,
        terms: AnchorTerms | None = None,
        gate_override: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loop step number `step` (0-based) from state s with anchor e: (s_next, gate or None).
        terms: loop.anchor_terms(e) when precomputed. The GRT's steps share all weights."""
        assert self.loop is not None, "a dense model has no loop step"
        return self.loop(s, e, ctx, gate_override, terms)

    def recurrence(
        self, e: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]:
        """(s_0, step(s, r) -> s_{r+1}): the loop as this model's forward runs it from the
        prelude output e, one step at a time, for callers that decide per step how far to go
        (adaptive exit, the KV cache). The GRT: from e, with e as the anchor."""
        terms = cast(LoopStep, self.loop).anchor_terms(e)  # a LoopStep: baselines with another loop override this
        return self.start_state(e), lambda s, r: self.loop_step(s, e, ctx, r, terms)[0]

    def start_state(self, e: torch.Tensor) -> torch.Tensor:
        """s_0 = e in the loop state's dtype (ModelConfig.state_dtype: fp32 by default). Without a
        gate the step's output replaces the state (s_r = o_r, in the weights' dtype): no fp32 state."""
        return e.float() if self.cfg.state_dtype == "fp32" and self.cfg.gate else e

    def run_loop(
        self,
        e: torch.Tensor,
        ctx: AttentionContext,
        n: int,
        *,
        emb: torch.Tensor | None = None,
        gate_override: float | None = None,
        anchor: str = "prelude",
        states: list[torch.Tensor] | None = None,
        gates: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """n loop steps from s_0 = e (the prelude output); returns s_n (e itself for a dense model).
        anchor: what the loop is fed as e (prelude output, zeros, the token embeddings `emb`, or
        the previous state). Appends s_0..s_n to `states` and g_1..g_n to `gates` when given."""
        if anchor not in ANCHOR_MODES:
            raise ValueError(f"anchor={anchor!r}: accepted values are {', '.join(ANCHOR_MODES)}")
        if anchor == "embeddings" and emb is None:
            raise ValueError("anchor='embeddings' needs the token embeddings (emb)")
        if self.loop is None:
            if states is not None:
                states.append(e)
            return e
        s = self.start_state(e)
        if states is not None:
            states.append(s)
        fixed = {"prelude": e, "zeros": torch.zeros_like(e), "embeddings": emb}.get(anchor)  # None: "previous"
        loop = cast(LoopStep, self.loop)  # the GRT's LoopStep (build_loop); the baselines run their own loops
        terms = loop.anchor_terms(fixed) if fixed is not None and n > 0 else None
        for r in range(n):
            with self.step_autograd(r, n):
                s, g = self.loop_step(s, s if fixed is None else fixed, ctx, r, terms, gate_override)
            if states is not None:
                states.append(s)
            if gates is not None and g is not None:
                gates.append(g)
        return s

    def step_autograd(self, r: int, n: int) -> torch.autograd.grad_mode.set_grad_enabled:
        """Truncated backprop: in training, loop step r of n runs without autograd unless it is one of the
        last k (extra.backprop_steps, the variant's `no_grad_steps`): activations kept grow with k, not n."""
        untracked = get_variant(self.cfg.variant).no_grad_steps(self.cfg, n) if self.training else 0
        return torch.set_grad_enabled(torch.is_grad_enabled() and r >= untracked)

    def final_hidden(self, s: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """A state through the exit norm, the coda and the final norm: [B, T, d]. An fp32 loop
        state is rounded to the weights' dtype here, once."""
        s = s.to(self.ln_f.weight.dtype)
        x = self.exit_norm(s) if self.exit_norm is not None else s
        for block in self.coda:
            x = block(x, ctx)
        return self.ln_f(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [..., d] -> logits over the real (unpadded) vocabulary."""
        return self.lm_head(h)[..., : self.cfg.vocab_size]

    def decode(self, s: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """A state to logits: exit norm -> coda -> final norm -> head -> vocabulary slice."""
        return self.head(self.final_hidden(s, ctx))

    def output(
        self, s: torch.Tensor, ctx: AttentionContext, targets: torch.Tensor | None, return_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, loss) of the final state s. Without return_logits, the loss comes straight
        from the hidden states (`LMHead` with targets: no logits tensor) and logits is None:
        training's path."""
        h = self.final_hidden(s, ctx)
        if targets is not None and not return_logits:
            return None, self.lm_head(h, targets)
        logits = self.head(h)
        return logits, lm_loss(logits, targets) if targets is not None else None

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        n_loops: int | None = None,
        doc_ids: torch.Tensor | None = None,
        gate_override: float | None = None,
        anchor: str = "prelude",
        return_states: bool = False,
        return_gates: bool = False,
        return_logits: bool = True,
        **options: Any,
    ) -> ModelOutput:
        """idx, targets: [B, T] token ids. n_loops: loop steps to run (default: the layout's R); for
        a dense model the exit depth, the layers run (1..N; None or 0: all N, `dense_exit`).
        gate_override: force every gate to this constant. anchor: what the loop is fed as e
        (prelude output, zeros, token embeddings, or the previous state). return_logits=False
        (with targets): the loss only, without materialising the logits (`output`). options: the
        variant's own (Ouro's exit).

        Every variant's forward: embeddings and prelude, the loop (`loop_forward`, the one part a
        variant overrides), then exit norm, coda, final norm, head and loss (`finish`)."""
        self.check_loop_options(gate_override, anchor)
        n = self.depth(n_loops)
        ctx = AttentionContext(doc_ids=doc_ids)
        emb = self.embed(idx)
        e = self.run_prelude(emb, ctx, self.dense_exit(n))  # a dense model's early exit: its first blocks
        trace = LoopTrace([] if return_states else None, [] if return_gates else None)
        s = self.loop_forward(
            e, ctx, n, trace, emb=emb, targets=targets, gate_override=gate_override, anchor=anchor, **options
        )
        return self.finish(s, ctx, targets, return_logits, trace)

    def check_loop_options(self, gate_override: float | None, anchor: str) -> None:
        """Refuse, before any compute, forward options the loop cannot honour; the GRT's loop
        takes them all (`run_loop` checks the anchor)."""

    def loop_forward(
        self,
        e: torch.Tensor,
        ctx: AttentionContext,
        n: int,
        trace: LoopTrace,
        *,
        emb: torch.Tensor,
        targets: torch.Tensor | None,
        gate_override: float | None,
        anchor: str,
    ) -> torch.Tensor:
        """The loop part of forward, from the prelude output e: n steps, the final state returned,
        states, gates and loss terms left in `trace`. The GRT's is `run_loop`; a dense model's
        returns e."""
        s = self.run_loop(
            e, ctx, n, emb=emb, gate_override=gate_override, anchor=anchor, states=trace.states, gates=trace.gates
        )
        if self.training and n == 0 and self.loop is not None:
            s = s + 0.0 * self._touch_loop(e)
        return s

    @classmethod
    def runs_grt_loop(cls) -> bool:
        """Whether forward's loop is the GRT's `run_loop` (LoopStep steps from s_0 = e, with gate
        forcing and anchor replacement): what CachedDecoder replays piece by piece and `grt analyze`
        forces. A class whose loop is its own `loop_forward` (the baselines) has neither."""
        return cls.loop_forward is GPT.loop_forward

    def finish(
        self,
        s: torch.Tensor,
        ctx: AttentionContext,
        targets: torch.Tensor | None,
        return_logits: bool,
        trace: LoopTrace,
    ) -> ModelOutput:
        """The epilogue: the final state's logits and loss (`output`, unless the loop decoded its
        own), a training loss plus the loop's terms."""
        logits, loss = trace.decoded if trace.decoded is not None else self.output(s, ctx, targets, return_logits)
        if loss is not None and self.training:
            for term in trace.loss_terms:
                loss = loss + term()
        return ModelOutput(logits=logits, loss=loss, states=trace.states or [], gates=trace.gates or [])

    def _touch_loop(self, x: torch.Tensor) -> torch.Tensor:
        """A zero-weighted loop step on one token, so that a depth-0 training step still
        gives every loop parameter a (zero) gradient: ZeRO-3 otherwise re-applies the stale
        gradient of the previous step to parameters that took no part in this one.

        The touches stay in the models (this one, and the baselines' per-step modules): ZeRO-3
        gathers a parameter only inside a call of its module with a real input, and which
        parameters a forward left out of the loss is the model's knowledge (Ouro's exit gate
        runs at depth 1 yet does not reach the loss), which a generic hook could only learn
        by walking the autograd graph every micro-batch."""
        head = x[:, :1]  # from a state of the loop's own dtype, as every other step (one compiled graph)
        return self.loop_step(self.start_state(head), head, AttentionContext(), 0)[0].float().sum()
