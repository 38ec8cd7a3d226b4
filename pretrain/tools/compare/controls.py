"""`grt compare`'s controls of a looped model: what says whether its loop does any work.

A control is named after the model it controls, `--configs tiny-grt:dense-params` (a preset or a
JSON config, then a colon and the control), and trains as the run labelled
`tiny-grt-dense-params`. Each is derived from the base model after its `--set model.*` overrides
and the data's vocabulary, so that it differs from the base in the one thing it controls:

- dense-params: the dense model of equal parameters, the base's P + C + K blocks with no loop
  (tiny-grt `1+2x4+1`: a 4-block dense model, 1.34M parameters against 1.43M: the loop's projection
  and gate are the difference);
- dense-flops: the dense model closest to the base's forward FLOPs per token at depth R (what an
  inference at full depth costs; tiny-grt: 11 blocks, its loop's projection and gate counted, where
  the preset `tiny-dense` has the 10 blocks of its effective depth);
- dense-train-flops: the dense model closest to the base's training FLOPs per token, the mean over
  the depths its recipe draws (uniform on 1..R trains at mean depth (R + 1) / 2: tiny-grt 8 blocks);
- r1: the same layout at R = 1 (one loop step, trained and evaluated so);
- fixed: the same model trained at depth R every step (`train.depth_sampling=fixed`);
- paper-start: the same model from the paper's start (`pretrain/presets.py` PAPER_START: the gate
  at sigmoid(4) = 0.98, absolute state noise, random W_proj; docs/model.md).

Each control's run gets {"of": base label, "kind": control}; the seed tables compare it with its
base, paired by seed (pretrain/tools/compare/seeds.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grt_common.errors import ConfigError
from pretrain.model.flops import flops_per_token, train_flops_per_token
from pretrain.model_config import Layout, ModelConfig
from pretrain.presets import PAPER_START
from pretrain.runs.run_config import RunConfig
from pretrain.training.depth import depth_for_step

# control -> (what it is, the paper's claim as "the base below the control", the paper's base - control)
CONTROLS: dict[str, tuple[str, str, float | None]] = {
    "dense-params": (
        "dense, equal parameters",
        "the GRT is below the dense model of equal parameters (isoparams, medium: 2.76 vs 2.84)",
        -0.08,
    ),
    "dense-flops": (
        "dense, equal inference FLOPs",
        "the GRT is below the dense model of equal FLOPs (3.141 vs 3.157)",
        -0.016,
    ),
    "dense-train-flops": (
        "dense, equal training FLOPs",
        "the GRT is below the dense model of its training FLOPs (not in the paper)",
        None,
    ),
    "r1": ("same layout, R = 1", "looping pays: the GRT at R is below its layout at R = 1 (not in the paper)", None),
    "fixed": (
        "depth fixed at R",
        "depths drawn on 1..R are below depth fixed at R (not in the paper; the paper draws them)",
        None,
    ),
    "paper-start": (
        "the paper's start",
        "the tiny presets' start is below the paper's start at this scale (docs/model.md)",
        None,
    ),
}
DEPTH_DRAWS = 4096  # depth draws that estimate a recipe's mean training FLOPs


def parse_control(spec: str) -> tuple[str, str] | None:
    """(base spec, control) for `BASE:CONTROL`; None for a plain preset or JSON file."""
    if ":" not in spec or Path(spec).suffix == ".json":
        return None
    base, _, kind = spec.rpartition(":")
    if kind not in CONTROLS:
        raise ConfigError(f"config {spec!r}: unknown control {kind!r}; accepted: {', '.join(CONTROLS)}")
    return base, kind


def control_label(base_label: str, kind: str) -> str:
    return f"{base_label}-{kind}"


def dense_params(model: ModelConfig) -> ModelConfig:
    """The dense model of the looped model's unique blocks (P + C + K), nothing else changed."""
    layout = model.parsed_layout
    if not layout.looped:
        raise ConfigError(f"{model.name} ({model.layout}) has no loop: a control of a looped model only")
    return model.replace(name=f"{model.name}:dense-params", variant="dense", layout=str(layout.unique_blocks))


def mean_train_flops(cfg: RunConfig, seq_len: int) -> float:
    """Training FLOPs per token of a run, averaged over the depths its recipe draws."""
    depths = [depth_for_step(cfg.train, cfg.model.max_loops, step) for step in range(DEPTH_DRAWS)]
    return sum(train_flops_per_token(cfg.model, seq_len, d) for d in depths) / len(depths)


def control_model(base: RunConfig, kind: str, seq_len: int) -> tuple[ModelConfig, dict[str, Any]]:
    """The control's model and its training overrides, from the base run (model overrides and
    vocabulary applied, its recipe set)."""
    from pretrain.tools.compare.sizing import match

    model = base.model
    if not model.parsed_layout.looped:
        raise ConfigError(f"control {kind!r} of {model.name} ({model.layout}): a control of a looped model only")
    if kind == "dense-params":
        return dense_params(model), {}
    if kind == "dense-flops":
        dense = match(dense_params(model), flops_per_token(model, seq_len), "flops", seq_len)
        return dense.replace(name=f"{model.name}:dense-flops"), {}
    if kind == "dense-train-flops":
        dense = match(dense_params(model), mean_train_flops(base, seq_len), "train-flops", seq_len)
        return dense.replace(name=f"{model.name}:dense-train-flops"), {}
    if kind == "r1":
        parts = model.parsed_layout
        layout = Layout(parts.prelude, parts.core, 1, parts.coda)
        return model.replace(name=f"{model.name}:r1", layout=str(layout)), {}
    if kind == "fixed":
        return model, {"depth_sampling": "fixed"}
    assert kind == "paper-start", kind
    return model.replace(name=f"{model.name}:paper-start", **PAPER_START), {}
