"""`grt bench budget`: the step budget this tree predicts (pretrain/tools/bench/budget.py), its rows
computed from the model's own FLOP counts and loss chunks, and what issue 47 changed in it."""

import pytest

from pretrain.model.flops import train_flops_per_token
from pretrain.presets import get_preset
from pretrain.tools.bench.budget import EFFICIENCY, GPUS, budget_table, format_budget, loss_bytes, main, step_budget


def test_the_matmul_rows_are_the_models_training_flops():
    """Block, loop, gate and head matmuls add up to the model's executed training FLOPs (flops.py),
    at the bf16 rate after the change (the gate's backward counted twice: its hi/lo split)."""
    gpu, tokens = GPUS["h200"], 16 * 1024
    for preset in ("grt-small", "dense-small"):
        cfg = get_preset(preset)
        layout, d = cfg.parsed_layout, cfg.d_model
        rows = step_budget(cfg, tokens, 1024, gpu, 2)
        rate = gpu.bf16_tflops * 1e12 * EFFICIENCY["matmul"] / 1000  # FLOPs per ms
        matmul_flops = (rows["block and loop matmuls"]["after"] + rows["head matmuls"]["after"]) * rate
        gate = 3 * layout.loops * 2 * d * d * tokens if layout.looped else 0  # its own row
        attention = 3 * (layout.prelude + layout.core * layout.loops + layout.coda) * 4 * 1024 * d * tokens
        expected = train_flops_per_token(cfg, 1024, layout.loops, executed=True) * tokens - gate - attention
        assert matmul_flops == pytest.approx(expected, rel=1e-6), preset


def test_the_gate_goes_on_tensor_cores_and_the_loss_loses_its_per_chunk_passes():
    result = budget_table(_args())
    grt, dense = result["presets"]["grt-small"], result["presets"]["dense-small"]
    gate = grt["rows"]["gate matmuls"]
    assert gate["before"] > 5 * gate["after"]  # fp32 without tensor cores against bf16 GEMMs
    assert "gate matmuls" not in dense["rows"]
    cfg = get_preset("grt-small")
    before, after = (loss_bytes(cfg, 16384, GPUS["h200"], k) for k in ("before", "after"))
    assert before - after == pytest.approx(13 * 12 * cfg.padded_vocab_size * cfg.d_model)  # 13 chunks' cast-and-add
    for p in (grt, dense):
        assert p["total_ms"]["after"] < p["total_ms"]["before"]
        assert p["total_ms"]["before"] == pytest.approx(sum(r["before"] for r in p["rows"].values()))
    table = format_budget(result)
    assert "gate matmuls | 10.8 | 1.5 | - | -" in table and "tokens/s |" in table


def test_the_command_prints_its_reproduction_line(capsys):
    assert main(["--presets", "grt-small", "--zero-stage", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# reproduce: grt bench budget --presets grt-small --zero-stage 3")
    assert "ZeRO-3" in out


def _args():
    import argparse

    return argparse.Namespace(presets=["grt-small", "dense-small"], batch=16, seq_len=1024, gpu="h200", zero_stage=2)
