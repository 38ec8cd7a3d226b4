"""Keys and values computed once outside the core (issue 31, item 2; CART in
../shared/seeds/004): under core_kv='anchor' every core block attends, at every loop step, to
keys and values of the anchor e (the prelude output, the state each step is fed), computed once
per forward through that block's own ln_1 and key/value projection. Its FLOPs, its decode
(exact with one cache per core block, whatever the strategy), its refusals, its training under
ZeRO-3 and its Hugging Face export."""

import pytest
import torch
from trained_models import single_thread, small_model, train  # noqa: F401 (single_thread: an autouse fixture)

from grt_common.errors import ConfigError
from pretrain.infer.generate import generate
from pretrain.infer.kv_cache import STRATEGIES, CachedDecoder, cache_slots, cache_strategy
from pretrain.model.flops import flops_per_token
from pretrain.model.layers import AttentionContext
from pretrain.model_config import ModelConfig
from pretrain.presets import PRESETS

R = 3


def _idx(seed=0, b=2, t=10):
    return torch.randint(1, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def anchored(layout="1+2x3+1"):
    return small_model(layout, init_std=0.3, core_kv="anchor")


class Recorder:
    """An attention context's `kv`: records each call's keys and values, attends causally."""

    def __init__(self):
        self.calls = []

    def attend(self, q, k, v):
        self.calls.append((k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@torch.no_grad()
def test_every_loop_step_attends_to_the_keys_and_values_of_the_anchor():
    model = anchored()
    rec = Recorder()
    ctx = AttentionContext(kv=rec)
    e = model.run_prelude(model.embed(_idx()), ctx)
    model.run_loop(e, ctx, R)
    layout = model.cfg.parsed_layout
    core_calls = rec.calls[layout.prelude :]
    assert len(core_calls) == R * layout.core
    for step in range(R):
        for b, block in enumerate(model.loop.core):
            k, v = core_calls[step * layout.core + b]
            want_k, want_v = block.anchor_kv(e)  # the block's ln_1 and key/value projection applied to e
            assert torch.equal(k, want_k) and torch.equal(v, want_v), (step, b)
    # the ordinary GRT's keys move with the state: its steps attend to different keys
    plain = small_model("1+2x3+1", init_std=0.3)
    rec = Recorder()
    ctx = AttentionContext(kv=rec)
    plain.run_loop(plain.run_prelude(plain.embed(_idx()), ctx), ctx, R)
    first, second = rec.calls[layout.prelude], rec.calls[layout.prelude + layout.core]
    assert not torch.allclose(first[0], second[0])


def test_the_switch_keeps_the_weights_and_removes_the_per_step_key_value_projections():
    base = PRESETS["tiny-grt"]
    cart = PRESETS["tiny-grt-anchor-kv"]
    assert cart.replace(name=base.name, core_kv="step") == base
    d, c = base.d_model, base.parsed_layout.core
    for executed in (False, True):
        for n in (1, 2, 4):
            saved = flops_per_token(base, 256, n, executed) - flops_per_token(cart, 256, n, executed)
            assert saved == 4 * d * d * c * (n - 1), (executed, n)  # k and v (2 d^2 each) once, not n times
    a, b = small_model(core_kv="anchor"), small_model()
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in b.parameters())


@pytest.mark.parametrize("layout", ["1+2x3+1", "0+2x3+2", "2x3"])
def test_every_strategy_decodes_exactly_with_one_cache_per_core_block(layout):
    model = anchored(layout)
    parsed = model.cfg.parsed_layout
    idx = _idx(3)
    ref = generate(model, idx, 6, use_cache=False, greedy=True, return_logits=True)
    assert len(set(ref[0][0].tolist())) > 1  # not a constant sequence
    for strategy in STRATEGIES:
        assert cache_strategy(model, strategy) == "anchor"
        assert cache_slots(model, strategy, R) == parsed.prelude + parsed.core + parsed.coda
        got = generate(model, idx, 6, strategy=strategy, greedy=True, return_logits=True)
        assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5), strategy
        dec = CachedDecoder(model, batch=2, max_len=16, strategy=strategy, exit_threshold=0.0)  # adaptive exit too
        dec.forward(idx)
        nxt = ref[0][:, :1]  # the first generated token
        want = model(torch.cat([idx, nxt], 1)).logits[:, -1]
        assert torch.allclose(dec.forward(nxt), want, atol=1e-5), strategy
    # the ordinary GRT's shared caches are an approximation: its `first` cache is not the model
    plain = small_model(layout, init_std=0.3)
    exact = generate(plain, idx, 6, use_cache=False, greedy=True, return_logits=True)[1]
    shared = generate(plain, idx, 6, strategy="first", greedy=True, return_logits=True)[1]
    assert not torch.allclose(shared, exact, atol=1e-3)


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(core_kv="once"), "core_kv='once': accepted values are step, anchor"),
        (dict(variant="dense", layout="4", core_kv="anchor"), "core_kv='anchor': variant='dense'"),
        (
            dict(variant="rrt", gate=False, state_noise_std=0.0, reinject_anchor=False, core_kv="anchor"),
            "variant='rrt'",
        ),
    ],
)
def test_bad_core_kv_is_refused_in_one_line(kw, why):
    with pytest.raises(ConfigError, match=why.replace("(", r"\(")) as err:
        ModelConfig(**{"layout": "1+2x3+1", **kw})
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_trained_under_zero3_its_checkpoint_decodes_as_its_forward(tmp_path):
    from pretrain.infer.load import load_model

    run = train("micro-grt-anchor-kv", 20)
    model = load_model(run).model
    assert model.cfg.core_kv == "anchor"
    idx = _idx(4, t=12)
    exact = generate(model, idx, 6, use_cache=False, greedy=True, return_logits=True)
    cached = generate(model, idx, 6, strategy="average", greedy=True, return_logits=True)
    assert torch.equal(cached[0], exact[0]) and torch.allclose(cached[1], exact[1], atol=1e-5)


def test_exports_to_hugging_face_with_the_same_logits(tmp_path, offline):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from pretrain.model.hf import save_pretrained

    ours = anchored()
    save_pretrained(ours, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    idx = _idx(7, b=1, t=6)
    with torch.no_grad():
        assert (ours(idx).logits - hf(idx).logits).abs().max().item() < 1e-5
        cached = hf.generate(idx, max_new_tokens=5, do_sample=False)
        assert torch.equal(cached, hf.generate(idx, max_new_tokens=5, do_sample=False, use_cache=False))
