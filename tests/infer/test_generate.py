"""KV-cached decoding: the `full` strategy is the model's function; the shared strategies
keep fewer caches; sampling filters; `grt generate` and the decode benchmark."""

import json

import pytest
import torch
from trained_models import data, single_thread, small_model, write_export  # noqa: F401

from pretrain.infer.generate import filter_logits, generate, sample_next
from pretrain.infer.generate import main as generate_main
from pretrain.infer.kv_cache import (
    STRATEGIES,
    CachedDecoder,
    cache_bytes_formula,
    cache_slots,
    compile_for_decode,
    is_compiled,
)
from pretrain.tools.bench.decode import PAPER_MEMORY_RATIOS, bench_one, paper_memory_ratios
from pretrain.tools.bench.decode import main as bench_main


def lively(**kw):
    """A random model with large weights: varied greedy tokens (the 0.02 init repeats one token)."""
    return small_model(init_std=0.3, **kw)


def prompts(b=2, t=7, seed=3):
    return torch.randint(1, 64, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("depth", [0, 1, 3, 5])
def test_full_cache_is_exactly_the_uncached_model(depth):
    model = lively()  # 1+2x3+1, gate biases randomised so the loop really writes
    idx = prompts()
    ref_tokens, ref_logits = generate(model, idx, 12, use_cache=False, greedy=True, n_loops=depth, return_logits=True)
    tokens, logits = generate(model, idx, 12, strategy="full", greedy=True, n_loops=depth, return_logits=True)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert len(set(tokens[0].tolist())) > 1  # not a constant sequence


def test_full_cache_dense_and_without_gate():
    for model in (lively(layout="4", variant="dense"), lively(gate=False, reinject_anchor=False)):
        idx = prompts(b=3)
        ref = generate(model, idx, 10, use_cache=False, greedy=True, return_logits=True)
        got = generate(model, idx, 10, greedy=True, return_logits=True)
        assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-5)


def test_shared_strategies_are_exact_on_the_prompt_and_approximate_after():
    model = lively()
    idx = prompts()
    ref = model(idx).logits[:, -1]
    after = {}
    for s in STRATEGIES:
        dec = CachedDecoder(model, batch=2, max_len=20, strategy=s)
        assert torch.allclose(dec.forward(idx), ref, atol=1e-5), s  # the prompt is prefilled exactly
        after[s] = dec.forward(ref.argmax(-1)[:, None])
    exact = model(torch.cat([idx, ref.argmax(-1)[:, None]], 1)).logits[:, -1]
    assert torch.allclose(after["full"], exact, atol=1e-5)
    for s in ("first", "last", "average"):
        assert not torch.allclose(after[s], exact, atol=1e-3), s  # the shared cache is an approximation
    # with one loop step, every strategy keeps the same (exact) cache
    for s in STRATEGIES:
        one = CachedDecoder(model, batch=2, max_len=20, strategy=s, n_loops=1)
        one.forward(idx)
        ref1 = model(torch.cat([idx, ref.argmax(-1)[:, None]], 1), n_loops=1).logits[:, -1]
        assert torch.allclose(one.forward(ref.argmax(-1)[:, None]), ref1, atol=1e-5), s


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_attends_to_the_cache_in_place_without_cudnn_plans(monkeypatch, strategy):
    """Issue 12's decode slow path: cuDNN attention builds a plan per key length (a new one
    every token), and a copied cache costs O(context) per layer and loop step. Every decode
    attention runs with cuDNN off and reads its keys/values straight from the cache."""
    model = lively()
    dec = CachedDecoder(model, batch=2, max_len=20, strategy=strategy)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        cache = (dec.cache.k.untyped_storage().data_ptr(), dec.cache.v.untyped_storage().data_ptr())
        calls.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()) == cache,
            )
        )
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = dec.forward(prompts())
    for _ in range(3):
        logits = dec.forward(logits.argmax(-1)[:, None])
    assert len(calls) == 4 * (1 + 2 * 3 + 1)  # every layer of every token went through the cache
    assert calls == [(False, True)] * len(calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after decoding


def test_cache_sizes_follow_the_formula():
    model = small_model()  # P=1, C=2, R=3, K=1, d=32
    assert cache_slots(model, "full", 3) == 1 + 2 * 3 + 1
    assert cache_slots(model, "average", 3) == 1 + 2 + 1
    assert cache_slots(model, "full", 5) == 1 + 2 * 5 + 1
    for s in STRATEGIES:
        dec = CachedDecoder(model, batch=4, max_len=30, strategy=s)
        assert dec.cache.nbytes == cache_bytes_formula(model, s, 3, 4, 30, torch.float32)
    assert cache_bytes_formula(model, "full", 3, 4, 30, torch.float32) == 2 * 8 * 4 * 30 * 32 * 4
    assert cache_bytes_formula(model, "first", 3, 4, 30, torch.bfloat16) == 2 * 4 * 4 * 30 * 32 * 2


def test_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.7)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.81)) == [True, True, True, False]
    assert keep(filter_logits(logits, top_p=0.4)) == [True, False, False, False]  # the top token always stays
    assert keep(filter_logits(logits[:, [2, 0, 3, 1]], top_p=0.7)) == [False, True, False, True]  # unsorted input
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits.expand(500, 4), top_k=2, generator=g) for _ in range(8)]).flatten()
    assert set(draws.tolist()) == {0, 1}
    share = (draws == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.03  # renormalised over the kept tokens
    cold = sample_next(logits.expand(200, 4), temperature=0.05, generator=g)
    assert (cold == 0).all()
    assert torch.equal(sample_next(logits, greedy=True), torch.tensor([0]))


def test_sampling_is_seeded_and_stops_at_the_separator():
    model = small_model()
    idx = prompts()
    a = generate(model, idx, 15, temperature=1.0, top_p=0.9, seed=5)
    b = generate(model, idx, 15, temperature=1.0, top_p=0.9, seed=5)
    c = generate(model, idx, 15, temperature=1.0, top_p=0.9, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    first = int(a[0, 0])
    stopped = generate(model, idx[:1], 15, temperature=1.0, top_p=0.9, seed=5, stop_id=first)
    assert stopped.tolist() == [[first]]
    long = generate(model, prompts(t=60), 50, greedy=True)  # capped by the context of 64
    assert long.shape == (2, 4)


def test_render_shows_document_breaks():
    from trained_models import CharTokenizer

    from pretrain.infer.generate import render

    tok = CharTokenizer()
    ids = tok.encode("ab") + [0] + tok.encode("cd")
    assert render(tok, ids) == tok.decode(tok.encode("ab")) + "\n\n" + tok.decode(tok.encode("cd"))
    assert render(tok, ids, stop_at_separator=True) == tok.decode(tok.encode("ab"))


def test_generate_command(tmp_path, capsys):
    tok = data().parent.parent / "tok.model"
    from data_pipeline.tokenizer import Tokenizer

    model = small_model(vocab=Tokenizer(str(tok)).vocab_size)
    out = write_export(model, tmp_path / "m", tokenizer=tok)
    argv = [str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--greedy", "--json"]
    assert generate_main(argv + ["--kv-cache", "full"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert generate_main(argv + ["--no-cache"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert full["tokens"] == ref["tokens"] and len(full["tokens"][0]) == 8
    assert full["samples"][0].startswith("ROMEO:") and full["depth"] == 3
    assert generate_main([str(out), "--depth", "4", "--max-new-tokens", "2"]) == 2
    assert "--allow-beyond-trained" in capsys.readouterr().err
    assert (
        generate_main(
            [
                str(out),
                "--depth",
                "4",
                "--allow-beyond-trained",
                "--max-new-tokens",
                "3",
                "--kv-cache",
                "average",
                "--num-samples",
                "2",
                "--top-k",
                "5",
            ]
        )
        == 0
    )
    assert "--- sample 2" in capsys.readouterr().out


def test_decode_benchmark_reports_every_strategy(tmp_path, capsys):
    row = bench_one(small_model(), "average", batch=2, prompt_len=4, new_tokens=3, depth=None, warmup=1)
    assert row["cache_bytes_measured"] == row["cache_bytes_formula"] == 2 * 4 * 2 * 7 * 32 * 4
    assert row["ms_per_token"] > 0 and row["strategy"] == "average"
    path = tmp_path / "bench.json"
    assert (
        bench_main(
            [
                "--preset",
                "micro-grt",
                "--dense-preset",
                "micro-dense",
                "--batch-sizes",
                "1,2",
                "--prompt-len",
                "4",
                "--new-tokens",
                "3",
                "--warmup",
                "1",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    rows = json.loads(path.read_text())
    assert [(r["strategy"], r["batch"]) for r in rows[:5]] == [
        ("dense", 1),
        ("full", 1),
        ("first", 1),
        ("last", 1),
        ("average", 1),
    ]
    assert len(rows) == 10
    by = {(r["strategy"], r["batch"]): r for r in rows}
    # micro-grt 1+1x3+1 keeps 5 slots (full) or 3 (shared); micro-dense keeps 5
    assert by[("full", 2)]["cache_bytes_formula"] == by[("dense", 2)]["cache_bytes_formula"]
    assert by[("first", 2)]["cache_bytes_formula"] * 5 == by[("full", 2)]["cache_bytes_formula"] * 3
    for r in rows:  # total memory: the weights (micro-grt's 60,800 or micro-dense's 80,224 fp32 parameters) + cache
        params = 80_224 if r["strategy"] == "dense" else 60_800
        assert r["weights_bytes"] == 4 * params and r["total_bytes"] == r["weights_bytes"] + r["cache_bytes_measured"]
    out = capsys.readouterr().out
    assert "ms/token" in out and "total MB" in out and "grt-medium against dense-medium" in out


def test_the_papers_three_memory_ratios_follow_from_the_medium_presets():
    """Weights plus a 1,024-token bf16 cache of grt-medium (171M parameters) against dense-medium:
    the paper's 0.55x (batch 1, full), 0.91x (batch 32, full) and 0.39x (batch 32, average)."""
    rows = {(r["batch"], r["strategy"]): r for r in paper_memory_ratios()}
    for key, paper in PAPER_MEMORY_RATIOS.items():
        assert abs(rows[key]["ratio"] - paper) < 0.01, (key, rows[key]["ratio"], paper)
    weights = 2 * 171_073_536  # bf16
    slot = 2 * 1024 * 1024 * 2  # K and V, 1,024 positions, d 1,024, bf16, per sequence
    assert rows[(32, "average")]["total_bytes"] == weights + 32 * (2 + 5 + 2) * slot


def test_compiled_decode_gives_the_eager_logits_and_a_shared_cache_bench_row():
    """`grt bench decode --compile`: the blocks and loop step under torch.compile decode the same
    tokens and logits as eager; a core_kv='anchor' model has one exact cache, one row per batch."""
    idx = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model = small_model()
    eager = generate(model, idx, 4, strategy="average", greedy=True, return_logits=True)
    compile_for_decode(model)
    assert is_compiled(model)
    compiled = generate(model, idx, 4, strategy="average", greedy=True, return_logits=True)
    assert torch.equal(compiled[0], eager[0]) and torch.allclose(compiled[1], eager[1], atol=1e-5)
    row = bench_one(model, "full", batch=1, prompt_len=4, new_tokens=2, depth=None, warmup=1, repeats=1)
    assert row["compiled"] and row["ms_per_token"] > 0
    anchored = bench_one(small_model(core_kv="anchor"), "full", 1, 4, 2, None, warmup=1, repeats=1)
    assert anchored["strategy"] == "anchor" and anchored["cache_slots"] == 1 + 2 + 1


def test_zero_shot_scoring_through_the_kv_cache():
    """`grt eval --kv-cache`: the full cache reproduces the one-forward scores; the shared
    strategies change them (they are approximations past the prompt)."""
    from trained_models import CharTokenizer

    from pretrain.infer.evaluation.zero_shot import encode_request, score_requests, score_requests_cached

    model, tok = lively(), CharTokenizer()
    enc = [encode_request(tok, "The cat sat", " on the mat", 64), encode_request(tok, "Hello", " world!", 64)]
    ref_ll, ref_greedy = score_requests(model, enc, [1, 3], torch.device("cpu"))
    ll, greedy = score_requests_cached(model, enc, [1, 3], torch.device("cpu"), "full")
    assert torch.allclose(ll, ref_ll, atol=1e-3) and torch.equal(greedy, ref_greedy)
    for s in ("first", "last", "average"):
        approx, _ = score_requests_cached(model, enc, [1, 3], torch.device("cpu"), s)
        assert torch.allclose(approx[:, 0], ref_ll[:, 0], atol=1e-3)  # one loop step: exact
        assert not torch.allclose(approx[:, 1], ref_ll[:, 1], atol=1e-2), s


def test_loss_through_the_kv_cache():
    """`grt eval --kv-cache` on held-out text: full = one forward; average/last/first differ."""
    from pretrain.infer.evaluation.scoring import lm_sums, lm_sums_cached

    model = lively()
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(1, 64, (3, 12), generator=g)
    targets = torch.randint(0, 64, (3, 12), generator=g)
    targets[2, 8:] = -100  # padding of a short window
    batches = [{"input_ids": idx, "targets": targets}]
    ref = lm_sums(model, batches, [0, 3], torch.device("cpu"))
    full = lm_sums_cached(model, batches, [0, 3], torch.device("cpu"), "full")
    assert torch.allclose(full, ref, rtol=1e-5) and full[0, 1] == 32
    for s in ("first", "last", "average"):
        approx = lm_sums_cached(model, batches, [0, 3], torch.device("cpu"), s)
        assert approx[0, 0].item() == pytest.approx(ref[0, 0].item(), rel=1e-5)  # depth 0: no loop, exact
        assert abs(approx[1, 0].item() - ref[1, 0].item()) > 1e-2, s


def test_baselines_decode_without_a_cache_only():
    from grt_common.errors import ConfigError
    from pretrain.model import build_model
    from pretrain.presets import get_preset

    model = build_model(get_preset("micro-rrt")).eval()
    with pytest.raises(ConfigError, match="--no-cache"):
        CachedDecoder(model, batch=1)
    assert generate(model, prompts(b=1), 3, use_cache=False, greedy=True).shape == (1, 3)
