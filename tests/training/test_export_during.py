"""train.export_every (pretrain/training/checkpoint/export_during.py): `grt export`'s copy of every Nth
step's checkpoint, written while training goes on, pruned with its checkpoint, said in the run's
record, and the model the checkpoint holds: the validation loss training logged at that step."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from commands import error_lines, grt_in_process, train_command
from trained_models import grt, manifest, single_thread  # noqa: F401 (fixtures)

from pretrain.distributed import Dist
from pretrain.infer.evaluation.scoring import lm_sums, val_batches
from pretrain.infer.load import load_model

STEPS, SAVE, EXPORT, KEEP, EVAL_BATCHES, MICRO = 10, 2, 4, 2, 2, 8


@pytest.fixture(scope="module")
def run(manifest, tmp_path_factory):  # noqa: F811
    """micro-grt, 10 steps under ZeRO-3, checkpoints every 2 steps (the last 2 kept), exports every 4,
    validation every 4: exports of steps 4 and 8, the one of 4 pruned with its checkpoint by step 8's."""
    out = tmp_path_factory.mktemp("export_during") / "run"
    sets = [f"train.save_every={SAVE}", f"train.export_every={EXPORT}", f"train.keep_checkpoints={KEEP}"]
    sets += [f"train.eval_every={EXPORT}", f"train.eval_batches={EVAL_BATCHES}", "train.warmup_steps=2"]
    sets += ["train.lr=3e-3", "train.log_every=5"]
    grt(*train_command("micro-grt", manifest, out, STEPS, MICRO, "ds_configs/zero3.json", sets))
    return out


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_exports_are_kept_pruned_and_said_with_their_checkpoints(run):
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000008", "step00000010"]
    assert (ckpts / "step00000008" / "export" / "hf" / "config.json").is_file()
    assert (ckpts / "step00000008" / "export" / "model.safetensors").is_file()
    assert not (ckpts / "step00000010" / "export").exists()  # 10 is no multiple of export_every
    assert not [p for p in ckpts.rglob("*") if ".partial-" in p.name]  # no export left half-written
    log = (run / "train.log").read_text()
    for tag in ("step00000004", "step00000008"):  # 4's written, then pruned with its checkpoint
        assert f"exported checkpoint {tag} to " in log, log[-3000:]
    said = [r["export"] for r in records(run) if "export" in r]
    assert [e["step"] for e in said] == [4], said  # 8's ended after the last step: the log says it
    assert said[0]["path"].endswith("step00000004/export") and "error" not in said[0]
    assert 0 <= said[0]["stall_s"] < said[0]["seconds"]


def test_the_export_of_step_n_gives_its_validation_loss(run, manifest):  # noqa: F811
    """Step 8's export, its checkpoint and the Hugging Face copy (AutoModelForCausalLM, remote code)
    score what training's validation logged at step 8 on the same batches."""
    from transformers import AutoModelForCausalLM

    logged = next(r["val"] for r in records(run) if r["step"] == 8 and "val" in r)
    step_dir = run / "checkpoints" / "step00000008"
    exported, checkpoint = load_model(step_dir / "export"), load_model(step_dir)
    seed = exported.run_config["train"]["seed"]
    depths = list(range(exported.cfg.max_loops + 1))

    def batches():
        return list(val_batches(str(manifest), MICRO, Dist(), EVAL_BATCHES, seed))

    for loaded in (exported, checkpoint):
        sums = lm_sums(loaded.model, batches(), depths, torch.device("cpu"))
        for i, r in enumerate(depths):
            assert sums[i, 0].item() / sums[i, 1].item() == pytest.approx(logged[f"val/loss_depth_{r}"], abs=2e-5)
    hf = AutoModelForCausalLM.from_pretrained(str(step_dir / "export" / "hf"), trust_remote_code=True).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for b in batches():
            logits = hf(b["input_ids"]).logits.float()
            nll += F.cross_entropy(
                logits.flatten(0, 1), b["targets"].flatten(), ignore_index=-100, reduction="sum"
            ).item()
            n += int((b["targets"] != -100).sum())
    assert float(nll) / n == pytest.approx(logged["val/loss"], abs=2e-5)  # at the trained depth


def test_an_export_interval_off_the_saves_is_one_line(manifest, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro-grt", "--data", manifest, "--out", out, "--dry-run"]
    for item in ("train.save_every=2", "train.export_every=3"):
        argv += ["--set", item]
    rc, err = grt_in_process(argv, capsys)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and "train.export_every=3" in lines[0], err
    assert "train.save_every=2" in lines[0] and not out.exists()
