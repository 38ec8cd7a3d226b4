"""`grt export`: a ZeRO-3 checkpoint becomes one directory that loads without DeepSpeed
and computes what the training engine computed."""
import json

import pytest
import torch

from pretrain.config import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.scoring import lm_sums, val_batches
from pretrain.infer.export import main as export_main
from pretrain.infer.load import TIED_KEY, load_model, resolve_checkpoint
from trained_models import single_thread, EVAL_BATCHES, dense_run, grt_run, manifest, summary  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def grt_export(grt_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "grt"
    assert export_main(["--checkpoint", str(grt_run / "checkpoints"), "--out", str(out)]) == 0
    return out


def test_export_writes_the_documented_files(grt_export, grt_run):
    from safetensors import safe_open

    names = {p.name for p in grt_export.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.model", "run_config.json"} <= names
    assert "hf" not in names  # a GRT has no Hugging Face equivalent
    assert json.loads((grt_export / "config.json").read_text())["layout"] == "1+1x3+1"
    assert json.loads((grt_export / "run_config.json").read_text())["train"]["steps"] == 30
    with safe_open(str(grt_export / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "wte.weight" in keys and TIED_KEY not in keys  # the tied head is stored once
    loaded = load_model(grt_export)
    assert loaded.model.lm_head.weight is loaded.model.wte.weight
    assert loaded.source == "export" and loaded.tokenizer().vocab_size == loaded.cfg.vocab_size


def test_export_gives_the_training_engines_validation_loss(grt_export, grt_run, manifest):
    """The trainer's last evaluation (summary.json, by exit depth) is reproduced from the export,
    without DeepSpeed, on the same validation batches."""
    expected = {int(k): v for k, v in summary(grt_run)["val_loss_by_depth"].items()}
    loaded = load_model(grt_export)
    depths = sorted(expected)
    assert depths == [0, 1, 2, 3]
    seed = loaded.run_config["train"]["seed"]
    sums = lm_sums(loaded.model, val_batches(str(manifest), 8, Dist(), EVAL_BATCHES, seed), depths, torch.device("cpu"))
    got = {r: sums[i, 0].item() / sums[i, 1].item() for i, r in enumerate(depths)}
    for r in depths:
        assert got[r] == pytest.approx(expected[r], abs=2e-5), (r, got, expected)
    assert len(set(round(v, 4) for v in got.values())) > 1  # the depths differ: the test can tell them apart


def test_checkpoint_loads_directly_with_the_same_weights(grt_export, grt_run):
    a = load_model(grt_export).model.state_dict()
    b_loaded = load_model(grt_run)  # the run directory resolves to checkpoints/latest
    assert b_loaded.source == "checkpoint" and b_loaded.path.endswith("step00000030")
    b = b_loaded.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_dense_export_has_a_hugging_face_twin(dense_run, tmp_path):
    from transformers import GPT2LMHeadModel

    out = tmp_path / "dense"
    assert export_main(["--checkpoint", str(dense_run), "--out", str(out)]) == 0
    ours = load_model(out).model
    hf = GPT2LMHeadModel.from_pretrained(str(out / "hf")).eval()
    idx = torch.randint(0, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(idx).logits
        b = hf(idx).logits
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < 1e-4
    assert a.std() > 0.1  # real logits, not a degenerate comparison


def test_export_refuses_bad_inputs(grt_run, tmp_path, capsys):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export_main(["--checkpoint", str(grt_run), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "y")]) == 2
    assert "neither an exported model" in capsys.readouterr().err
    step = resolve_checkpoint(grt_run)
    incomplete = tmp_path / "run" / "checkpoints" / step.name
    incomplete.mkdir(parents=True)
    with pytest.raises(ConfigError, match="no COMPLETE marker"):
        resolve_checkpoint(incomplete)
