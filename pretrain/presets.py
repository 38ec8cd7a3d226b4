"""Named model presets (the spec's table plus tiny CPU ones) and `grt presets`.

Dense GPT-2 presets use Hugging Face's conventions (biases, vocabulary 50,257), so
dense-small exports as GPT-2's 124,439,808 parameters. GRT presets use the authors' nanoGPT
conventions (no biases), which reproduce their model cards exactly (grt-large 290,196,480;
grt-large-isoparams 781,780,480). Every preset trains with the vocabulary padded to 50,304
(ModelConfig.pad_vocab_multiple, pretrain/model_config.py): dense-small trains 47 padded rows more
than it exports.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from grt_common.errors import ConfigError
from pretrain.model_config import ModelConfig
from pretrain.variants import REGISTRY, Baseline, get_variant

HF = dict(bias=True, vocab_size=50257)
NANOGPT = dict(bias=False, vocab_size=50257)
TINY = dict(bias=False, vocab_size=4096, max_seq_len=256)
# the start in which a small GRT uses its loop, measured (docs/comparison.md, "A start in which a small GRT
# uses its loop"): the gate at 0.5 instead of the paper's 0.98 (from +4 it closes at CPU budgets) and the
# state noise relative to the state's RMS (the paper's absolute 0.1 drowns a fresh model's ~0.03 state)
LOOP_START = dict(gate_bias_init=0.0, state_noise_scale="relative", proj_init="random")
PAPER_START = {key: getattr(ModelConfig, key) for key in LOOP_START}  # ModelConfig's defaults: the paper's
TINY_GRT = {**TINY, **LOOP_START}


LOOP_ONLY = dict(gate=False, reinject_anchor=False, state_noise_std=0.0)

# the place-* presets: one layout per placement of the loop (pretrain.model_config.Layout.placement),
# canonical forms, each 12 blocks deep at R = 4
PLACEMENT_LAYOUTS = {"whole": "3x4", "middle": "2+2x4+2", "bottom": "0+2x4+4", "top": "4+2x4+0"}


def _preset(
    name: str, variant: str, layout: str, d_model: int, n_heads: int, conventions: dict[str, Any], **overrides: Any
) -> tuple[str, ModelConfig]:
    return name, ModelConfig(
        name=name, variant=variant, layout=layout, d_model=d_model, n_heads=n_heads, **{**conventions, **overrides}
    )


PRESETS: dict[str, ModelConfig] = dict(
    [
        _preset("dense-small", "dense", "12", 768, 12, HF),
        _preset("dense-medium", "dense", "24", 1024, 16, HF),
        _preset("dense-large", "dense", "36", 1280, 20, HF),
        _preset("grt-small", "grt", "1+1x10+1", 768, 12, NANOGPT),
        _preset("grt-medium", "grt", "2+5x4+2", 1024, 16, NANOGPT),
        _preset("grt-large", "grt", "1+5x6+5", 1280, 20, NANOGPT),
        _preset("grt-small-isoparams", "grt", "1+10x10+1", 768, 12, NANOGPT),
        _preset("grt-medium-isoparams", "grt", "2+20x4+2", 1024, 16, NANOGPT),
        _preset("grt-large-isoparams", "grt", "3+30x6+3", 1280, 20, NANOGPT),
        # tiny presets for CPU tests and the demo; tiny-dense has tiny-grt's FLOPs per token
        _preset("tiny-grt", "grt", "1+2x4+1", 128, 4, TINY_GRT),
        _preset("tiny-dense", "dense", "10", 128, 4, TINY),
        _preset("micro-grt", "grt", "1+1x3+1", 32, 2, TINY_GRT, vocab_size=512, max_seq_len=64),
        _preset("micro-dense", "dense", "5", 32, 2, TINY, vocab_size=512, max_seq_len=64),
        # the GRT whose core attends to keys and values of the anchor, computed once per forward (CART)
        _preset("tiny-grt-anchor-kv", "grt", "1+2x4+1", 128, 4, TINY_GRT, core_kv="anchor"),
        _preset(
            "micro-grt-anchor-kv", "grt", "1+1x3+1", 32, 2, TINY_GRT, vocab_size=512, max_seq_len=64, core_kv="anchor"
        ),
        # the baselines of the paper's comparison (docs/comparison.md): no GRT gate, no state noise
        *[
            _preset(
                f"{size}-{v}",
                v,
                layout,
                d,
                heads,
                TINY,
                **sizing,
                **variant.switches(),
                extra=dict(variant.preset_extra),
            )
            for size, layout, d, heads, sizing in (
                ("micro", "1+1x3+1", 32, 2, dict(vocab_size=512, max_seq_len=64)),
                ("tiny", "1+2x4+1", 128, 4, {}),
            )
            for v, variant in REGISTRY.items()
            if isinstance(variant, Baseline)
        ],
        # the ablation ladder at tiny size: loop only, then add prelude/coda, state noise,
        # prelude re-injection and the gate (ladder-4 is tiny-grt); loop only loops the whole
        # stack, 2x5 (the effective depth 10 of 1+2x4+1)
        _preset("ladder-0-loop-only", "grt", "2x5", 128, 4, TINY_GRT, **LOOP_ONLY),
        _preset("ladder-1-prelude-coda", "grt", "1+2x4+1", 128, 4, TINY_GRT, **LOOP_ONLY),
        _preset("ladder-2-noise", "grt", "1+2x4+1", 128, 4, TINY_GRT, **{**LOOP_ONLY, "state_noise_std": 0.1}),
        _preset(
            "ladder-3-reinject",
            "grt",
            "1+2x4+1",
            128,
            4,
            TINY_GRT,
            **{**LOOP_ONLY, "state_noise_std": 0.1, "reinject_anchor": True},
        ),
        _preset("ladder-4-gate", "grt", "1+2x4+1", 128, 4, TINY_GRT),
        # where to loop (../shared/seeds/004: the whole stack, the middle, the bottom, the top): the
        # full GRT at tiny size, 12 blocks executed, R = 4 each, so equal forward FLOPs per token;
        # the three partial placements share their unique blocks (2 core + 4 once), only their order differs
        *[_preset(f"place-{where}", "grt", layout, 128, 4, TINY_GRT) for where, layout in PLACEMENT_LAYOUTS.items()],
    ]
)

# The parameter counts each preset advertises (docs, model cards); a test builds every
# preset on the meta device and checks it against these.
ADVERTISED_PARAMS: dict[str, int] = {
    # GPT-2's counts (124,439,808; 354,823,168; 774,030,080: the Hugging Face export's) plus the 47 padded
    # rows of the tied embedding (50,304 - 50,257) that training carries
    "dense-small": 124_439_808 + 47 * 768,
    "dense-medium": 354_823_168 + 47 * 1024,
    "dense-large": 774_030_080 + 47 * 1280,
    "grt-small": 63_611_904,
    "grt-medium": 171_073_536,
    "grt-large": 290_196_480,
    "grt-small-isoparams": 127_326_720,
    "grt-medium-isoparams": 359_847_936,
    "grt-large-isoparams": 781_780_480,
    "tiny-grt": 1_427_200,
    "tiny-dense": 2_525_824,
    "micro-grt": 60_800,
    "micro-dense": 80_224,
    "tiny-grt-anchor-kv": 1_427_200,  # the same weights as tiny-grt, c_attn split into c_q and c_kv
    "micro-grt-anchor-kv": 60_800,
    "micro-huginn": 57_664,
    "micro-rrt": 61_696,
    "micro-ouro": 55_585,
    "micro-mor": 55_651,
    "tiny-huginn": 1_378_048,
    "tiny-rrt": 1_410_304,
    "tiny-ouro": 1_344_897,
    "tiny-mor": 1_345_284,
    "ladder-0-loop-only": 951_040,
    "ladder-1-prelude-coda": 1_344_768,
    "ladder-2-noise": 1_344_768,
    "ladder-3-reinject": 1_377_536,
    "ladder-4-gate": 1_427_200,
    "place-whole": 1_230_336,
    "place-middle": 1_820_928,
    "place-bottom": 1_820_928,
    "place-top": 1_820_928,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; accepted presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace()


def describe(cfg: ModelConfig) -> dict:
    from pretrain.model import build_model
    from pretrain.model.flops import count_params, flops_per_token

    with torch.device("meta"):
        counts = count_params(build_model(cfg))
    return {
        "name": cfg.name,
        "variant": cfg.variant,
        "layout": cfg.layout,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size,
        "max_seq_len": cfg.max_seq_len,
        "bias": cfg.bias,
        "effective_depth": cfg.parsed_layout.effective_depth(),
        **counts,
        "flops_per_token": flops_per_token(cfg),
        "train": get_variant(cfg.variant).train_recipe(cfg),  # the recipe a run of the preset starts from
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grt presets", description="List the model presets.")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    args = parser.parse_args(argv)
    rows = [describe(cfg) for cfg in PRESETS.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = f"{'preset':<22}{'layout':<11}{'d':>6}{'heads':>6}{'depth':>6}{'params':>14}{'non-emb':>14}"
    print(f"{header}{'GFLOPs/tok':>11}  training recipe")
    for r in rows:
        print(
            f"{r['name']:<22}{r['layout']:<11}{r['d_model']:>6}{r['n_heads']:>6}{r['effective_depth']:>6}"
            f"{r['params']:>14,}{r['non_embedding_params']:>14,}{r['flops_per_token'] / 1e9:>11.3f}  "
            + (" ".join(f"{k}={v}" for k, v in r["train"].items()) or "-")
        )
    print(
        "\nFLOPs: forward per token at max_seq_len and the trained depth (pretrain.model.flops, every variant); "
        "training is about 3x.\nTraining recipe: the training settings of the preset's method (its Variant, "
        "pretrain/variants/), applied before --set."
    )
    return 0
