"""The GRT and dense models: the spec's invariants, HF parity, presets, FLOPs."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from grt_common.errors import ConfigError
from pretrain.model import build_model
from pretrain.model.flops import count_params, flops_per_token
from pretrain.model.layers import AttentionContext, attention
from pretrain.model_config import ModelConfig, parse_layout
from pretrain.presets import ADVERTISED_PARAMS, PRESETS, describe
from pretrain.presets import main as presets_main
from pretrain.training.engine.parallelize import apply_activation_checkpointing


def small_cfg(**kw):
    base = dict(layout="1+2x3+1", d_model=64, n_heads=4, vocab_size=211, max_seq_len=64, pad_vocab_multiple=64)
    return ModelConfig(**{**base, **kw})


def tokens(b=2, t=24, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


# -- layout and config -----------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [("1+5x6+5", (1, 5, 6, 5)), ("12", (12, 0, 0, 0)), ("12x4", (0, 12, 4, 0)), (" 2 + 5x4 + 2 ", (2, 5, 4, 2))],
)
def test_layout_parses(text, expected):
    layout = parse_layout(text)
    assert (layout.prelude, layout.core, layout.loops, layout.coda) == expected


@pytest.mark.parametrize(
    "text,why",
    [
        ("0", "a dense layout needs at least 1 block"),
        ("1+5x0+5", "loops must be at least 1"),
        ("1+0x6+5", "core must be at least 1"),
        ("1+5x6+5+1", "does not parse"),  # bottom and top placements: tests/model/test_layouts.py
        ("banana", "does not parse"),
        ("1+5*6+5", "does not parse"),
    ],
)
def test_bad_layout_is_quoted_and_explained(text, why):
    with pytest.raises(ConfigError) as err:
        parse_layout(text)
    assert repr(text) in str(err.value) and why in str(err.value)


def test_config_round_trips_through_json(tmp_path):
    cfg = small_cfg(gate=False, state_noise_std=0.0)
    cfg.save(tmp_path / "model.json")
    assert ModelConfig.load(tmp_path / "model.json") == cfg
    assert json.loads((tmp_path / "model.json").read_text())["layout"] == "1+2x3+1"


def test_config_rejects_unknown_keys_and_wrong_types():
    with pytest.raises(ConfigError, match="unknown key.*d_modle"):
        ModelConfig.from_dict({"d_modle": 64})
    with pytest.raises(ConfigError, match="gate=.*expected true or false"):
        ModelConfig.from_dict({"gate": 3})
    with pytest.raises(ConfigError, match="variant='dense' needs a dense layout"):
        ModelConfig(variant="dense", layout="1+2x3+1")


# -- presets and FLOPs -------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta_with_its_advertised_count(name):
    with torch.device("meta"):
        model = build_model(PRESETS[name])
    assert count_params(model)["params"] == ADVERTISED_PARAMS[name]


def test_paper_parameter_counts():
    # dense-small trains with its vocabulary padded to 50,304 and exports GPT-2's 50,257 rows: 124,439,808
    assert ADVERTISED_PARAMS["dense-small"] == 124_439_808 + 47 * 768
    from transformers import GPT2LMHeadModel

    from pretrain.model.hf import hf_config

    with torch.device("meta"):
        exported = GPT2LMHeadModel(hf_config(PRESETS["dense-small"]))
    assert sum(p.numel() for p in exported.parameters()) == 124_439_808
    assert ADVERTISED_PARAMS["grt-large"] == 290_196_480
    assert ADVERTISED_PARAMS["grt-large-isoparams"] == 781_780_480


def test_presets_json_lists_required_fields(capsys):
    presets_main(["--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} == set(PRESETS)
    for row in rows:
        assert {
            "name",
            "layout",
            "d_model",
            "n_heads",
            "vocab_size",
            "params",
            "non_embedding_params",
            "flops_per_token",
        } <= set(row)
    small = next(r for r in rows if r["name"] == "dense-small")
    assert small["params"] == 124_475_904 and small["non_embedding_params"] == 124_475_904 - (50304 + 1024) * 768
    assert small["padded_vocab_size"] == 50304


@pytest.mark.parametrize(
    "kw", [dict(), dict(gate=False), dict(reinject_anchor=False, gate=False), dict(variant="dense", layout="4")]
)
def test_flops_formula_is_the_specs(kw):
    cfg = small_cfg(**kw)
    t = 32
    layout, d, v = cfg.parsed_layout, cfg.d_model, cfg.padded_vocab_size
    extra = layout.loops * ((4 if cfg.reinject_anchor else 0) + (6 if cfg.gate else 0)) * d * d
    spec = layout.effective_depth() * (24 * d * d + 4 * t * d) + extra + 2 * d * v  # the spec's formula
    assert flops_per_token(cfg, seq_len=t) == spec


FLOP_CONFIGS = {
    "grt": small_cfg(),
    "grt-no-gate": small_cfg(gate=False),
    "grt-anchor-kv": small_cfg(core_kv="anchor"),
    "grt-anchor-kv-no-gate": small_cfg(core_kv="anchor", gate=False, layout="0+2x3+1"),
    "loop-only": small_cfg(reinject_anchor=False, gate=False, state_noise_std=0.0),
    "dense": small_cfg(variant="dense", layout="4"),
    **{name: PRESETS[name] for name in ("ladder-0-loop-only", "micro-huginn", "micro-rrt", "micro-ouro", "micro-mor")},
}


@pytest.mark.parametrize("name", list(FLOP_CONFIGS))
def test_flops_match_pytorchs_flop_counter_for_every_variant_and_depth(name):
    cfg = FLOP_CONFIGS[name].replace(attention="naive")  # the counter sees naive attention's matmuls, not SDPA's kernel
    if name == "ladder-0-loop-only":  # the tiny ladder at micro width: the whole stack looped, no prelude
        cfg = cfg.replace(d_model=32, n_heads=2, vocab_size=512, max_seq_len=64)
    model = build_model(cfg).eval()
    b, t = 2, 32
    for n in sorted({0, 1, cfg.max_loops}) if cfg.parsed_layout.looped else [None]:
        with FlopCounterMode(display=False) as counter:
            model(tokens(b, t, vocab=cfg.vocab_size), n_loops=n)
        counted, formula = counter.get_total_flops(), flops_per_token(cfg, seq_len=t, n_loops=n, executed=True) * b * t
        if cfg.variant == "mor":  # capacities are rounded up to whole tokens
            assert abs(counted - formula) / formula < 0.05, (n, counted, formula)
        else:
            assert counted == formula, (n, counted, formula)


# -- the GRT loop ------------------------------------------------------------------
def test_gate_starts_near_0_98():
    cfg = PRESETS["grt-small"].replace(max_seq_len=64, layout="1+1x3+1")
    model = build_model(cfg).eval()
    out = model(tokens(2, 32, vocab=cfg.vocab_size), return_gates=True)
    mean_gate = torch.stack(out.gates).mean().item()
    assert abs(mean_gate - 0.98) <= 0.005


def test_gate_forced_to_one_is_exactly_prelude_to_coda():
    model = build_model(small_cfg()).eval()
    idx = tokens()
    prelude_only = model(idx, n_loops=0).logits
    forced = model(idx, gate_override=1.0).logits
    assert torch.equal(prelude_only, forced)
    assert not torch.allclose(model(idx).logits, prelude_only)


def test_gate_forced_to_zero_equals_the_ungated_model():
    gated = build_model(small_cfg()).eval()
    ungated = build_model(small_cfg(gate=False)).eval()
    missing, unexpected = ungated.load_state_dict(gated.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith(("loop.gate_", "loop.anchor.gate_")) for k in unexpected)
    idx = tokens()
    assert torch.equal(gated(idx, gate_override=0.0).logits, ungated(idx).logits)


def test_eval_is_deterministic_and_training_is_not():
    model = build_model(small_cfg())
    idx = tokens()
    model.eval()
    assert torch.equal(model(idx).logits, model(idx).logits)
    model.train()
    assert not torch.equal(model(idx).logits, model(idx).logits)
    noiseless = build_model(small_cfg(state_noise_std=0.0, gate_noise_std=0.0)).train()
    assert torch.equal(noiseless(idx).logits, noiseless(idx).logits)


def test_loop_depth_is_a_forward_argument():
    model = build_model(small_cfg()).eval()
    idx = tokens()
    out = model(idx, n_loops=5, return_states=True, return_gates=True)
    assert len(out.states) == 6 and len(out.gates) == 5
    losses = {n: model(idx, idx, n_loops=n).loss.item() for n in range(0, 5)}
    assert len(set(losses.values())) == 5
    with pytest.raises(ValueError, match="n_loops"):
        model(idx, n_loops=-1)


@pytest.mark.parametrize("anchor", ["zeros", "embeddings", "previous"])
def test_anchor_replacement_changes_the_function(anchor):
    model = build_model(small_cfg()).eval()
    idx = tokens()
    assert not torch.allclose(model(idx, anchor=anchor).logits, model(idx).logits)


@pytest.mark.parametrize("mode", ["selective", "loop_step", "block"])
def test_checkpointed_loop_steps_give_the_same_loss_and_gradients(mode):
    idx = tokens()
    torch.manual_seed(0)
    plain = build_model(small_cfg()).train()
    ckpt = build_model(small_cfg()).train()
    ckpt.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ckpt, mode)
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(1)  # same noise draws; non-reentrant checkpoint replays the RNG state
        loss = model(idx, idx).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)
    assert ckpt.state_dict().keys() == plain.state_dict().keys()


# -- attention ------------------------------------------------------------------------
def test_sdpa_equals_naive_attention_with_and_without_document_masks():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    for ctx in (AttentionContext(), AttentionContext(doc_ids=doc_ids)):
        torch.testing.assert_close(
            attention(q, k, v, ctx, "sdpa"), attention(q, k, v, ctx, "naive"), rtol=1e-5, atol=1e-6
        )


def test_the_varlen_segments_need_one_device_wait_not_two(monkeypatch):
    """flash-attn's packed-document path: cu_seqlens (one segment per row and document) and the
    row length as the longest segment's bound, with no host read of the device for it (`int()` of
    the maximum was a second sync per forward)."""
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 4, 4]])
    reads = []
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: reads.append(t) or 0)
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or 0)
    cu, max_len = AttentionContext(doc_ids=doc_ids).varlen()
    monkeypatch.undo()
    assert reads == [] and max_len == 6
    assert cu.tolist() == [0, 2, 5, 6, 10, 12] and cu.dtype == torch.int32


def test_document_mask_isolates_packed_documents():
    model = build_model(small_cfg()).eval()
    idx = tokens(1, 24)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14])
    changed = idx.clone()
    changed[0, :10] = (changed[0, :10] + 1) % 211
    a = model(idx, doc_ids=doc_ids).logits
    b = model(changed, doc_ids=doc_ids).logits
    torch.testing.assert_close(a[0, 10:], b[0, 10:])
    assert not torch.allclose(a[0, :10], b[0, :10])
    unmasked = model(changed).logits
    assert not torch.allclose(a[0, 10:], unmasked[0, 10:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn needs CUDA")
def test_flash_attn_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc_ids = torch.tensor([[0] * 50 + [1] * 78, [0] * 128], device="cuda")
    for ctx in (AttentionContext(), AttentionContext(doc_ids=doc_ids)):
        torch.testing.assert_close(
            attention(q, k, v, ctx, "flash_attn"), attention(q, k, v, ctx, "sdpa"), rtol=2e-2, atol=2e-2
        )


# -- Hugging Face parity ---------------------------------------------------------------
def test_dense_model_is_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    from pretrain.model.hf import from_hf, to_hf

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=301, n_positions=64, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
        )
    ).eval()
    idx = tokens(2, 40, vocab=301)
    ours = from_hf(hf).eval()
    reference = hf(idx).logits
    assert (ours(idx).logits - reference).abs().max().item() < 1e-4
    back = to_hf(ours).eval()
    assert (back(idx).logits - reference).abs().max().item() < 1e-4


def test_our_dense_model_converts_to_hugging_face():
    pytest.importorskip("transformers")
    from pretrain.model.hf import to_hf

    torch.manual_seed(0)
    ours = build_model(small_cfg(variant="dense", layout="3", vocab_size=301, pad_vocab_multiple=64, bias=False)).eval()
    idx = tokens(2, 40, vocab=301)
    assert (to_hf(ours).eval()(idx).logits - ours(idx).logits).abs().max().item() < 1e-4


def test_describe_counts_tied_head_once():
    row = describe(PRESETS["tiny-grt"])
    assert row["params"] == ADVERTISED_PARAMS["tiny-grt"]


def test_compiled_block_has_no_graph_break_on_its_first_call(monkeypatch):
    """torch.compile traces a block in one graph even on the call that logs the attention
    backend: a logging call inside the trace broke the graph, and torch 2.13 then crashed
    replaying the views on either side of the break ("invalid shape dimension")."""
    from torch._dynamo.utils import counters

    from pretrain.model import layers

    monkeypatch.setattr(layers, "_logged_backends", set())  # as in a fresh process
    torch._dynamo.reset()
    counters.clear()
    cfg = PRESETS["micro-grt"].replace(dropout=0.0)
    torch.manual_seed(0)
    block = layers.Block(cfg, out_std=0.02)
    x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
    compiled = torch.compile(block.forward)(x, AttentionContext())  # first: nothing logged yet
    compiled.sum().backward()
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(compiled, block(x, AttentionContext()))
