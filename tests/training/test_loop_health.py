"""The loop's health verdict (pretrain/infer/loop_health.py), built from the depths the model is
trained at (depth 0 never is), and training's warning of a loop whose steps after the first add
nothing: once, after warm-up, with advice that names only what the run does not use."""

from __future__ import annotations

import logging

import pytest

from pretrain.infer.loop_health import MIN_GAIN_AFTER_FIRST, loop_health, run_settings
from pretrain.presets import get_preset
from pretrain.training.evaluation.validation import Validation

USED = {0: 4.60, 1: 4.40, 2: 4.30, 3: 4.25}
# the demo's loop: depth 0 (never trained) 0.78 above depth 1, steps 2..4 flat
FIRST_STEP_ONLY = {0: 5.197, 1: 4.422, 2: 4.410, 3: 4.411, 4: 4.411}
UNUSED = {0: 4.471, 1: 4.471, 2: 4.470, 3: 4.468}  # a dead loop, its gate closed
TINY = run_settings(get_preset("tiny-grt"), "uniform")  # gate 0, relative noise: the tiny presets' start
PAPER = run_settings(get_preset("grt-small"), "uniform")  # gate +4, absolute noise


def test_the_verdict_is_built_from_the_trained_depths():
    health = loop_health(USED, [0.6, 0.55, 0.5], {"grad_norm/prelude": 3.0, "grad_norm/core": 4.0}, 3, TINY)
    assert health is not None and health.first == 1 and health.loops == 3
    assert health.drops == pytest.approx({2: 0.10, 3: 0.05}) and health.gain_after_first == pytest.approx(0.15)
    assert health.used and health.stops_after is None and health.core_grad_share == pytest.approx(16 / 25)
    line = health.line()
    assert "steps after the first add +0.150 nats (depth 1 -> 3; drop by step +0.100 +0.050)" in line
    assert "falls at every step to 3" in line and "later loop steps used" in line and "0.600 0.550 0.500" in line
    assert "depth 0 (untrained) +0.200 above depth 1" in line  # information, out of the verdict
    assert health.scalars()["loop/gain_after_first"] == pytest.approx(0.15)
    assert health.scalars()["loop/drop_step_2"] == pytest.approx(0.10) and "loop/gain" not in health.scalars()


def test_depth_0_bad_and_later_steps_flat_is_a_loop_whose_later_steps_add_nothing():
    health = loop_health(FIRST_STEP_ONLY, [0.73, 0.84, 0.84, 0.84], None, 4, TINY)
    assert health is not None and health.used is False  # the old verdict (L(0) - L(R) = 0.786) said "used"
    assert health.gain_after_first is not None and health.gain_after_first < MIN_GAIN_AFTER_FIRST
    assert health.gain_after_first == pytest.approx(0.011)
    assert health.stops_after == 2  # 4.422 -> 4.410 (0.012), then -0.001
    assert "ADD NOTHING" in health.line() and "stops falling after step 2" in health.line()
    assert health.record()["stops_after_step"] == 2 and health.record()["used"] is False
    assert "steps after the first add nothing" in health.warning()


def test_the_advice_names_only_what_the_run_does_not_use():
    tiny = loop_health(FIRST_STEP_ONLY, [], None, 4, TINY)
    paper = loop_health(UNUSED, [0.997] * 3, None, 3, PAPER)
    assert tiny is not None and paper is not None
    # the tiny start already has the gate at 0 and relative noise: only the depth is left to try
    assert "gate_bias_init" not in tiny.warning() and "state_noise_scale" not in tiny.warning()
    assert "train.depth_sampling=fixed" in tiny.warning()
    assert "gate has closed" in paper.warning()
    assert "model.gate_bias_init=0.0" in paper.warning() and "model.state_noise_scale=relative" in paper.warning()
    fixed = loop_health(FIRST_STEP_ONLY, [], None, 4, {**TINY, "train.depth_sampling": "fixed"})
    unknown = loop_health(FIRST_STEP_ONLY, [], None, 4, None)
    assert fixed is not None and unknown is not None
    # a run at fixed depth trains depth R only: no verdict on the depths below, no warning
    assert fixed.first == 4 and fixed.used is None and "trained at depth 4 only" in fixed.line()
    assert fixed.advice().startswith("the run already uses train.depth_sampling=fixed, model.gate_bias_init=0.0")
    assert "what the run does not use of" in unknown.advice()  # settings not known: all, said so


def test_depths_beyond_r_and_r_1_stay_out_of_the_verdict():
    beyond = loop_health({**USED, 4: 4.24, 6: 4.30}, [], None, 3, TINY)
    assert beyond is not None and beyond.gain_after_first == pytest.approx(0.15)
    assert "beyond R 4:+0.010 6:-0.050" in beyond.line()
    r1 = loop_health({0: 5.0, 1: 4.0}, [], None, 1, TINY)
    assert r1 is not None and r1.used is None and "R = 1" in r1.line() and r1.scalars() == {}
    capped = loop_health(USED, [], None, 3, {**TINY, "train.max_train_depth": 2})  # trains 1..2: depth 3 beyond
    assert capped is not None and capped.loops == 2 and capped.gain_after_first == pytest.approx(0.10)


def test_a_model_without_a_loop_has_no_verdict():
    assert loop_health({0: 4.0}) is None


def test_training_warns_once_after_warm_up(caplog):
    validation = Validation({}, {}, 3, 10, False, writer=None, device=None, warmup_steps=20, settings=PAPER)
    dead = loop_health(UNUSED, [0.997] * 3, None, 3, PAPER)
    assert dead is not None
    with caplog.at_level(logging.INFO, logger="grt.train"):
        for step in (10, 20, 30, 40):
            record: dict = {}
            validation.check_loop(dead, step, record)
            assert record["loop"]["used"] is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].getMessage().startswith(
        "step 30: the loop's steps after the first add nothing"
    )
    assert sum("steps after the first add" in r.getMessage() for r in caplog.records) == 5  # 4 lines, 1 warning
