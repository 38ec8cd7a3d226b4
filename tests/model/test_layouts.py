"""Where the loop sits (issue 31, item 1): the whole stack `CxR`, the middle `P+CxR+K`, the
bottom `0+CxR+K` (no prelude) and the top `P+CxR+0` (no coda). Their notation and canonical
form, build and backward, FLOPs, KV-cache decoding, adaptive exit, the place-* presets and the
Hugging Face export."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from trained_models import (  # noqa: F401 (single_thread: an autouse fixture)
    assert_extreme_thresholds_are_fixed_depths,
    single_thread,
    small_model,
)

from grt_common.errors import ConfigError
from pretrain.infer.generate import generate
from pretrain.infer.kv_cache import STRATEGIES, CachedDecoder, cache_slots
from pretrain.model.flops import flops_per_token
from pretrain.model_config import PLACEMENTS, ModelConfig, canonical_layout, parse_layout
from pretrain.presets import PRESETS
from pretrain.tools.compare.sizing import match
from pretrain.tools.compare.table import describe_method

R = 3
# one small layout per placement, 8 blocks deep (the middle one is the tests' usual 1+2x3+1)
LAYOUTS = {"whole": "2x3", "middle": "1+2x3+1", "bottom": "0+2x3+2", "top": "2+2x3+0"}
METHOD_NAMES = {
    "whole": "GRT (whole stack looped)",
    "middle": "GRT",
    "bottom": "GRT (bottom loop)",
    "top": "GRT (top loop)",
}


def _idx(seed=0, b=2, t=12):
    return torch.randint(1, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def lively(layout):
    """A random model with large weights and a gate that writes: varied greedy tokens."""
    return small_model(layout, init_std=0.3)


# -- notation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,canonical,placement",
    [
        ("12", "12", "dense"),
        ("2x3", "2x3", "whole"),
        ("0+2x3+0", "2x3", "whole"),
        ("1+2x3+1", "1+2x3+1", "middle"),
        ("2x3+2", "0+2x3+2", "bottom"),
        ("0+2x3+2", "0+2x3+2", "bottom"),
        (" 2 X 3 + 2 ", "0+2x3+2", "bottom"),
        ("2+2x3", "2+2x3+0", "top"),
        ("2+2x3+0", "2+2x3+0", "top"),
        ("2+2×3", "2+2x3+0", "top"),
    ],
)
def test_each_form_parses_to_its_canonical_form(text, canonical, placement):
    layout = parse_layout(text)
    assert str(layout) == canonical_layout(text) == canonical and layout.placement == placement
    assert parse_layout(canonical) == layout  # the canonical form reads back as the same layout
    if placement != "dense":
        cfg = ModelConfig(layout=text, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16)
        assert cfg.layout == canonical  # what configs store
        assert json.loads(json.dumps(cfg.to_dict()))["layout"] == canonical
        assert cfg.replace(layout=text).layout == canonical


@pytest.mark.parametrize(
    "text,why",
    [
        ("0", "a dense layout needs at least 1 block"),
        ("0x3+2", "core must be at least 1"),
        ("2+2x0", "loops must be at least 1"),
        ("0x0", "core and loops must be at least 1"),
        ("+2x3", "does not parse"),
        ("2x3+", "does not parse"),
        ("1+2+2x3", "does not parse"),
        ("1+2x3+1+1", "does not parse"),
        ("x3+1", "does not parse"),
        ("-1+2x3", "does not parse"),
        ("2*3+1", "does not parse"),
    ],
)
def test_bad_layouts_are_refused_in_one_line(text, why):
    with pytest.raises(ConfigError) as err:
        parse_layout(text)
    message = str(err.value)
    assert repr(text) in message and why in message and "\n" not in message
    assert "'CxR+K' or '0+CxR+K' (bottom" in message and "'P+CxR' or 'P+CxR+0' (top" in message


def test_an_override_is_stored_canonical_and_compare_keeps_the_placement():
    from pretrain.runs.config_layers import apply_overrides
    from pretrain.runs.run_config import RunConfig

    cfg = RunConfig()
    apply_overrides(cfg, ["model.layout=2x3+2", "model.d_model=32", "model.n_heads=2"])
    assert cfg.model.layout == "0+2x3+2"
    # --match flops changes R only: the bottom preset stays a bottom layout
    bottom = PRESETS["place-bottom"]
    matched = match(bottom, flops_per_token(PRESETS["place-middle"].replace(layout="2+2x6+2")), "flops", 256)
    assert matched.layout == "0+2x6+4"


# -- build, forward, backward -----------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_placement_builds_trains_and_keeps_the_invariants(placement):
    model = small_model(LAYOUTS[placement]).train()
    layout = model.cfg.parsed_layout
    assert (len(model.prelude), len(model.coda)) == (layout.prelude, layout.coda)
    idx = _idx(1, b=2, t=16)
    for depth in (0, R):  # depth 0 touches the loop with a zero-weighted step
        model.zero_grad()
        loss = model(idx, idx, n_loops=depth).loss
        assert loss is not None and torch.isfinite(loss)
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not missing, (depth, missing)
    model.eval()
    with torch.no_grad():
        # the anchor: the prelude output, which without a prelude is the embeddings themselves
        prelude = model(idx, return_states=True)
        embeddings = model(idx, anchor="embeddings")
        assert torch.equal(prelude.states[0], model.embed(idx).float()) == (layout.prelude == 0)
        assert torch.equal(prelude.logits, embeddings.logits) == (layout.prelude == 0)
        # a gate forced to 1 is depth 0 bit for bit, with or without a prelude or coda
        assert torch.equal(model(idx, gate_override=1.0).logits, model(idx, n_loops=0).logits)
    assert describe_method(model.cfg) == METHOD_NAMES[placement]  # grt compare's method column


def test_the_placement_presets_have_equal_flops_and_depth():
    cfgs = {p: PRESETS[f"place-{p}"] for p in PLACEMENTS}
    assert {p: c.parsed_layout.placement for p, c in cfgs.items()} == {p: p for p in PLACEMENTS}
    assert len({(c.d_model, c.n_heads, c.parsed_layout.effective_depth(), c.max_loops) for c in cfgs.values()}) == 1
    for executed in (False, True):
        assert len({flops_per_token(c, executed=executed) for c in cfgs.values()}) == 1


@pytest.mark.parametrize("variant", ["huginn", "rrt", "ouro", "mor"])
def test_the_baselines_take_the_bottom_and_top_placements(variant):
    """The baselines share the P+CxR+K skeleton: without a prelude or a coda they build, train
    and count their FLOPs as the counter does (MoR's capacities round to whole tokens)."""
    from pretrain.model import build_model

    for layout in ("0+1x3+1", "1+1x3+0"):
        cfg = PRESETS[f"micro-{variant}"].replace(layout=layout, attention="naive")
        model = build_model(cfg).train()
        idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(idx, idx).loss
        assert loss is not None and torch.isfinite(loss)
        loss.backward()
        model.eval()
        with FlopCounterMode(display=False) as counter:
            model(idx)
        counted, formula = counter.get_total_flops(), flops_per_token(cfg, seq_len=16, executed=True) * 2 * 16
        assert abs(counted - formula) <= (0.05 * formula if variant == "mor" else 0), (layout, counted, formula)


# -- FLOPs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_flops_match_pytorchs_flop_counter(placement):
    cfg = small_model(LAYOUTS[placement]).cfg.replace(attention="naive")  # the counter sees naive attention
    from pretrain.model import build_model

    model = build_model(cfg).eval()
    b, t = 2, 32
    layout, d, v = cfg.parsed_layout, cfg.d_model, cfg.padded_vocab_size
    spec = layout.effective_depth() * (24 * d * d + 4 * t * d) + R * 10 * d * d + 2 * d * v  # the spec's formula
    assert flops_per_token(cfg, seq_len=t) == spec
    for n in (0, 1, R):
        with FlopCounterMode(display=False) as counter:
            model(_idx(2, b, t), n_loops=n)
        assert counter.get_total_flops() == flops_per_token(cfg, seq_len=t, n_loops=n, executed=True) * b * t, n


# -- KV cache ---------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_kv_cache_decodes_as_the_full_forward(placement):
    model = lively(LAYOUTS[placement])
    layout = model.cfg.parsed_layout
    idx = _idx(3)
    for depth in (0, 1, R):  # the exact strategy: the uncached model, token for token
        ref = generate(model, idx, 8, use_cache=False, greedy=True, n_loops=depth, return_logits=True)
        got = generate(model, idx, 8, strategy="full", greedy=True, n_loops=depth, return_logits=True)
        assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5), depth
    assert len(set(ref[0][0].tolist())) > 1  # not a constant sequence
    nxt = model(idx).logits[:, -1].argmax(-1)[:, None]
    for strategy in STRATEGIES:
        core_slots = layout.core * (R if strategy == "full" else 1)
        assert cache_slots(model, strategy, R) == layout.prelude + core_slots + layout.coda
        dec = CachedDecoder(model, batch=2, max_len=20, strategy=strategy)
        assert torch.allclose(dec.forward(idx), model(idx).logits[:, -1], atol=1e-5), strategy  # prefill: exact
        after = dec.forward(nxt)
        assert torch.isfinite(after).all()
        if strategy == "full":
            assert torch.allclose(after, model(torch.cat([idx, nxt], 1)).logits[:, -1], atol=1e-5)
        one = CachedDecoder(model, batch=2, max_len=20, strategy=strategy, n_loops=1)  # one step: every cache exact
        one.forward(idx)
        exact = model(torch.cat([idx, nxt], 1), n_loops=1).logits[:, -1]
        assert torch.allclose(one.forward(nxt), exact, atol=1e-5), strategy


# -- adaptive exit ----------------------------------------------------------------------------
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_adaptive_exit_runs_for_each_placement(placement):
    model = small_model(LAYOUTS[placement])
    idx = _idx(4, t=16)
    for criterion in ("update", "kl"):  # the extreme thresholds are the fixed depths R and 1
        assert_extreme_thresholds_are_fixed_depths(model, idx, criterion, R)
    prompts, new = _idx(5, t=6), _idx(6, t=4)
    for strategy, rule in (("full", "update"), ("average", "kl")):  # at decode, through the KV cache
        fixed = CachedDecoder(model, batch=2, max_len=10, strategy=strategy)
        adaptive = CachedDecoder(model, batch=2, max_len=10, strategy=strategy, exit_threshold=0.0, exit_rule=rule)
        torch.testing.assert_close(adaptive.forward(prompts), fixed.forward(prompts), rtol=0, atol=1e-5)
        for i in range(new.shape[1]):
            tok = new[:, i : i + 1]
            torch.testing.assert_close(adaptive.forward(tok), fixed.forward(tok), rtol=0, atol=1e-5)
        assert adaptive.decoded_steps == R * adaptive.decoded_tokens == R * 2 * 4
        stats = {}
        generate(model, prompts, 3, strategy=strategy, exit_threshold=1e9, exit_rule=rule, greedy=True, stats=stats)
        assert stats["mean_loop_steps"] == 1.0


# -- Hugging Face -----------------------------------------------------------------------------
def test_bottom_and_top_placements_export_to_hugging_face(tmp_path, offline):
    """The remote code vendors pretrain/model_config.py, so it parses the same layouts: the export of a
    model without a prelude, and of one without a coda, loads with the same logits and generates
    through its KV cache as without one."""
    from transformers import AutoModelForCausalLM

    from pretrain.model.hf import save_pretrained

    idx = _idx(7, b=1, t=6)
    for placement in ("bottom", "top"):
        ours = lively(LAYOUTS[placement])
        save_pretrained(ours, tmp_path / placement)
        saved = json.loads((tmp_path / placement / "config.json").read_text())
        assert (saved["layout"], saved["trained_depth"]) == (LAYOUTS[placement], R)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / placement), trust_remote_code=True).eval()
        with torch.no_grad():
            assert (ours(idx).logits - hf(idx).logits).abs().max().item() < 1e-5
            cached = hf.generate(idx, max_new_tokens=5, do_sample=False)
            assert torch.equal(cached, hf.generate(idx, max_new_tokens=5, do_sample=False, use_cache=False))
            assert torch.equal(cached[:, 6:], generate(ours, idx, 5, use_cache=False, greedy=True))
