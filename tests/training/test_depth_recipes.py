"""Depth recipes of looped models (docs/training.md, "Depth recipes"): truncated backprop through the
last k loop steps of a GRT (model.extra.backprop_steps, Huginn's setting), the heavy-tail Poisson whose
mean and cap follow the model's R (train.depth_sampling=poisson), and a deepest depth that grows over
training (train.depth_schedule=grow). Each switch is shown to change what it claims."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from multiproc import REPO, run_ranks

from grt_common.errors import ConfigError
from pretrain.model import build_model
from pretrain.model.baselines import noise_off
from pretrain.presets import get_preset
from pretrain.runs.settings_rules import start_notes
from pretrain.runs.train_config import TrainConfig
from pretrain.train import build_parser, config_from_args
from pretrain.training.depth import depth_for_step, max_depth
from pretrain.training.engine.parallelize import apply_activation_checkpointing


def grt(k: int = 0, layout: str = "1+1x4+1"):
    cfg = get_preset("micro-grt").replace(layout=layout, extra={"backprop_steps": k} if k else {})
    return noise_off(cfg)


def batch(cfg, b=2, t=32):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (b, t), generator=g)


def grads_and_saved_bytes(model, x, n):
    """The parameters' gradients of one training forward and backward at depth n, and the bytes
    autograd kept for the backward (the activation memory)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x, n_loops=n, return_logits=False).loss
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, sum(saved)


# -- truncated backprop ----------------------------------------------------------------------------
def test_grt_backprop_through_the_last_k_steps_keeps_activations_of_k_steps():
    full_cfg = grt()
    torch.manual_seed(0)
    full = build_model(full_cfg).train()
    x = batch(full_cfg)
    reference, full_bytes = grads_and_saved_bytes(full, x, 4)
    kept = {}
    for k in (1, 2, 4):
        model = build_model(grt(k)).train()
        model.load_state_dict(full.state_dict())
        grads, kept[k] = grads_and_saved_bytes(model, x, 4)
        out = model(x, x, n_loops=4, return_states=True)
        # s_0 = e carries the prelude's graph; the steps before the last k carry none
        assert [s.requires_grad for s in out.states] == [True] + [r > 4 - k for r in range(1, 5)]
        differs = [n for n in grads if not torch.equal(grads[n], reference[n])]
        if k == 4:  # k >= depth: every step differentiated, the full gradient
            assert differs == [] and kept[k] == full_bytes
        else:
            assert "loop.core.0.attn.c_attn.weight" in differs and "wte.weight" in differs
            assert all(g.abs().sum() > 0 for n, g in grads.items() if n.startswith("loop.core"))
        model.eval()  # evaluation is not truncated: the same function as the full model
        with torch.no_grad():
            assert torch.equal(model(x, x, n_loops=4).loss, full.eval()(x, x, n_loops=4).loss)
        full.train()
    # an untracked step keeps nothing: the bytes kept grow by one step's with each step of k
    per_step = kept[2] - kept[1]
    assert per_step > 0 and kept[4] - kept[2] == pytest.approx(2 * per_step, rel=0.05)
    assert build_model(grt(2)).train()(x, x, n_loops=0).loss.requires_grad  # depth 0: the touch, no error


@pytest.mark.parametrize("mode", ["loop_step", "selective"])
def test_truncated_backprop_composes_with_activation_checkpointing(mode):
    cfg = grt(1)
    torch.manual_seed(0)
    plain = build_model(cfg).train()
    checkpointed = apply_activation_checkpointing(build_model(cfg).train(), mode)
    checkpointed.load_state_dict(plain.state_dict())
    x = batch(cfg)
    expected, _ = grads_and_saved_bytes(plain, x, 3)
    grads, _ = grads_and_saved_bytes(checkpointed, x, 3)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_backprop_steps_is_checked_and_counted_by_the_memory_estimate_and_the_flops():
    from pretrain.model.flops import flops_per_token, train_flops_per_token
    from pretrain.training.engine.parallelize import activation_bytes

    with pytest.raises(ConfigError, match="extra.backprop_steps=-1"):
        grt(-1)
    assert activation_bytes(grt(1), 512, 4, "off", 2) < activation_bytes(grt(), 512, 4, "off", 2)
    assert flops_per_token(grt(1), 32, 4) == flops_per_token(grt(), 32, 4)  # the forward runs every step
    train = [train_flops_per_token(grt(k), 32, 4) for k in (1, 2, 0)]  # a step without autograd: its forward
    assert train[0] < train[1] < train[2]


@pytest.mark.slow
def test_truncated_backprop_gradients_under_zero3_equal_the_reference(tmp_path):
    """Real DeepSpeed ZeRO-3 on 2 ranks (the loop's parameters gathered and reduced across a
    segment run without autograd), loop_step checkpointing, gradient accumulation 2, depths
    3, 1, 0, 2 with k = 1: the full gradients equal a single-process reference's."""
    report_path = tmp_path / "report.json"
    script = str(REPO / "tests" / "dist_scripts" / "grad_check.py")
    results = run_ranks([script, "3", "micro-grt:backprop_steps=1", str(report_path), "3,1,0,2"], world=2, timeout=300)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    report = json.loads(report_path.read_text())
    assert [s["depth"] for s in report["steps"]] == [3, 1, 0, 2]
    for step in report["steps"]:
        for name, g in step["grads"].items():
            assert g["max_abs_diff"] <= 1e-5 + 1e-4 * g["ref_max"], (step["depth"], name, g)
        assert step["unused_with_nonzero_grad"] == []


# -- the heavy-tail Poisson at the model's R ----------------------------------------------------------
@pytest.mark.parametrize("r", [3, 4, 8])
def test_poisson_follows_the_models_r_and_leans_deep(r):
    t = TrainConfig(depth_sampling="poisson")
    draws = Counter(depth_for_step(t, r, s) for s in range(3000))
    assert set(draws) == set(range(1, r + 1)) and max_depth(t, r) == r  # validation sees every depth drawn
    assert draws[r] > draws[1] and draws[r] == max(draws.values())  # deep steps most
    assert sum(k * v for k, v in draws.items()) / 3000 > (r + 1) / 2  # deeper than uniform's mean
    deeper = TrainConfig(depth_sampling="poisson", max_train_depth=2 * r)
    assert max(depth_for_step(deeper, r, s) for s in range(3000)) == max_depth(deeper, r) == 2 * r


def config(*sets, preset="micro-grt"):
    args = ["--preset", preset, "--data", "manifest.json"]
    return config_from_args(build_parser().parse_args([*args, *(x for s in sets for x in ("--set", s))]))


def test_a_poisson_mean_that_cannot_hold_is_refused_in_one_line_and_a_default_is_not():
    for sets in [("train.poisson_mean=32",), ("train.poisson_mean=3", "train.max_train_depth=2")]:
        with pytest.raises(ConfigError, match=r"^train.poisson_mean=\d+(\.0)?: the mean depth .* deeper") as err:
            config("train.depth_sampling=poisson", *sets)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^train.poisson_mean=0"):
        config("train.depth_sampling=poisson", "train.poisson_mean=0")
    cfg = config("train.depth_sampling=poisson")  # micro-grt: R = 3; the mean follows it, and says so
    assert cfg.train.poisson_mean == 0 and any(
        "train.poisson_mean: 2, from the model's depth 3" in n for n in start_notes(cfg)
    )
    assert config("train.depth_sampling=poisson", "train.poisson_mean=2").train.poisson_mean == 2
    # Huginn's recipe sets its own mean (not given): a shallower cap than it wants is kept, and said
    cfg = config("train.max_train_depth=1", preset="micro-huginn")
    assert any("not set here" in n for n in start_notes(cfg))


# -- a deepest depth that grows -----------------------------------------------------------------------
def test_grow_raises_the_deepest_depth_from_1_to_r_over_the_warmup():
    t = TrainConfig(depth_schedule="grow", depth_warmup=0.5, steps=400, seed=3)
    depths = [depth_for_step(t, 4, s) for s in range(400)]
    assert depths == [depth_for_step(t, 4, s) for s in range(400)]  # a function of (seed, step)
    stages = [max(depths[i : i + 50]) for i in range(0, 200, 50)]
    assert stages == [1, 2, 3, 4] and set(depths[200:]) == {1, 2, 3, 4}
    fixed = TrainConfig(depth_schedule="grow", depth_sampling="fixed", depth_warmup=0.5, steps=400)
    assert [depth_for_step(fixed, 4, s) for s in (0, 49, 50, 199, 200)] == [1, 1, 2, 4, 4]
    assert depths != [depth_for_step(TrainConfig(steps=400, seed=3), 4, s) for s in range(400)]
    with pytest.raises(ConfigError, match="^train.depth_warmup=0.5 needs train.depth_schedule=grow"):
        config("train.depth_warmup=0.5")
    with pytest.raises(ConfigError, match="^train.depth_schedule='shrink'"):
        config("train.depth_schedule=shrink")
