"""The GPU's precision path on the CPU: bf16 weights (as DeepSpeed's bf16 mode casts the model)
with the GRT's loop state in fp32 (ModelConfig.state_dtype), through every variant, the KV
cache, adaptive exit, and a real bf16 `grt train`."""

import json

import pytest
import torch
from multiproc import grt

from grt_common.errors import ConfigError
from pretrain.infer.adaptive import adaptive_forward
from pretrain.infer.analyze.analysis import collect
from pretrain.infer.generate import generate
from pretrain.model import build_model
from pretrain.model_config import ModelConfig
from pretrain.presets import get_preset
from pretrain.tools.bench.numerics import state_errors

VARIANTS = ["micro-grt", "micro-dense", "micro-huginn", "micro-rrt", "micro-ouro", "micro-mor"]


@pytest.mark.parametrize("preset", VARIANTS)
def test_every_variant_trains_and_evaluates_with_bf16_weights(preset):
    torch.manual_seed(0)
    model = build_model(get_preset(preset)).to(torch.bfloat16).train()
    idx = torch.randint(0, 512, (2, 32))
    for return_logits in (True, False):
        model.zero_grad()
        out = model(idx, idx, return_logits=return_logits)
        assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads), preset
    model.eval()
    with torch.no_grad():
        logits = model(idx, n_loops=model.max_loops if model.loop is not None else None).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_the_grt_state_is_fp32_under_bf16_weights_and_decodes_in_bf16():
    model = build_model(get_preset("micro-grt")).to(torch.bfloat16).eval()
    idx = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        out = model(idx, return_states=True, return_gates=True)
    assert [s.dtype for s in out.states] == [torch.float32] * (model.max_loops + 1)
    assert out.logits.dtype == torch.bfloat16
    weights = build_model(get_preset("micro-grt").replace(state_dtype="weights")).to(torch.bfloat16).eval()
    with torch.no_grad():
        assert {s.dtype for s in weights(idx, return_states=True).states} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="state_dtype='fp16'.*fp32, weights"):
        ModelConfig(state_dtype="fp16")


def test_the_gate_logits_are_an_fp32_matmul_under_bf16_weights():
    """The gate's logits leave an fp32 matmul of the bf16 weights (not a bf16 one, whose step near the
    gate's +4 start, 0.031, is 1.5% of 1 - g): they equal the fp32 product of the same bf16 values."""
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt").replace(gate_noise_std=0.0)).to(torch.bfloat16).eval()
    loop = model.loop
    s = torch.randn(2, 8, 32)
    terms = loop.anchor_terms(s)
    logits = loop.gate_logits(s.to(torch.bfloat16), terms)
    assert logits.dtype == torch.float32
    hidden = torch.nn.functional.silu(loop.gate_fc_state(loop.gate_norm_state(s.to(torch.bfloat16))) + terms.gate)
    fp32 = hidden.float() @ loop.gate_out.weight.float().t() + loop.gate_out.bias.float()
    assert torch.allclose(logits, fp32, rtol=1e-6, atol=1e-6)
    assert not torch.equal(logits, fp32.to(torch.bfloat16).float())  # finer than bf16's grid


@pytest.mark.parametrize("strategy", ["full", "first"])
def test_kv_cache_and_adaptive_exit_run_with_bf16_weights(strategy):
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt")).to(torch.bfloat16).eval()
    idx = torch.randint(0, 512, (2, 8))
    new = generate(model, idx, 8, strategy=strategy, greedy=True)
    assert new.shape == (2, 8)
    if strategy == "full":  # exact on the prompt: the cached and uncached forwards compute alike
        first = generate(model, idx, 1, use_cache=False, greedy=True)
        assert torch.equal(new[:, :1], first)
    logits, steps = adaptive_forward(model, idx, 1e-3)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_the_analyses_run_with_bf16_weights():
    """`grt analyze` takes bf16 on a GPU (`--dtype auto`): its gate-half statistics read the fp32 states
    through the bf16 gate layers."""
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt")).to(torch.bfloat16).eval()
    idx = torch.randint(0, 512, (2, 16))
    res = collect(model, [{"input_ids": idx, "targets": idx}], torch.device("cpu"), None, cka_tokens=16)
    assert len(res["state_share"]) == model.max_loops and all(0 <= v <= 1 for v in res["state_share"]), res


def test_without_a_gate_the_state_keeps_the_weights_dtype():
    """No gate: the step's output replaces the state, so there is no fp32 state to keep (and one dtype
    for every step's input: one compiled graph)."""
    cfg = get_preset("ladder-1-prelude-coda").replace(vocab_size=512, d_model=32, n_heads=2, max_seq_len=16)
    model = build_model(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        states = model(torch.randint(0, 512, (1, 8)), return_states=True).states
    assert {s.dtype for s in states} == {torch.bfloat16}


def test_an_fp32_loop_state_keeps_the_loops_change_close_to_fp32():
    """The figure of docs/model.md: after R = 4 steps of tiny-grt in bf16 (eval mode), the loop's total
    change s_R - e is within 1.5% of the fp32 model's with the fp32 state; the bf16 state is far off."""
    errors = state_errors(get_preset("tiny-grt"), batch=4, seq_len=64)
    assert errors["loop_change_error_state_fp32"] < 0.015, errors
    assert errors["loop_change_error_state_bf16"] > 3 * errors["loop_change_error_state_fp32"], errors
    assert errors["prelude_error_state_fp32"] < 0.01, errors


@pytest.mark.slow
def test_grt_train_in_bf16_on_the_cpu_trains_evaluates_saves_and_resumes(shards, tmp_path):
    """DeepSpeed's bf16 mode on the CPU accelerator (the GPU's default precision), ZeRO-3, with
    evaluation, a checkpoint and a resume: the dtype faults of the GPU path show here."""
    out = tmp_path / "bf16"
    args = [
        "train",
        "--preset",
        "micro-grt",
        "--data",
        str(shards),
        "--out",
        str(out),
        "--micro-batch-size",
        "4",
        "--set",
        "train.precision=bf16",
        "--set",
        "train.log_every=2",
        "--set",
        "train.eval_every=4",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.save_every=4",
        "--set",
        "train.lr=3e-3",
        "--set",
        "train.warmup_steps=2",
    ]
    r = grt(*args, "--steps", "4", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "ZeRO stage 3, 1 rank(s), bf16" in log
    r = grt(*args, "--steps", "8", "--resume", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and all(5.0 < x < 7.0 for x in losses), losses
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["val_loss_by_depth"]) == {"0", "1", "2", "3"}
    assert all(5.0 < v < 7.0 for v in summary["val_loss_by_depth"].values()), summary
