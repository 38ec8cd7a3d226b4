"""The paper's comparisons that `grt eval` and `grt analyze` report (issue 31): the dense model
cut after k layers against a hand-cut forward and torch's FLOP counter, the share of the
full-depth gain kept at half the compute by hand, the singular values of the gate's two halves
against torch.linalg.svdvals, and both commands end to end on a dense model."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from trained_models import manifest, single_thread, small_model, write_export  # noqa: F401 (fixtures)

from grt_common.errors import ConfigError
from pretrain.infer.analyze.analysis import main as analyze_main
from pretrain.infer.analyze.measures import exit_flops, half_compute_share, half_cosines
from pretrain.infer.evaluation.evaluate import main as eval_main
from pretrain.infer.evaluation.report import format_table
from pretrain.infer.evaluation.scoring import exit_logits
from pretrain.infer.exit_depths import check_depths, default_depths
from pretrain.model.layers import AttentionContext


def tokens(b=2, t=24, vocab=64, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_dense_early_exit_is_the_model_cut_by_hand():
    model = small_model("4", variant="dense", init_std=0.2)  # large weights: every layer moves the logits
    idx, targets = tokens(), tokens(seed=1)
    full = model(idx).logits
    for k in range(1, 5):
        x, ctx = model.embed(idx), AttentionContext()
        for block in list(model.prelude)[:k]:  # the first k blocks, by hand
            x = block(x, ctx)
        want = model.lm_head(model.ln_f(x))[..., : model.cfg.vocab_size]
        out = model(idx, targets, n_loops=k)
        torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-5)
        assert out.loss.item() == pytest.approx(
            torch.nn.functional.cross_entropy(want.flatten(0, 1), targets.flatten()).item(), rel=1e-6
        )
        torch.testing.assert_close(exit_logits(model, idx, [k])[k], want, rtol=0, atol=1e-5)  # grt eval's path
        if k < 4:
            assert (out.logits - full).abs().max() > 1e-2  # a cut model is another function
    torch.testing.assert_close(model(idx, n_loops=4).logits, full, rtol=0, atol=0)
    torch.testing.assert_close(model(idx, n_loops=0).logits, full, rtol=0, atol=0)  # what training passes
    got = exit_logits(model, idx, [0, 2, 4])
    torch.testing.assert_close(got[0], full, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[2], model(idx, n_loops=2).logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="exits after 1..4"):
        model(idx, n_loops=5)


@torch.no_grad()
def test_exit_flops_match_pytorchs_flop_counter():
    b, t = 2, 24
    dense = small_model("4", variant="dense", attention="naive")  # the counter sees naive attention's matmuls
    for k in range(1, 5):
        with FlopCounterMode(display=False) as counter:
            dense(tokens(b, t), n_loops=k)
        assert counter.get_total_flops() == exit_flops(dense.cfg, t, k) * b * t, k
    # k blocks and the head, by hand (d 32, mlp 4, vocabulary 64 padded to 64)
    d, v = 32, 64
    assert exit_flops(dense.cfg, t, 2) == 2 * (24 * d * d + 4 * t * d) + 2 * d * v
    with pytest.raises(ValueError, match="exits after 1..4"):
        exit_flops(dense.cfg, t, 0)
    grt = small_model(attention="naive")  # 1+2x3+1: the loop's depths are loop steps
    for r in (0, 1, 3):
        with FlopCounterMode(display=False) as counter:
            grt(tokens(b, t), n_loops=r)
        assert counter.get_total_flops() == exit_flops(grt.cfg, t, r, executed=True) * b * t, r
    # the spec's formula (the report's axis) counts W_proj's and the gate's anchor halves every step
    assert exit_flops(grt.cfg, t, 3) - exit_flops(grt.cfg, t, 3, executed=True) == 2 * 4 * d * d


def test_dense_depths_are_layers_run():
    dense, grt = small_model("4", variant="dense"), small_model()
    assert default_depths(dense) == [4] and default_depths(grt) == [0, 1, 2, 3]
    assert check_depths(dense, [1, 2, 4], False) == [1, 2, 4]
    for bad in ([0, 4], [5]):
        with pytest.raises(ConfigError, match=r"number of layers run, 1\.\.4"):
            check_depths(dense, bad, True)
    row = {"loss": 1.0, "ppl": 2.7}
    results = {"depths": [1, 4], "trained_loops": 0, "depth_unit": "layers", "val": {1: row, 4: row}}
    assert "*" not in format_table(results)  # a dense model's depths are never past a trained R


def test_half_compute_share_by_hand():
    depths, flops = [0, 1, 2, 3, 4], [10.0, 20.0, 30.0, 40.0, 50.0]
    h = half_compute_share(depths, flops, [5.0, 4.0, 3.5, 3.2, 3.0])
    # half of 50 is 25: depth 1 (20 FLOPs) is the closest not above; gain 1.0 of 2.0
    assert (h["depth"], h["flops"], h["half_flops"]) == (1, 20.0, 25.0)
    assert h["gain"] == pytest.approx(1.0) and h["full_gain"] == pytest.approx(2.0) and h["share"] == pytest.approx(0.5)
    assert half_compute_share([1, 2], [40.0, 50.0], [3.0, 2.0])["share"] is None  # no depth at half the compute
    exact = half_compute_share([1, 2, 3], [10.0, 15.0, 30.0], [4.0, 3.0, 3.5])  # 15 = half: not above is enough
    assert exact["depth"] == 2 and exact["share"] == pytest.approx(1.0 / 0.5)
    assert half_compute_share([0, 1, 2], [1.0, 2.0, 3.0], [3.0, 2.0, 3.0])["share"] is None  # no full-depth gain


def with_singular_values(n: int, values: list[float], seed: int) -> torch.Tensor:
    """An n x n matrix U diag(values) V^T with random orthogonal U, V."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T


def test_top_singular_values_of_each_half():
    d = 32
    state = [9.87, 5.0, 4.0, 3.0, 2.0] + [1.0 - i / d for i in range(d - 5)]
    anchor = [6.85, 6.0, 0.5, 0.25, 0.125] + [0.1] * (d - 5)
    ws, we = with_singular_values(d, state, 0), with_singular_values(d, anchor, 1)
    h = half_cosines(ws.float(), we.float())
    assert h["singular_values_state"] == pytest.approx(state[:5], rel=1e-5)
    assert h["singular_values_anchor"] == pytest.approx(anchor[:5], rel=1e-5)
    assert h["singular_values_state"] == pytest.approx(torch.linalg.svdvals(ws.float()).double()[:5].tolist(), rel=1e-5)
    assert h["norm_state"] == pytest.approx(
        sum(s * s for s in state) ** 0.5, rel=1e-5
    )  # Frobenius: root of sum sigma^2
    assert (
        len(half_cosines(ws[:3, :4], we[:3, :4])["singular_values_state"]) == 3
    )  # fewer than 5 when the matrix is small


def test_analyze_and_eval_compare_grt_and_dense_early_exit(manifest, tmp_path, capsys):  # noqa: F811 (fixture)
    from safetensors.torch import load_file

    tok = manifest.parent / "tokenizer.model"
    grt = small_model(vocab=512)  # 1+2x3+1, d 32, the gate's output bias randomised
    d = grt.cfg.d_model
    with torch.no_grad():  # the gate's first layer: halves with known singular values
        grt.loop.gate_fc_state.weight.copy_(with_singular_values(d, [9.87] + [1.0] * (d - 1), 2))
        grt.loop.anchor.gate_fc.weight.copy_(with_singular_values(d, [6.85, 3.0] + [0.5] * (d - 2), 3))
    dense = small_model("4", variant="dense", vocab=512)
    run_config = {"data": str(manifest)}
    g, dn = write_export(grt, tmp_path / "g", tok, run_config), write_export(dense, tmp_path / "d", tok, run_config)
    out = tmp_path / "report"
    args = [str(g), "--out", str(out), "--max-batches", "2", "--freq-batches", "2", "--cka-tokens", "64"]
    assert analyze_main([*args, "--dense", str(dn)]) == 0
    res = json.loads((out / "analysis.json").read_text())
    ee = res["early_exit"]
    assert ee["grt"]["depths"] == [0, 1, 2, 3] and ee["dense"]["depths"] == [1, 2, 3, 4]
    assert ee["grt"]["loss"] == pytest.approx([res["loss_by_depth"][str(r)] for r in range(4)])
    seq = ee["seq_len"]
    assert ee["dense"]["flops_per_token"] == [exit_flops(dense.cfg, seq, k) for k in range(1, 5)]
    for curve in (ee["grt"], ee["dense"]):  # the share, from the curve's own numbers
        assert curve["half_compute"] == pytest.approx(
            half_compute_share(curve["depths"], curve["flops_per_token"], curve["loss"])
        )
    sv = res["half_cosines"]["gate_fc"]
    weights = load_file(str(g / "model.safetensors"))
    for half, name in (("state", "loop.gate_fc_state.weight"), ("anchor", "loop.anchor.gate_fc.weight")):
        want = torch.linalg.svdvals(weights[name].double())[:5].tolist()
        assert sv[f"singular_values_{half}"] == pytest.approx(want, rel=1e-6)
    assert sv["singular_values_state"][0] == pytest.approx(9.87, rel=1e-5)
    assert sv["singular_values_anchor"][:2] == pytest.approx([6.85, 3.0], rel=1e-5)
    report = (out / "report.md").read_text()
    assert "top singular value (state half)" in report and "9.870" in report and "6.850" in report
    assert "Share of the full-depth gain kept at half the" in report and "- dense: " in report
    assert (out / "loss_by_depth.png").read_bytes()[:4] == b"\x89PNG"

    ev = tmp_path / "eval.json"
    common = ["--tasks", "val", "--max-batches", "2", "--quiet", "--json-out", str(ev)]
    assert eval_main([str(dn), "--depths", "1-4", *common]) == 0
    val = json.loads(ev.read_text())
    assert val["depth_unit"] == "layers" and val["depths"] == [1, 2, 3, 4]
    for k in range(1, 5):  # the same batches as analyze's: the same losses
        assert val["val"][str(k)]["loss"] == pytest.approx(ee["dense"]["loss"][k - 1], rel=1e-6)
    assert eval_main([str(dn), *common]) == 0
    assert list(json.loads(ev.read_text())["val"]) == ["4"]  # the default: the whole model
    capsys.readouterr()
    assert eval_main([str(dn), "--depths", "0,2", *common]) == 2
    assert "number of layers run, 1..4" in capsys.readouterr().err
    assert eval_main([str(dn), "--depths", "2", "--kv-cache", "full", *common]) == 2
    assert "drop --kv-cache" in capsys.readouterr().err
