"""The looped-model baselines the paper compares GRT against (spec section 4), on the same
P+CxR+K skeleton (embeddings, prelude, shared core, exit norm, coda, tied head) so that
only the loop mechanism differs:

- `huginn` (Geiping et al. 2025): a random truncated-normal initial state, an adapter
  Linear(2d -> d) on [s; e] every step, sandwich-norm core blocks, no gate; heavy-tail
  Poisson depth (train.depth_sampling=poisson); backprop only through the last k steps.
- `rrt` (Relaxed Recursive Transformer): plain recurrence s_r = Core(s_{r-1}) with a
  separate LoRA adapter per loop step on every linear of the shared core, starting at B = 0
  (the identity: step r computes exactly the shared weights at initialisation).
- `ouro`: plain recurrence, every step decoded; the training loss is the per-token
  expectation of the step losses under a learned exit distribution, minus beta x its
  entropy; at inference a token exits where the distribution's CDF passes a threshold.
- `mor` (Mixture-of-Recursions): per loop step a router picks the top-k tokens of each
  sequence among those still active (expert choice, capacity (R - r + 1) / R), gathers
  them, runs the shared core on them (causal among the chosen), scatters the result
  back; a binary cross-entropy auxiliary loss teaches the router the selection.

Every variant keeps ZeRO-3's rule (docs: notes on looped models): each parameter takes
part in every training micro-batch, so per-step modules beyond the sampled depth (LoRA
adapters, routers) and the loop at depth 0 get a zero-weighted touch.

`pretrain.model.build_model(cfg)` builds these classes for their variants, so the trainer, the
checkpoint loaders and the gradient checks build them without knowing them. Each keeps the
GPT's forward (embeddings and prelude, then exit norm, coda, final norm, head and loss) and
overrides its loop part, `loop_forward`, composed of the GPT's public pieces. Variant
settings live in `cfg.extra` (accepted keys and defaults: each one's Variant, pretrain/variants/).
Outputs beyond ModelOutput (per-step losses, exit distribution, router selections) are
left in `model.last_aux` after each forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from grt_common.errors import ConfigError
from pretrain.model.gpt import GPT, AnchorTerms, LoopStep, LoopTrace, builds, lm_loss
from pretrain.model.layers import KV, AttentionContext, Block, Linear, attention, layer_norm
from pretrain.model.loss import is_scored, scored_count
from pretrain.model_config import ModelConfig
from pretrain.variants import get_variant

# (s_0, step(s, r) -> s_{r+1}): what GPT.recurrence returns
Recurrence = tuple[torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]


def noise_off(cfg: ModelConfig) -> ModelConfig:
    """The same model with every random perturbation off (for gradient checks): its variant's rule."""
    return get_variant(cfg.variant).noise_off(cfg)


def _zero(*tensors: torch.Tensor) -> torch.Tensor:
    """0 x sum of the tensors: a term that gives their parameters a zero (not a missing) gradient."""
    total = sum(t.float().sum() for t in tensors)
    assert isinstance(total, torch.Tensor), "_zero needs at least one tensor"
    return 0.0 * total


class LoopedBaseline(GPT):
    """Shared pieces of the baselines: the option checks, a plain loop, the auxiliary outputs."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.last_aux: dict[str, Any] = {}

    def check_loop_options(self, gate_override: float | None, anchor: str) -> None:
        if gate_override is not None:
            raise ValueError(f"gate_override: variant {self.cfg.variant!r} has no gate")
        if anchor != "prelude":
            raise ValueError(f"anchor={anchor!r}: variant {self.cfg.variant!r} supports only the prelude anchor")

    def plain_loop(
        self, s: torch.Tensor, e: torch.Tensor, ctx: AttentionContext, n: int, trace: LoopTrace
    ) -> torch.Tensor:
        """n loop steps from state s with anchor e, in training all but the last k of them without
        autograd (truncated backprop, `step_autograd`); s_0..s_n into trace.states when asked for."""
        if trace.states is not None:
            trace.states.append(s)
        for i in range(n):
            with self.step_autograd(i, n):
                s, _ = self.loop_step(s, e, ctx, i)
            if trace.states is not None:
                trace.states.append(s)
        return s


# -- Huginn ---------------------------------------------------------------------------------
class SandwichBlock(Block):
    """Huginn's core block: a norm before and after each sub-layer,
    x = n_2(x + attn(n_1(x))); x = n_4(x + mlp(n_3(x)))."""

    def __init__(self, cfg: ModelConfig, out_std: float, anchored: bool = False) -> None:
        super().__init__(cfg, out_std, anchored)
        self.ln_attn_out = layer_norm(cfg)
        self.ln_mlp_out = layer_norm(cfg)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, kv: KV | None = None) -> torch.Tensor:
        x = self.ln_attn_out(x + self.attn(self.ln_1(x), ctx, kv))
        return self.ln_mlp_out(x + self.mlp(self.ln_2(x)))


@builds("huginn")
class HuginnGPT(LoopedBaseline):
    """s_0 ~ TruncNormal(0, std, +-3 std); s_r = Core_sandwich(W [s_{r-1}; e]); no gate.
    Training runs the first n - k steps under torch.no_grad (truncated backprop)."""

    def build_loop(self, cfg: ModelConfig, out_std: float) -> LoopStep:
        return LoopStep(cfg, out_std, block_cls=SandwichBlock)  # reinject_anchor=True, gate=False: the adapter

    def initial_state(self, e: torch.Tensor) -> torch.Tensor:
        std = float(self.cfg.xget("init_state_scale")) * math.sqrt(2.0 / (5 * self.cfg.d_model))
        if std == 0:
            return torch.zeros_like(e)
        # evaluation draws from a fixed generator, so that it is repeatable
        gen = None if self.training else torch.Generator(device=e.device).manual_seed(0)
        s = torch.empty(e.shape, dtype=torch.float32, device=e.device)
        return nn.init.trunc_normal_(s, 0.0, std, -3 * std, 3 * std, generator=gen).to(e.dtype)

    def recurrence(self, e: torch.Tensor, ctx: AttentionContext) -> Recurrence:
        _, step = super().recurrence(e, ctx)  # the adapter on [s; e] every step
        return self.initial_state(e), step

    def loop_forward(
        self, e: torch.Tensor, ctx: AttentionContext, n: int, trace: LoopTrace, **_options: Any
    ) -> torch.Tensor:
        s = self.plain_loop(self.initial_state(e), e, ctx, n, trace)  # truncated backprop: the last k steps
        if self.training and n == 0:
            s = s + 0.0 * self._touch_loop(e)
        return s


# -- RRT ----------------------------------------------------------------------------------
class LoRA(nn.Module):
    """x -> (alpha / rank) * B A x, with B = 0 at initialisation (the identity adapter)."""

    def __init__(self, fan_in: int, fan_out: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.down = Linear(fan_in, rank, bias=False, std=1.0 / math.sqrt(fan_in))
        self.up = Linear(rank, fan_out, bias=False, std=0.0)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x)) * self.scale


_LORA_SITES = ("attn_qkv", "attn_out", "mlp_in", "mlp_out")


class RRTStep(nn.Module):
    """The shared core plus one LoRA set per loop step: forward(s, e, ctx, step)."""

    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        d, layout = cfg.d_model, cfg.parsed_layout
        h = cfg.mlp_ratio * d
        rank, alpha = int(cfg.xget("lora_rank")), float(cfg.xget("lora_alpha"))
        shapes = {"attn_qkv": (d, 3 * d), "attn_out": (d, d), "mlp_in": (d, h), "mlp_out": (h, d)}
        self.core = nn.ModuleList(Block(cfg, out_std) for _ in range(layout.core))
        self.lora = nn.ModuleList(  # [step][block][site]
            nn.ModuleList(
                nn.ModuleDict({site: LoRA(*shapes[site], rank, alpha) for site in _LORA_SITES})
                for _ in range(layout.core)
            )
            for _ in range(layout.loops)
        )

    def adapters(self, step: int) -> nn.ModuleList:
        # past the trained R: the last step's adapters; lora[step] is that step's ModuleList (__init__)
        return cast(nn.ModuleList, self.lora[min(step, len(self.lora) - 1)])

    def forward(
        self, s: torch.Tensor, e: torch.Tensor, ctx: AttentionContext, step: int = 0
    ) -> tuple[torch.Tensor, None]:
        x = s
        for block, ad in zip(self.core, self.adapters(step)):  # Blocks, ModuleDicts of LoRAs (__init__)
            x = _block_with_lora(cast(Block, block), x, ctx, cast(nn.ModuleDict, ad))
        return x, None

    def touch(self, steps: Iterable[int], ref: torch.Tensor) -> torch.Tensor:
        terms: list[torch.Tensor] = []
        for step in steps:
            for ad in cast(nn.ModuleList, self.lora[step]):  # ModuleDicts of LoRAs (__init__)
                for lora in cast(nn.ModuleDict, ad).values():
                    terms.append(lora(ref.new_ones(1, 1, cast(LoRA, lora).down.in_features)))
        return _zero(*terms) if terms else ref.new_zeros(())


def _block_with_lora(block: Block, x: torch.Tensor, ctx: AttentionContext, ad: nn.ModuleDict) -> torch.Tensor:
    """Block.forward with W x + LoRA(x) at each of its four linears."""
    attn, mlp = block.attn, block.mlp
    h = block.ln_1(x)
    b, t, d = h.shape
    q, k, v = attn.heads(attn.c_attn(h) + ad["attn_qkv"](h), 3)
    y = attention(q, k, v, ctx, attn.backend, attn.dropout if block.training else 0.0)
    y = y.transpose(1, 2).reshape(b, t, d)
    x = x + attn.resid_drop(attn.c_proj(y) + ad["attn_out"](y))
    h = block.ln_2(x)
    u = F.gelu(mlp.c_fc(h) + ad["mlp_in"](h), approximate="tanh")
    return x + mlp.drop(mlp.c_proj(u) + ad["mlp_out"](u))


@builds("rrt")
class RRTGPT(LoopedBaseline):
    """s_0 = e; s_r = Core_{W + B_r A_r}(s_{r-1}); no gate, no re-injection."""

    loop: RRTStep  # build_loop's (the variant requires a looped layout)

    def build_loop(self, cfg: ModelConfig, out_std: float) -> RRTStep:
        return RRTStep(cfg, out_std)

    def loop_step(
        self,
        s: torch.Tensor,
        e: torch.Tensor,
        ctx: AttentionContext,
        step: int,
        terms: AnchorTerms | None = None,
        gate_override: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.loop(s, e, ctx, step)  # the step's own LoRA adapters

    def recurrence(self, e: torch.Tensor, ctx: AttentionContext) -> Recurrence:
        return e, lambda s, r: self.loop_step(s, e, ctx, r)[0]

    def loop_forward(
        self, e: torch.Tensor, ctx: AttentionContext, n: int, trace: LoopTrace, **_options: Any
    ) -> torch.Tensor:
        s = self.plain_loop(e, e, ctx, n, trace)
        if self.training:
            unused = list(range(n, self.max_loops))
            if unused:  # per-step adapters this depth did not reach: zero gradient, not a stale one
                s = s + self.loop.touch(unused, s)
            if n == 0:
                s = s + 0.0 * self._touch_loop(e)
        return s


# -- Ouro ---------------------------------------------------------------------------------
@builds("ouro")
class OuroGPT(LoopedBaseline):
    """Plain recurrence; exit gate lambda_t = sigmoid(w . norm(s_t) + b) (shared across steps);
    p_t = lambda_t prod_{j<t} (1 - lambda_j), the last step takes the remaining mass.
    Training loss: mean over tokens of sum_t p_t L_t - beta H(p)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.exit_gate = Linear(cfg.d_model, 1, bias=True, std=cfg.init_std)

    def recurrence(self, e: torch.Tensor, ctx: AttentionContext) -> Recurrence:
        return e, lambda s, r: self.loop_step(s, s, ctx, r)[0]  # the previous state as the anchor

    def exit_logits(self, s: torch.Tensor) -> torch.Tensor:
        x = self.exit_norm(s) if self.exit_norm is not None else s
        return self.exit_gate(x).squeeze(-1).float()

    @staticmethod
    def exit_distribution(lambdas: torch.Tensor) -> torch.Tensor:
        """lambdas [n, B, T] in (0, 1) -> p [n, B, T], summing to 1 over the n steps."""
        n = lambdas.shape[0]
        survive = torch.cumprod(torch.cat([torch.ones_like(lambdas[:1]), 1 - lambdas[:-1]]), dim=0)
        p = survive * lambdas
        return torch.cat([p[:-1], survive[-1:]]) if n > 0 else p  # the last step exits whatever is left

    def loop_forward(
        self,
        e: torch.Tensor,
        ctx: AttentionContext,
        n: int,
        trace: LoopTrace,
        *,
        targets: torch.Tensor | None,
        exit: str = "fixed",
        **_options: Any,
    ) -> torch.Tensor:
        """exit='fixed': decode after step n (early exit at a chosen depth); exit='learned': each
        token exits at the first step where the learned distribution's CDF >= exit_threshold.
        In training (with targets) the loss is the expected step loss minus beta x entropy, from
        every step's logits (return_logits does not apply: each step's per-token losses are kept)."""
        if exit not in ("fixed", "learned"):
            raise ValueError(f"exit={exit!r}: accepted values are fixed, learned")
        s = e
        if trace.states is not None:
            trace.states.append(s)
        every_step = (self.training and targets is not None) or exit == "learned"
        logits_steps: list[torch.Tensor] = []
        lambdas: list[torch.Tensor] = []
        for i in range(n):
            s, _ = self.loop_step(s, s, ctx, i)
            if trace.states is not None:
                trace.states.append(s)
            lambdas.append(torch.sigmoid(self.exit_logits(s)))
            if every_step:
                logits_steps.append(self.decode(s, ctx))
        self.last_aux = {}
        if n == 0 or not every_step:  # the epilogue decodes s
            if self.training and n == 0:  # with targets, training decodes every step at n > 0
                final = s
                trace.loss_terms += [
                    lambda: 0.0 * self._touch_loop(final),
                    lambda: _zero(self.exit_logits(final[:, :1])),
                ]
            return s
        lam = torch.stack(lambdas)  # [n, B, T]
        p = self.exit_distribution(lam)
        self.last_aux = {"exit_probs": p.detach()}
        if exit == "learned":
            cdf = p.cumsum(0)
            step = (cdf < float(self.cfg.xget("exit_threshold")) - 1e-6).sum(0).clamp(max=n - 1)  # [B, T]
            stacked = torch.stack(logits_steps)  # [n, B, T, V]
            logits = stacked.gather(0, step[None, ..., None].expand(1, *stacked.shape[1:])).squeeze(0)
            self.last_aux["exit_step"] = step + 1
            trace.decoded = logits, lm_loss(logits, targets) if targets is not None else None
            return s
        assert targets is not None  # here every_step holds by training with targets (exit='fixed')
        step_losses = torch.stack([lm_loss(lg, targets, reduction="none") for lg in logits_steps])  # [n, B, T]
        valid = is_scored(targets).float()
        denom = scored_count(targets)
        expected = ((p * step_losses).sum(0) * valid).sum() / denom
        entropy = (-(p * p.clamp_min(1e-12).log()).sum(0) * valid).sum() / denom
        beta = float(self.cfg.xget("entropy_beta"))
        # lambda_n does not enter p (the last step takes the rest): touch it for ZeRO-3
        trace.decoded = logits_steps[-1], expected - beta * entropy + _zero(lam[-1])
        self.last_aux.update(step_losses=(step_losses * valid).sum((1, 2)).detach() / denom, entropy=entropy.detach())
        return s


# -- MoR ----------------------------------------------------------------------------------
@builds("mor")
class MoRGPT(LoopedBaseline):
    """Expert-choice Mixture-of-Recursions: at step r a router scores the tokens still active,
    the top k_r = ceil(T (R - r + 1) / R) of each sequence are gathered (kept in order),
    updated s <- s + g (Core(s) - s) with g = sigmoid(router logit), and scattered back.
    Auxiliary loss: BCE of the router logits against the selection (coef aux_loss_coef)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.routers = nn.ModuleList(Linear(cfg.d_model, 1, bias=True, std=cfg.init_std) for _ in range(cfg.max_loops))

    def recurrence(self, e: torch.Tensor, ctx: AttentionContext) -> Recurrence:
        raise ConfigError(str(get_variant(self.cfg.variant).adaptive_exit_refusal))

    def capacity(self, step: int, seq_len: int) -> int:
        r_max = self.max_loops
        share = (r_max - min(step, r_max - 1)) / r_max
        return max(1, math.ceil(seq_len * share))

    def loop_forward(
        self, e: torch.Tensor, ctx: AttentionContext, n: int, trace: LoopTrace, **_options: Any
    ) -> torch.Tensor:
        s = e
        b, t, d = s.shape
        if trace.states is not None:
            trace.states.append(s)
        active = torch.ones(b, t, dtype=torch.bool, device=s.device)
        per_row = t  # tokens active in each sequence (the last step's k): known on the host, no sync
        aux_terms: list[torch.Tensor] = []
        selected_counts: list[int] = []
        masks: list[torch.Tensor] = []
        noise = float(self.cfg.xget("router_noise_std"))
        doc_ids = ctx.doc_ids
        for i in range(n):
            router = self.routers[min(i, len(self.routers) - 1)]
            logits_r = router(s).squeeze(-1).float()  # [B, T]
            if self.training and noise > 0:
                logits_r = logits_r + noise * torch.randn_like(logits_r)
            k = min(self.capacity(i, t), per_row)
            scores = logits_r.masked_fill(~active, float("-inf"))
            chosen = scores.topk(k, dim=1).indices.sort(dim=1).values  # [B, k], in sequence order
            picked = torch.zeros_like(active).scatter(1, chosen, True)
            bce = F.binary_cross_entropy_with_logits(logits_r, picked.float(), reduction="none")
            aux_terms.append((bce * active).sum() / (b * per_row))  # the mean over the active tokens
            gather_idx = chosen[..., None].expand(b, k, d)
            x = s.gather(1, gather_idx)
            sub_ctx = AttentionContext(doc_ids=doc_ids.gather(1, chosen) if doc_ids is not None else None)
            out, _ = self.loop_step(x, x, sub_ctx, i)
            g = torch.sigmoid(logits_r.gather(1, chosen))[..., None].to(x.dtype)
            s = s.scatter(1, gather_idx, x + g * (out - x))
            active, per_row = picked, k
            selected_counts.append(b * k)
            masks.append(picked)
            if trace.states is not None:
                trace.states.append(s)
        self.last_aux = {"selected": selected_counts, "selected_masks": masks}
        if self.training:
            if aux_terms:
                coef = float(self.cfg.xget("aux_loss_coef"))
                trace.loss_terms.append(lambda: coef * torch.stack(aux_terms).mean())
            if n < len(self.routers):
                trace.loss_terms.append(lambda: _zero(*self.unused(s, n)))
        return s

    def unused(self, s: torch.Tensor, n: int) -> list[torch.Tensor]:
        """What a forward of depth n < R touches at zero weight: the routers past depth n and, at
        depth 0, the loop."""
        head = s[:, :1]
        return [self.routers[j](head) for j in range(n, len(self.routers))] + ([self._touch_loop(s)] if n == 0 else [])
