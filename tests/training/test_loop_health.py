"""The loop's health verdict (pretrain/infer/loop_health.py) and training's warning of an unused
loop: once, after warm-up, with what to try."""

from __future__ import annotations

import logging

import pytest

from pretrain.infer.loop_health import MIN_LOOP_GAIN, loop_health
from pretrain.training.evaluation.validation import Validation

USED = {0: 4.60, 1: 4.40, 2: 4.30, 3: 4.25}
UNUSED = {0: 4.471, 1: 4.471, 2: 4.470, 3: 4.468}  # the demo's dead loop before the residual start


def test_the_gain_is_depth_0_minus_depth_r_and_the_verdict_follows_the_threshold():
    health = loop_health(USED, [0.6, 0.55, 0.5], {"grad_norm/prelude": 3.0, "grad_norm/core": 4.0})
    assert health is not None
    assert health.gain == pytest.approx(0.35) and health.gain_first == pytest.approx(0.20)
    assert health.used and health.core_grad_share == pytest.approx(16 / 25)
    assert "loop used" in health.line() and "0.600 0.550 0.500" in health.line()
    dead = loop_health(UNUSED, [0.997] * 3)
    assert dead is not None and not dead.used and dead.gain < MIN_LOOP_GAIN
    assert "NOT USED" in dead.line()
    assert "gate has closed" in dead.warning() and "gate_bias_init=0" in dead.warning()


def test_a_model_without_a_loop_has_no_verdict():
    assert loop_health({0: 4.0}) is None


def test_training_warns_once_after_warm_up(caplog):
    validation = Validation({}, {}, 3, 10, False, writer=None, device=None, warmup_steps=20)
    dead = loop_health(UNUSED, [0.997] * 3)
    assert dead is not None
    with caplog.at_level(logging.INFO, logger="grt.train"):
        for step in (10, 20, 30, 40):
            record: dict = {}
            validation.check_loop(dead, step, record)
            assert record["loop"]["used"] is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].getMessage().startswith("step 30: the loop is not being used")
    assert sum("loop gain" in r.getMessage() for r in caplog.records) == 4
