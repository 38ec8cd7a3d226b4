"""`grt bench`: every subcommand listed, every flag checked at the door (one line, exit 2), the
shared helpers below the bench modules (no import circle), and `grt bench loss`'s table."""

import ast
import json

import pytest
from multiproc import REPO, grt

from pretrain.cli import dispatch
from pretrain.tools.bench.cli import SUBCOMMANDS
from pretrain.tools.bench.cli import main as bench_main


def test_bench_help_lists_every_subcommand():
    r = grt("bench", "--help")
    assert r.returncode == 0, r.stderr
    listed = r.stdout.split("positional arguments:")[1]
    assert {"data", "train-step", "memory", "zero", "decode", "precision", "loss", "budget"} <= set(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        assert f"\n    {name} " in listed, (name, r.stdout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["decode", "--batch-sizes", "0"], "'0': expected comma-separated whole numbers >= 1"),
        (["decode", "--batch-sizes", "1,x"], "'1,x': expected comma-separated whole numbers >= 1"),
        (["decode", "--prompt-len", "0"], "'0': expected a whole number >= 1"),
        (["decode", "--new-tokens", "0"], "'0': expected a whole number >= 1"),
        (["decode", "--depth", "-1"], "'-1': expected a whole number >= 0"),
        (["decode", "--repeats", "0"], "'0': expected a whole number >= 1"),
        (["decode", "--device", "foo"], "--device 'foo': expected auto, cpu, cuda or cuda:N"),
        (["decode", "--strategies", ","], "--strategies: unknown none given"),
        (["train-step", "--warmup", "-1"], "'-1': expected a whole number >= 0"),
        (["train-step", "--peak-tflops", "0"], "'0': expected a number > 0"),
        (["memory", "--loops", "0"], "'0': expected a whole number >= 1"),
        (["zero", "--stages", "5"], "invalid choice: 5"),
        (["zero", "--steps", "1"], "'1': expected a whole number >= 2"),
        (["zero", "--presets", "nope"], "unknown preset 'nope'"),
        (["precision", "--preset", "dense-small"], "a dense model has no loop state to measure"),
        (["precision", "--seq-len", "9999"], "more than tiny-grt's max_seq_len of 256"),
        (["loss", "--rows", "plain,fused"], "expected rows of plain, chunked-unpadded"),
        (["loss", "--vocab", "1"], "'1': expected a whole number >= 2"),
        (["loss", "--dtype", "fp16"], "invalid choice: 'fp16'"),
    ],
)
def test_bad_bench_flags_are_refused_at_the_door_in_one_line(args, message, capsys):
    try:  # as `grt bench ...` runs it: the cli's one-line argparse errors
        code = dispatch(["bench", *args])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2, args
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_the_bench_modules_import_nothing_private_and_no_circle():
    """bench/cli.py dispatches to numerics, decode, train_step, zero and save; what they share is in
    bench/support.py."""
    for name in ("numerics", "decode", "train_step", "zero", "save", "support"):
        tree = ast.parse((REPO / "pretrain" / "tools" / "bench" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "pretrain.tools.bench.cli" not in imported, name
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        assert not [n for n in names if n.startswith("_") and n != "annotations"], (name, names)


def test_the_loss_bench_times_every_row_and_matches_the_reference(capsys):
    assert bench_main(["loss", "--tokens", "96", "--d-model", "16", "--vocab", "200", "--rows",
                       "plain,chunked-unpadded,chunked-padded,cce", "--repeats", "1", "--json"]) == 0  # fmt: skip
    rows = {r["row"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["plain"]["width"] == 200 and rows["chunked-padded"]["width"] == 256
    assert "skipped" in rows["cce"]  # no CUDA here
    for name in ("plain", "chunked-unpadded", "chunked-padded"):
        r = rows[name]
        assert r["ms"] > 0 and r["peak_mb"] >= 0, r
        assert r["loss_abs_diff"] < 1e-5 and r["grad_h_rel_diff"] < 1e-5 and r["grad_w_rel_diff"] < 1e-5, r
    assert rows["chunked-padded"]["padded_rows_grad"] == 0 and rows["chunked-padded"]["training_default"]
