"""The loop learns: after a short training of micro-grt (the tiny presets' start) on real text, the
validation loss at depth R is below depth 0 by a margin (pretrain.infer.loop_health), and the same
check fails on a loop that cannot learn: the core detached from the loss, or the gate stuck at 1."""

from __future__ import annotations

import itertools

import pytest
import torch

from pretrain.infer.loop_health import MIN_LOOP_GAIN, LoopHealth
from pretrain.model import build_model
from pretrain.model.gpt import GPT, LoopStep
from pretrain.presets import get_preset
from pretrain.tools.loop_start import loader, measure, train_briefly

STEPS, LR, WARMUP = 300, 3e-3, 30


def trained_health(manifest: str, broken: str = "") -> LoopHealth:
    """micro-grt's loop health after STEPS steps (pretrain/tools/loop_start.py, the start sweep's
    training), broken as asked."""
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt"))
    if broken == "core detached from the loss":
        detach_core(model)
    gate = 1.0 if broken == "gate stuck at 1" else None
    train_briefly(model, loader(manifest, "train", 16, 0), STEPS, LR, WARMUP, seed=0, gate_override=gate)
    return measure(model, list(itertools.islice(loader(manifest, "val", 16, 0), 8)))


def detach_core(model: GPT) -> None:
    """The core's output cut from the graph: no gradient reaches the core or the projection."""
    loop = model.loop
    assert isinstance(loop, LoopStep)
    for block in loop.core:
        block.register_forward_hook(lambda _m, _i, out: out.detach())


def test_a_short_training_uses_the_loop(shards):
    health = trained_health(str(shards))
    assert health.used, health.line()
    assert health.gain >= 2 * MIN_LOOP_GAIN, health.line()
    assert health.gate_means[0] <= 0.95, health.line()  # the gate writes: it has not closed


@pytest.mark.parametrize("broken", ["core detached from the loss", "gate stuck at 1"])
def test_the_check_fails_on_a_loop_that_cannot_learn(shards, broken):
    health = trained_health(str(shards), broken)
    assert not health.used, f"{broken}: {health.line()}"
    assert "not being used" in health.warning()
