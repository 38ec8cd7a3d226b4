"""`grt compare`'s controls of a looped model (pretrain/tools/compare/controls.py): each derived from
its base after the base's model overrides, differing in the one thing it controls, left alone by
--match; and --seeds refused in one line."""

from __future__ import annotations

import pytest
from commands import grt_in_process

from grt_common.errors import ConfigError
from pretrain.model.flops import flops_per_token, train_flops_per_token
from pretrain.presets import PAPER_START
from pretrain.tools.compare import cli as compare
from pretrain.tools.compare.controls import mean_train_flops, parse_control
from pretrain.tools.compare.sizing import model_params

CONTROLS = "tiny-grt:dense-params,tiny-grt:dense-flops,tiny-grt:dense-train-flops,tiny-grt:r1,tiny-grt:fixed"


def built(shards, tmp_path, *extra: str) -> dict[str, dict]:
    args = compare.build_parser().parse_args(
        ["--data", str(shards), "--out", str(tmp_path), "--configs", f"tiny-grt,{CONTROLS},tiny-grt:paper-start"]
        + ["--set", "model.d_model=64", *extra]
    )
    return {run["label"]: run for run in compare.build_runs(args, 5000)}


def test_each_control_differs_from_its_base_in_what_it_controls(shards, tmp_path):
    runs = built(shards, tmp_path)
    base = runs["tiny-grt"]["cfg"]
    seq_len = 64
    m = {label: run["cfg"].model for label, run in runs.items()}
    assert all(c.d_model == 64 and c.vocab_size == base.model.vocab_size for c in m.values())  # the base's overrides
    # equal parameters: the P + C + K = 4 blocks of 1+2x4+1, no loop (the loop's projection and gate the rest)
    assert (m["tiny-grt-dense-params"].variant, m["tiny-grt-dense-params"].layout) == ("dense", "4")
    assert 0.9 < model_params(m["tiny-grt-dense-params"]) / model_params(base.model) < 1.0
    # the dense models of the GRT's inference FLOPs (depth R) and of its training FLOPs (uniform 1..4: mean 2.5)
    fwd = flops_per_token(base.model, seq_len)
    assert abs(flops_per_token(m["tiny-grt-dense-flops"], seq_len) / fwd - 1) < 0.1
    train = mean_train_flops(base, seq_len)
    assert train == pytest.approx(
        sum(train_flops_per_token(base.model, seq_len, d) for d in (1, 2, 3, 4)) / 4, rel=0.02
    )
    dense_train = train_flops_per_token(m["tiny-grt-dense-train-flops"], seq_len, 0)
    assert abs(dense_train / train - 1) < 0.1
    assert int(m["tiny-grt-dense-train-flops"].layout) < int(m["tiny-grt-dense-flops"].layout)
    assert m["tiny-grt-r1"].layout == "1+2x1+1" and runs["tiny-grt-r1"]["cfg"].train.depth_sampling == "uniform"
    assert m["tiny-grt-fixed"] == base.model and runs["tiny-grt-fixed"]["cfg"].train.depth_sampling == "fixed"
    assert all(getattr(m["tiny-grt-paper-start"], k) == v for k, v in PAPER_START.items())
    assert base.model.gate_bias_init == 0.0  # the tiny start, beside the paper's
    assert runs["tiny-grt-r1"]["control"] == {"of": "tiny-grt", "kind": "r1"} and "control" not in runs["tiny-grt"]


def test_match_leaves_the_controls_alone(shards, tmp_path):
    runs = built(shards, tmp_path, "--match", "params")
    assert (
        runs["tiny-grt-dense-params"]["cfg"].model.layout == "4"
        and runs["tiny-grt-r1"]["cfg"].model.layout == "1+2x1+1"
    )


def test_a_bad_control_or_seed_list_is_refused_in_one_line(shards, tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown control 'r2'; accepted: dense-params"):
        parse_control("tiny-grt:r2")
    with pytest.raises(ConfigError, match="a control of a looped model only"):
        built_one = compare.build_parser().parse_args(
            ["--data", str(shards), "--out", str(tmp_path), "--configs", "tiny-dense:r1"]
        )
        compare.build_runs(built_one, 5000)
    for seeds, why in (("abc", "give whole numbers separated by commas"), ("0,0", "distinct seeds")):
        rc, err = grt_in_process(
            ["compare", "--data", shards, "--out", tmp_path, "--configs", "tiny-grt", "--seeds", seeds], capsys
        )
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and why in lines[0] and "<lambda>" not in lines[0], err
