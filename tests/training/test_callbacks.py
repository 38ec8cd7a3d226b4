"""The fit loop's callbacks (pretrain/training/callbacks.py) on their own, without a run: what each
hook does with what `fit` hands it (the multi-rank runs of test_watching.py cover them in a run)."""

import logging

import pytest

from data_pipeline.batches import TokenCount
from pretrain.presets import get_preset
from pretrain.training.callbacks import Callback
from pretrain.training.report.metrics import Throughput
from pretrain.training.report.step_timing import DataStarved
from pretrain.training.step.loss_spikes import LossSpikes


class Scalars:
    """A MetricsWriter that keeps what it is given."""

    def __init__(self):
        self.written = []

    def scalars(self, step, values, tokens=None):
        self.written.append((step, dict(values), tokens))


def test_the_base_callback_does_nothing_at_every_hook():
    callback = Callback()
    record = {"loss": 1.0}
    files = {}
    callback.on_fit_start(0)
    callback.on_step_begin(0)
    callback.on_step_end(1, record)
    callback.on_log(1, {"train/loss": 1.0})
    callback.on_validation(1)
    callback.on_save(1, files)
    callback.on_rollback(0)
    assert callback.log_values(1) == {} and record == {"loss": 1.0} and files == {}


def test_a_loss_spike_is_flagged_in_the_record_and_the_scalars(caplog):
    writer, count = Scalars(), TokenCount()
    count.add({"": 4096})
    spikes = LossSpikes(threshold=3.0, writer=writer, count=count, say=True, min_history=5)
    for step in range(1, 11):
        record = {"loss": 2.0 + 0.01 * (step % 3)}
        spikes.on_step_end(step, record)
        assert "loss_spike" not in record
    record = {"loss": 9.0}
    with caplog.at_level(logging.WARNING, logger="grt.train"):
        spikes.on_step_end(11, record)
    assert record["loss_spike"] is True
    assert writer.written == [(11, {"train/loss_spike": 1.0}, 4096)]
    assert "loss spike at step 11: 9.0000" in caplog.text
    assert 9.0 not in spikes.history  # a spike does not move the statistic


def test_data_starved_is_said_once_and_only_on_timed_steps(caplog):
    starved = DataStarved(rank=1, share=0.5, num_workers=2)
    with caplog.at_level(logging.WARNING, logger="grt.train"):
        starved.on_log(1, {"train/loss": 1.0})  # not timed: no time/* values
        starved.on_log(2, {"time/data_s": 0.2, "time/step_s": 1.0})
        starved.on_log(3, {"time/data_s": 0.8, "time/step_s": 1.0})
        starved.on_log(4, {"time/data_s": 0.9, "time/step_s": 1.0})
    said = [r.getMessage() for r in caplog.records if "data-starved" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("data-starved: rank 1 waited for data 80% of step 3"), said


def test_throughput_counts_each_step_at_its_depth_and_restarts_after_evaluation():
    cfg, now = get_preset("micro-grt"), [0.0]
    meter = Throughput(cfg, 64, 1e12, tokens_per_step=1000, clock=lambda: now[0])
    meter.on_fit_start(0)
    for step, depth in enumerate((1, 2), 1):
        meter.on_step_end(step, {"loss": 1.0, "depth": depth})
    now[0] += 2.0
    assert meter.log_values(2)["perf/tokens_per_s"] == pytest.approx(1000.0)
    meter.on_step_end(3, {"loss": 1.0, "depth": 1})
    meter.on_validation(3)  # the evaluation's time is not the training's
    now[0] += 1.0
    assert meter.log_values(3)["perf/tokens_per_s"] == 0
