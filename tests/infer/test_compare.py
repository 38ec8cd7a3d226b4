"""`grt compare`: config specs, FLOPs/params matching, the table and plot, and one real
(small) comparison through `grt train`."""

import json
import os
from pathlib import Path

import pytest
from multiproc import REPO, grt
from trained_models import grt_run, single_thread  # noqa: F401 (fixtures)

from grt_common.errors import ConfigError
from pretrain.model.flops import flops_per_token
from pretrain.presets import get_preset
from pretrain.runs.run_config import RunConfig
from pretrain.tools.compare import cli as compare
from pretrain.tools.compare import final_eval as compare_eval
from pretrain.tools.compare import runs as compare_runs
from pretrain.tools.compare import sizing as compare_sizing
from pretrain.tools.compare import table as compare_table

pytestmark = pytest.mark.filterwarnings("ignore")


def test_config_specs_presets_and_json(tmp_path):
    assert compare.load_spec("micro-rrt")[0] == "micro-rrt"
    (tmp_path / "m.json").write_text(json.dumps(get_preset("micro-grt").replace(name="custom", gate=False).to_dict()))
    label, cfg, train = compare.load_spec(str(tmp_path / "m.json"))
    assert (label, cfg.gate, train) == ("m", False, {})
    (tmp_path / "r.json").write_text(json.dumps({"label": "deep", "model": "micro-grt", "train": {"lr": 1e-3}}))
    label, cfg, train = compare.load_spec(str(tmp_path / "r.json"))
    assert (label, cfg.name, train) == ("deep", "micro-grt", {"lr": 1e-3})
    (tmp_path / "bad.json").write_text(json.dumps({"label": "x", "modle": "micro-grt"}))
    with pytest.raises(ConfigError, match="unknown key.*modle"):
        compare.load_spec(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="not a preset"):
        compare.load_spec("no-such-preset")


def test_matching_flops_and_params():
    grt_cfg = get_preset("tiny-grt")
    target = flops_per_token(grt_cfg, 256)
    dense = compare_sizing.match(get_preset("tiny-dense"), target, "flops", 256)
    mor = compare_sizing.match(get_preset("tiny-mor"), target, "flops", 256)
    assert dense.layout.isdigit() and mor.parsed_layout.loops > grt_cfg.parsed_layout.loops  # MoR skips tokens
    for cfg in (dense, mor):
        assert abs(flops_per_token(cfg, 256) - target) / target < 0.1
    bigger = compare_sizing.match(
        get_preset("micro-grt"), 2 * compare_sizing.model_params(get_preset("micro-grt")), "params", 64
    )
    assert bigger.parsed_layout.core > 1 and bigger.parsed_layout.loops == 3


def test_method_names_follow_the_ladder():
    names = [
        compare_table.describe_method(get_preset(n))
        for n in (
            "ladder-0-loop-only",
            "ladder-1-prelude-coda",
            "ladder-2-noise",
            "ladder-3-reinject",
            "ladder-4-gate",
            "tiny-ouro",
            "tiny-dense",
        )
    ]
    assert names == [
        "loop only",
        "loop + prelude/coda",
        "loop + prelude/coda, noise",
        "loop + prelude/coda, noise, re-injection",
        "GRT",
        "Ouro",
        "dense GPT-2",
    ]


def test_table_and_plot(tmp_path):
    rows = []
    for i, (label, variant) in enumerate((("a", "grt"), ("b", "dense"))):
        rows.append(
            {
                "label": label,
                "method": variant,
                "variant": variant,
                "layout": "1+1x3+1",
                "matched_from": None,
                "params": 1000,
                "flops_per_token": 2e6,
                "train_flops_per_token": 6e6,
                "val_loss": 3.0 + i,
                "val_loss_by_depth": {0: 5.0, 1: 4.0, 2: 3.5, 3: 3.0 + i} if variant == "grt" else {0: 4.0},
                "val_curve": [(5, 4.0), (10, 3.0 + i)],
                "train_curve": [(s, 6 - s / 10) for s in range(1, 11)],
                "tokens_per_step": 512,
                "tokens_per_s": 1234.0,
                "peak_memory_mb": 100.0,
            }
        )
    text = compare.table(rows)
    assert "| GRT" not in text and "5.000 / 4.000 / 3.500 / 3.000" in text and text.count("\n") == 3
    compare.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_dry_run_lists_matched_runs(shards, tmp_path, capsys):
    assert (
        compare.main(
            [
                "--data",
                str(shards),
                "--out",
                str(tmp_path / "c"),
                "--configs",
                "micro-grt,micro-dense",
                "--configs",
                "micro-huginn",
                "--match",
                "flops",
                "--tokens",
                "5000",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "micro-dense" in out and "depth poisson" in out and "steps 10" in out
    assert (
        compare.main(
            ["--data", str(shards), "--out", str(tmp_path / "c"), "--configs", "micro-grt,micro-grt", "--dry-run"]
        )
        == 2
    )


@pytest.mark.slow
def test_compare_trains_each_config_and_writes_table_json_and_plot(shards, tmp_path):
    """Run from another directory than the checkout with relative paths: they are the caller's."""
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--data",
        os.path.relpath(shards, tmp_path),
        "--out",
        "cmp",
        "--configs",
        "micro-grt,micro-ouro",
        "--tokens",
        "8192",
        "--micro-batch-size",
        "8",
        "--lr",
        "1e-2",
        "--evals",
        "2",
        "--eval-batches",
        "2",
        "--log-every",
        "2",
        "--ds-config",
        os.path.relpath(REPO / "ds_configs" / "zero2.json", tmp_path),
        "--exit-depth-factor",
        "2",
        # the two runs at once, one thread each: CI's 2 cores, each process's start (imports) included
        "--parallel",
        "2",
        "--threads",
        "1",
    ]
    r = grt(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for label in ("micro-grt", "micro-ouro"):  # each run's log named when it starts
        assert f"training {label} ... (log: {Path('cmp') / (label + '.log')})" in r.stdout
    result = json.loads((out / "comparison.json").read_text())
    rows = {row["label"]: row for row in result["runs"]}
    assert set(rows) == {"micro-grt", "micro-ouro"}
    for row in rows.values():
        assert row["steps"] == 16 and row["tokens"] == 8192
        assert set(row["val_loss_by_depth"]) == {"0", "1", "2", "3"} and row["val_loss"] < 6.0
        assert row["tokens_per_s"] > 0 and row["peak_memory_mb"] > 0
        assert row["train_curve"][-1][1] < row["train_curve"][0][1]
        # the exit curve to 2R on the final checkpoint repeats the trainer's own losses up to R
        assert set(row["exit_curve"]) == {str(d) for d in range(7)}
        for depth in range(4):
            assert row["exit_curve"][str(depth)] == pytest.approx(row["val_loss_by_depth"][str(depth)], abs=1e-4)
        assert row["extrapolation"]["6"] == pytest.approx(row["exit_curve"]["6"]) and set(row["extrapolation"]) == {
            "6",
            "12",
        }
        for result in row["adaptive_exit"].values():
            assert 1 <= result["mean_steps"] <= 3
    assert rows["micro-grt"]["learned_exit"] is None and 1 <= rows["micro-ouro"]["learned_exit"]["mean_steps"] <= 3
    assert rows["micro-ouro"]["train_flops_per_token"] > 3 * rows["micro-ouro"]["flops_per_token"]  # decodes every step
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert "| Ouro | micro-ouro |" in (out / "comparison.md").read_text()
    assert "(beyond R: " in (out / "comparison.md").read_text()
    assert "past R: val loss at 2R / 4R | adaptive exit update 0.1 / kl 0.01" in (out / "comparison.md").read_text()
    # each run saved at its first evaluation (step 8), so that a run cut off resumes from there
    assert "saved checkpoint cmp/micro-grt/checkpoints/step00000008" in (out / "micro-grt" / "train.log").read_text()
    # a second call reuses the finished runs (no training) and rebuilds the same table, also for a run
    # saved at another cadence (an older compare saved only at the end): not what it trained
    saved = out / "micro-grt" / "compare_run_config.json"
    older = json.loads(saved.read_text())
    older["train"].update(save_every=0, keep_checkpoints=3)
    saved.write_text(json.dumps(older))
    again = grt(*args, cwd=tmp_path, timeout=120)
    assert again.returncode == 0 and "training" not in again.stdout
    assert (out / "comparison.md").read_text() in again.stdout


def test_progress_reads_the_last_logged_step(tmp_path):
    assert compare_runs.progress(tmp_path, 10) == "starting (0/10 steps)"
    records = [{"step": s, "loss": 5.0 - s / 10} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo')
    assert compare_runs.progress(tmp_path, 10) == "step 3/10, loss 4.700"  # the line half written is passed over


def test_a_run_being_trained_by_another_compare_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "compare.lock").write_text(f"{os.getppid()}\n")  # a live process that is not us
    with pytest.raises(RuntimeError, match="being trained by another grt compare"):
        compare_runs._lock(run)
    (run / "compare.lock").write_text("999999999\n")  # stale
    assert compare_runs._lock(run).read_text().strip() == str(os.getpid())


def _run(label: str, preset: str, steps: int, sampling: str = "uniform") -> dict:
    cfg = RunConfig(model=get_preset(preset), data="unused")
    cfg.train.steps, cfg.train.depth_sampling = steps, sampling
    return {"label": label, "cfg": cfg}


def test_depth_counts_follow_each_recipe():
    assert compare_sizing.depth_counts(_run("d", "micro-dense", 50)["cfg"]) == {0: 50}
    assert compare_sizing.depth_counts(_run("f", "micro-rrt", 50, "fixed")["cfg"]) == {3: 50}
    uniform = compare_sizing.depth_counts(_run("g", "micro-grt", 300)["cfg"])
    assert set(uniform) == {1, 2, 3} and sum(uniform.values()) == 300 and min(uniform.values()) > 60


def test_time_budget_sizing_fills_the_budget_and_no_more():
    runs = [_run("grt", "micro-grt", 300), _run("dense", "micro-dense", 300)]
    timed = [{1: 0.01, 2: 0.02, 3: 0.03}, {0: 0.025}]
    sizing = compare_sizing.size_tokens(
        runs, timed, startup_s=5.0, budget_s=100.0, tokens_per_step=512, evals=2, eval_batches=2, exit_factor=2
    )
    grt_step = sum(timed[0][d] * n for d, n in compare_sizing.depth_counts(runs[0]["cfg"]).items()) / 300
    assert sizing["runs"]["grt"]["step_s"] == pytest.approx(grt_step) and 0.019 < grt_step < 0.021
    # start-up: the first run's one-step probe less its step; evaluations: 2 x 2 batches x (R + 1) forwards
    assert sizing["runs"]["dense"]["overhead_s"] == pytest.approx(5.0 - grt_step + 2 * 2 * 1 * 0.025 / 3)
    # a looped run also pays what compare_eval runs on its final checkpoint (counted in the next test)
    final = compare_sizing.final_forwards(runs[0]["cfg"].model, exit_factor=2)
    assert sizing["runs"]["grt"]["overhead_s"] == pytest.approx(5.0 - grt_step + 2 * 0.03 / 3 * (2 * 4 + final))
    usable = 100.0 * (1 - compare_sizing.UNPLANNED_SHARE)
    assert sizing["planned_s"] <= usable < sizing["planned_s"] + grt_step + 0.025  # one more step would not fit
    assert sizing["tokens"] == sizing["steps"] * 512 and sizing["steps"] > 1000
    starved = compare_sizing.size_tokens(runs, timed, 5.0, 8.0, 512, 2, 2, 2)
    assert starved["steps"] == 1 and starved["planned_s"] > 8.0  # reported (and warned about), never zero steps


def test_time_budget_plan_counts_what_the_final_evals_run(grt_run, tmp_path, monkeypatch):
    """The plan's loop steps and decodes per batch are those final_evals runs (every adaptive
    pass to R: threshold 0); Ouro's learned exit adds R of each, MoR runs no adaptive exit."""
    import shutil
    from collections import Counter

    from pretrain.infer.evaluation.scoring import val_batches
    from pretrain.model import GPT

    run = tmp_path / "run"
    shutil.copytree(grt_run, run, ignore=shutil.ignore_patterns("final_eval.json"))
    cfg = RunConfig.load(run / "config.json")
    cfg.out = str(run)
    monkeypatch.setattr(compare_eval, "ADAPTIVE_EXITS", (("update", 0.0), ("kl", 0.0)))
    calls = Counter()

    def counting(method, key):
        def counted(self, *args, **kwargs):
            calls[key] += 1
            return method(self, *args, **kwargs)

        return counted

    for name, key in (("loop_step", "loop_steps"), ("final_hidden", "decodes")):
        monkeypatch.setattr(GPT, name, counting(getattr(GPT, name), key))
    compare_eval.final_evals(cfg, exit_factor=2)
    t = cfg.train
    batches = len(list(val_batches(cfg.data, t.micro_batch_size, None, t.eval_batches, t.seed)))
    work = compare_eval.final_eval_work(cfg.model, exit_factor=2)
    assert dict(calls) == {key: batches * n for key, n in work.items()}
    r = cfg.model.max_loops  # micro-ouro and micro-mor have micro-grt's layout
    assert compare_eval.final_eval_work(get_preset("micro-ouro"), 2) == {key: n + r for key, n in work.items()}
    assert compare_eval.final_eval_work(get_preset("micro-mor"), 2) == {"loop_steps": 4 * r, "decodes": 9}


def test_time_budget_needs_one_process_one_run_at_a_time(tmp_path, capsys):
    assert (
        compare.main(
            [
                "--data",
                str(tmp_path / "none.json"),
                "--out",
                str(tmp_path / "c"),
                "--configs",
                "micro-grt",
                "--time-budget",
                "60",
                "--parallel",
                "2",
            ]
        )
        == 2
    )
    assert "--time-budget times one process" in capsys.readouterr().err


def test_table_shows_the_exit_curve_beyond_r():
    row = {
        "label": "g",
        "method": "GRT",
        "variant": "grt",
        "layout": "1+1x3+1",
        "loops": 3,
        "matched_from": None,
        "params": 1000,
        "flops_per_token": 2e6,
        "train_flops_per_token": 6e6,
        "val_loss": 3.0,
        "val_loss_by_depth": {0: 5.0, 1: 4.0, 2: 3.5, 3: 3.0},
        "tokens_per_s": 1.0,
        "peak_memory_mb": 1.0,
        "exit_curve": {0: 5.0, 1: 4.0, 2: 3.5, 3: 3.0, 4: 2.9, 5: 2.95, 6: 3.1},
    }
    assert "| 5.000 / 4.000 / 3.500 / 3.000 (beyond R: 2.900 / 2.950 / 3.100) |" in compare.table([row])


@pytest.mark.slow
def test_step_timing_uses_the_real_engine_at_each_recipe_depth():
    run = _run("grt", "micro-grt", 20)
    run["cfg"].ds_config = str(REPO / "ds_configs" / "zero2.json")
    timed = compare_sizing.measure_steps_apart([run], seq_len=64, repeats=1)
    assert len(timed) == 1 and set(timed[0]) == {1, 2, 3} and all(t > 0 for t in timed[0].values())


def test_final_evals_extrapolate_and_exit_adaptively_on_the_trainers_batches(grt_run, tmp_path):
    import shutil

    from pretrain.distributed import Dist
    from pretrain.infer.evaluation.scoring import adaptive_sums, lm_sums, val_batches
    from pretrain.infer.load import load_model, pick_device

    # a copy: final_evals writes its cache into the run, and grt_run is shared by every xdist worker
    run = tmp_path / "run"
    shutil.copytree(grt_run, run)
    cfg = RunConfig.load(run / "config.json")
    cfg.out = str(run)
    evals = compare_eval.final_evals(cfg, exit_factor=2)
    by_depth = json.loads((run / "summary.json").read_text())["val_loss_by_depth"]
    for depth in range(4):  # the trainer's own validation batches: its losses at r = 0..R again
        assert evals["exit_curve"][depth] == pytest.approx(by_depth[str(depth)], abs=1e-4)
    # the same batches scored here, each setting on its own
    t, device = cfg.train, pick_device()
    model = load_model(run, device=device).model
    batches = lambda: val_batches(cfg.data, t.micro_batch_size, Dist(), t.eval_batches, t.seed)  # noqa: E731
    nll, tokens = lm_sums(model, batches(), [12], device, t.doc_mask)[0].tolist()
    assert evals["extrapolation"] == {
        6: pytest.approx(evals["exit_curve"][6]),
        12: pytest.approx(nll / tokens, abs=1e-6),
    }
    assert set(evals["adaptive_exit"]) == {"update 0.1", "kl 0.01"} and evals["learned_exit"] is None
    for rule, threshold in compare_eval.ADAPTIVE_EXITS:
        nll, tokens, steps = adaptive_sums(model, batches(), [threshold], device, rule, doc_mask=t.doc_mask)[0].tolist()
        result = evals["adaptive_exit"][compare_eval.adaptive_label(rule, threshold)]
        assert result == {
            "loss": pytest.approx(nll / tokens, abs=1e-6),
            "mean_steps": pytest.approx(steps / tokens, abs=1e-6),
        }
        assert 1 <= result["mean_steps"] <= 3
    assert compare_eval.final_evals(cfg, exit_factor=2) == evals  # cached in the run directory, same keys
    assert (run / "final_eval.json").is_file()


def test_ouro_learned_exit_ends_are_its_fixed_depths():
    import torch

    from pretrain.model import build_model

    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": idx, "targets": idx.roll(-1, 1)}]
    for threshold, depth in ((1.0, 3), (1e-9, 1)):  # the CDF reaches 1 only at the last step
        torch.manual_seed(0)
        model = build_model(get_preset("micro-ouro").replace(extra={"exit_threshold": threshold})).eval()
        result = compare_eval.learned_exit(model, batches, torch.device("cpu"), doc_mask=False)
        ref = model(idx, idx.roll(-1, 1), n_loops=depth).loss.item()
        assert result["mean_steps"] == depth and result["loss"] == pytest.approx(ref, rel=1e-5)


def test_a_run_stopped_by_a_signal_is_resumed_not_taken_as_finished(tmp_path):
    """A SIGTERM'd `grt train` writes summary.json too; `grt compare` run again must finish it."""
    assert not compare_runs.finished(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 216, "stopped_by_signal": True}))
    assert not compare_runs.finished(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 245, "stopped_by_signal": False}))
    assert compare_runs.finished(tmp_path)
