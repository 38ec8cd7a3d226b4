"""Hugging Face model of a looped model exported by `grt export` (remote code).

The model is the project's own source, vendored by `grt export` next to this file with its
imports made relative (grt_gpt.py, grt_layers.py, grt_baselines.py, grt_kv_cache.py, ...):
one source of truth, no second copy of the model to drift. This file only wraps it:

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, depth=k)
    model(input_ids).logits             the project's model(input_ids, n_loops=depth)
    model.generate(input_ids, ...)      decodes through the project's KV cache (CachedDecoder,
                                        strategy config.kv_cache); use_cache=False recomputes
"""

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_grt import GRTConfig
from .grt_gpt import lm_loss
from .grt_kv_cache import CachedDecoder
from .grt_registry import build_model


class GRTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GRTConfig
    base_model_prefix = "grt"
    _no_split_modules = ["Block", "LoopStep"]
    _tied_weights_keys = {"grt.lm_head.weight": "grt.wte.weight"}

    def __init__(self, config: GRTConfig):
        super().__init__(config)
        self.grt = build_model(config.model_config())
        if not self.grt.runs_grt_loop():  # a loop of its own, which CachedDecoder cannot replay: recompute
            self.generation_config.use_cache = False
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the project's CachedDecoder, made by forward on the first call

    def _init_weights(self, module):
        if hasattr(module, "reset_parameters") and module is not self:
            module.reset_parameters()

    def get_input_embeddings(self):
        return self.grt.wte

    def get_output_embeddings(self):
        return self.grt.lm_head

    def _reorder_cache(self, cache: CachedDecoder, beam_idx: torch.LongTensor) -> CachedDecoder:
        """Beam search: the cached keys/values of the beams kept ([slots, B, ...] -> the batch rows)."""
        kv = cache.cache
        kv.k, kv.v = kv.k.index_select(1, beam_idx.to(kv.k.device)), kv.v.index_select(1, beam_idx.to(kv.v.device))
        return cache

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: CachedDecoder | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """logits [B, T, V] at config.depth loop steps. With use_cache (generate) the tokens go
        through a CachedDecoder, which returns the last position's logits [B, 1, V]; pass it back
        as `cache` with the next tokens. The model has no padding mask: right padding is harmless
        for scoring only (attention is causal, so real positions never see the pads); left padding,
        which shifts positions, is refused, and so is any padding in generate (use_cache or
        logits_to_keep), which would predict from a pad and append after the pads."""
        depth, strategy = self.config.inference_settings()
        if cache is None and attention_mask is not None:
            if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
                raise ValueError(
                    "GRT: left padding is not supported (pad on the right to score; generate one prompt at a time)"
                )
            if (use_cache or logits_to_keep) and not bool(attention_mask.all()):
                raise ValueError(
                    "GRT: generate() cannot honour padding: generate one prompt at a time, or prompts of equal length"
                )
        if cache is None and use_cache and self.grt.runs_grt_loop():
            cache = CachedDecoder(self.grt, batch=input_ids.shape[0], strategy=strategy, n_loops=depth)
        if cache is not None:
            logits = cache.forward(input_ids)[:, None]
        else:
            logits = self.grt(input_ids, n_loops=depth).logits
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            if logits.shape[1] != labels.shape[1]:
                raise ValueError(
                    "GRT: labels need the logits of every position: call without use_cache and logits_to_keep"
                )
            loss = lm_loss(logits[:, :-1], labels[:, 1:].to(logits.device))
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
