"""Per-token adaptive exit (pretrain/infer/adaptive.py) and `grt eval --adaptive-exit`."""

import json

import pytest
import torch
from trained_models import (  # noqa: F401 (fixtures)
    assert_extreme_thresholds_are_fixed_depths,
    grt_run,
    manifest,
    single_thread,
    small_model,
)

from grt_common.errors import ConfigError
from pretrain.infer.adaptive import adaptive_forward, adaptive_table, parse_thresholds
from pretrain.infer.evaluation.evaluate import main as eval_main
from pretrain.infer.evaluation.scoring import adaptive_sums
from pretrain.model import build_model
from pretrain.presets import get_preset

R = 3


def _idx(seed=0, b=2, t=24):
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("criterion", ["update", "kl"])
def test_extreme_thresholds_are_the_fixed_depths(criterion):
    assert_extreme_thresholds_are_fixed_depths(small_model(), _idx(), criterion, R)


@pytest.mark.parametrize("criterion", ["update", "kl"])
def test_tokens_exit_at_their_own_step_with_a_frozen_state(criterion):
    model, idx = small_model(layout="1+2x6+1"), _idx(1, b=4)
    # a threshold between the smallest and the largest first-step change: some tokens exit early
    _, steps_all = adaptive_forward(model, idx, 0.0, criterion)
    thr = _median_first_change(model, idx, criterion)
    logits, steps = adaptive_forward(model, idx, thr, criterion)
    assert steps.min() >= 1 and steps.max() <= 6 and 1 < steps.float().mean() < 6
    # position 0 attends only to itself: its logits are a fixed-depth forward at its own step count
    for b in range(idx.shape[0]):
        n = int(steps[b, 0])
        ref = model(idx[b : b + 1, :1], n_loops=n).logits[0, 0]
        torch.testing.assert_close(logits[b, 0], ref, rtol=0, atol=1e-5)
    # a lower threshold never uses fewer steps on average
    _, more = adaptive_forward(model, idx, thr / 4, criterion)
    assert more.float().mean() >= steps.float().mean()


def _median_first_change(model, idx, criterion):
    from pretrain.infer.adaptive import step_change
    from pretrain.model.layers import AttentionContext

    ctx = AttentionContext()
    e = model.run_prelude(model.embed(idx), ctx)
    s1, _ = model.loop_step(e, e, ctx, 0)
    decode = lambda s: model.decode(s, ctx)  # noqa: E731
    logp = torch.log_softmax(decode(e).float(), -1) if criterion == "kl" else None
    change, _ = step_change(criterion, e, s1, logp, decode)
    return change.median().item()


@pytest.mark.parametrize("variant", ["huginn", "rrt", "ouro"])
@pytest.mark.parametrize("criterion", ["update", "kl"])
def test_baselines_run_their_own_loop(variant, criterion):
    # each variant's recurrence (Huginn's random start, RRT's per-step adapters, Ouro's previous-state
    # anchor): threshold 0 is its own fixed-depth forward, an infinite one its depth 1
    torch.manual_seed(0)
    model, idx = build_model(get_preset(f"micro-{variant}")).eval(), _idx()
    for threshold, depth in ((0.0, model.max_loops), (float("inf"), 1)):
        logits, steps = adaptive_forward(model, idx, threshold, criterion)
        assert torch.equal(steps, torch.full_like(steps, depth))
        torch.testing.assert_close(logits, model(idx, n_loops=depth).logits, rtol=0, atol=1e-5)


def test_sums_count_loss_tokens_and_steps():
    model, idx = small_model(), _idx(2)
    targets = idx.roll(-1, 1)
    targets[:, -3:] = -100
    batches = [{"input_ids": idx, "targets": targets}]
    table = adaptive_table(adaptive_sums(model, batches, [0.0], torch.device("cpu")), [0.0])
    ref = torch.nn.functional.cross_entropy(
        model(idx, n_loops=R).logits.flatten(0, 1), targets.flatten(), ignore_index=-100
    )
    assert table[0.0]["loss"] == pytest.approx(ref.item(), rel=1e-5)
    assert table[0.0]["mean_steps"] == R


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError, match="accepted values are update, kl"):
        adaptive_forward(small_model(), _idx(), 0.1, "entropy")
    with pytest.raises(ConfigError, match="has no loop"):
        adaptive_forward(small_model(layout="4", variant="dense"), _idx(), 0.1)
    with pytest.raises(ConfigError, match="does not apply to MoR"):
        adaptive_forward(build_model(get_preset("micro-mor")), _idx(), 0.1)
    with pytest.raises(ConfigError, match="comma-separated numbers"):
        parse_thresholds("0.1,abc")


def test_grt_eval_reports_the_adaptive_curve(grt_run, manifest, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = eval_main(
        [
            str(grt_run / "checkpoints"),
            "--tasks",
            "val",
            "--data",
            str(manifest),
            "--max-batches",
            "2",
            "--adaptive-exit",
            "update",
            "--exit-thresholds",
            "1e9,0.05,0",
            "--json-out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    ad = res["adaptive_exit"]["by_threshold"]
    assert ad["1000000000.0"]["mean_steps"] == 1 and ad["0.0"]["mean_steps"] == res["trained_loops"]
    # the two ends of the curve are the fixed depths 1 and R of the same run
    assert ad["1000000000.0"]["loss"] == pytest.approx(res["val"]["1"]["loss"], rel=1e-5)
    assert ad["0.0"]["loss"] == pytest.approx(res["val"][str(res["trained_loops"])]["loss"], rel=1e-5)
    assert 1 <= ad["0.05"]["mean_steps"] <= res["trained_loops"]
    assert "adaptive exit (update" in capsys.readouterr().out


# -- adaptive exit at decode, through the KV cache --------------------------------------------
def _decode(model, prompts, new_tokens, strategy, threshold, rule="update"):
    from pretrain.infer.kv_cache import CachedDecoder

    dec = CachedDecoder(
        model,
        batch=prompts.shape[0],
        max_len=prompts.shape[1] + new_tokens.shape[1],
        strategy=strategy,
        exit_threshold=threshold,
        exit_rule=rule,
    )
    logits = [dec.forward(prompts)]
    for i in range(new_tokens.shape[1]):
        logits.append(dec.forward(new_tokens[:, i : i + 1]))
    return torch.stack(logits, 1), dec


@pytest.mark.parametrize("rule", ["update", "kl"])
@pytest.mark.parametrize("strategy", ["full", "first", "last", "average"])
def test_decode_extreme_thresholds_are_the_fixed_depth_decoders(strategy, rule):
    model = small_model(layout="1+2x4+1")
    prompts, new = _idx(3, b=2, t=6), _idx(4, b=2, t=5)
    fixed, _ = _decode(model, prompts, new, strategy, None)
    adaptive, dec = _decode(model, prompts, new, strategy, 0.0, rule)
    torch.testing.assert_close(adaptive, fixed, rtol=0, atol=1e-5)
    assert dec.decoded_tokens == 2 * 5 and dec.decoded_steps == 2 * 5 * 4
    _, dec = _decode(model, prompts, new, strategy, float("inf"), rule)  # every new token runs one step
    assert dec.decoded_steps == dec.decoded_tokens == 2 * 5


@pytest.mark.parametrize("rule", ["update", "kl"])
@pytest.mark.parametrize("strategy", ["full", "first", "last", "average"])
def test_decode_exits_early_and_a_token_does_not_depend_on_its_batch(strategy, rule):
    model = small_model(layout="1+2x6+1")
    prompts, new = _idx(5, b=3, t=6), _idx(6, b=3, t=6)
    thr = _median_first_change(model, new, rule)
    together, dec = _decode(model, prompts, new, strategy, thr, rule)
    assert 1 <= dec.decoded_steps / dec.decoded_tokens < 6  # some tokens left the loop early
    for b in range(3):  # each row alone: the same logits (exited tokens' cache entries follow the rule)
        alone, _ = _decode(model, prompts[b : b + 1], new[b : b + 1], strategy, thr, rule)
        torch.testing.assert_close(alone[0], together[b], rtol=0, atol=2e-5)


def test_generate_reports_mean_loop_steps_and_refuses_no_cache():
    from pretrain.infer.generate import generate

    model = small_model(layout="1+2x6+1")
    stats = {}
    out = generate(model, _idx(7, b=2, t=4), 6, strategy="average", exit_threshold=1e9, greedy=True, stats=stats)
    assert out.shape == (2, 6) and stats["mean_loop_steps"] == 1.0
    with pytest.raises(ConfigError, match="drop --no-cache"):
        generate(model, _idx(7, b=1, t=4), 2, use_cache=False, exit_threshold=0.1)
