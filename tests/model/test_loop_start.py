"""The loop's start switches (ModelConfig.proj_init, state_noise_scale, gate_bias_init): what a
loop step is at initialisation under each, and that the paper's presets keep the paper's start."""

from __future__ import annotations

import pytest
import torch

from grt_common.errors import ConfigError
from pretrain.model import build_model
from pretrain.model.gpt import LoopStep
from pretrain.model.layers import AttentionContext
from pretrain.presets import PRESETS, get_preset


def micro(**changes):
    return build_model(get_preset("micro-grt").replace(**changes))


def test_a_residual_start_projects_the_state_unchanged_and_ignores_the_anchor_at_first():
    model = micro(proj_init="residual")
    loop = model.loop
    assert isinstance(loop, LoopStep)
    s, e = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    assert torch.equal(loop.project(s, loop.anchor_terms(e)), s)
    # the anchor half is zero at the start, not frozen: it takes a gradient
    loop.project(s, loop.anchor_terms(e)).sum().backward()
    assert loop.anchor.proj is not None and loop.anchor.proj.weight.grad is not None
    assert loop.anchor.proj.weight.grad.abs().sum() > 0


def test_a_random_start_is_the_papers():
    loop = micro(proj_init="random").loop
    assert isinstance(loop, LoopStep) and loop.proj_state is not None
    w = loop.proj_state.weight.detach()
    assert abs(float(w.std()) - 0.02) < 0.004 and float(torch.diagonal(w).mean()) < 0.01


def test_relative_state_noise_scales_with_the_state():
    """The noise reaching the core is state_noise_std times each token's state RMS: a state 100x
    larger gets 100x the noise (absolute noise: the same)."""

    def noise_rms(model, scale: float) -> float:
        loop = model.loop
        assert isinstance(loop, LoopStep)
        loop.train()
        seen = []
        handle = loop.core[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
        s = torch.randn(4, 16, 32) * scale
        clean = loop.project(s, loop.anchor_terms(s)).detach()
        torch.manual_seed(0)
        loop(s, s, AttentionContext())
        handle.remove()
        return float((seen[0] - clean).pow(2).mean().sqrt())

    relative = micro(proj_init="residual", state_noise_scale="relative", state_noise_std=0.1)
    absolute = micro(proj_init="residual", state_noise_scale="absolute", state_noise_std=0.1)
    assert noise_rms(relative, 0.03) == pytest.approx(0.1 * 0.03, rel=0.1)
    assert noise_rms(relative, 3.0) == pytest.approx(0.1 * 3.0, rel=0.1)
    assert noise_rms(absolute, 0.03) == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize("key,value", [("proj_init", "identity"), ("state_noise_scale", "rms")])
def test_an_unknown_start_is_refused_naming_the_setting(key, value):
    with pytest.raises(ConfigError, match=f"{key}='{value}': accepted values are"):
        get_preset("micro-grt").replace(**{key: value})


@pytest.mark.parametrize("name", ["grt-small", "grt-medium", "grt-large"])
def test_the_papers_presets_keep_the_papers_start(name):
    cfg = PRESETS[name]
    assert (cfg.proj_init, cfg.state_noise_scale, cfg.gate_bias_init) == ("random", "absolute", 4.0)


def test_a_residual_start_without_a_projection_is_refused():
    with pytest.raises(ConfigError, match="proj_init='residual' starts W_proj, which reinject_anchor=false"):
        get_preset("micro-grt").replace(proj_init="residual", reinject_anchor=False)
