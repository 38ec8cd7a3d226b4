"""`grt export`: a ZeRO-3 checkpoint becomes one directory that loads without DeepSpeed
and computes what the training engine computed."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import DEMO_TEXT, OFFLINE, SHARED
from trained_models import ENV, EVAL_BATCHES, dense_run, grt, grt_run, manifest, single_thread, summary  # noqa: F401 (fixtures)

from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.evaluation.scoring import lm_sums, val_batches
from pretrain.infer.export import main as export_main
from pretrain.infer.load import load_model, resolve_checkpoint
from pretrain.model.weights import TIED_KEY


@pytest.fixture(scope="module")
def grt_export(grt_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "grt"
    assert export_main(["--checkpoint", str(grt_run / "checkpoints"), "--out", str(out)]) == 0
    return out


def test_export_writes_the_documented_files(grt_export, grt_run, tmp_path):
    from safetensors import safe_open

    names = {p.name for p in grt_export.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.model", "run_config.json", "hf"} <= names
    hf_names = {p.name for p in (grt_export / "hf").iterdir()}
    assert {
        "config.json",
        "configuration_grt.py",
        "modeling_grt.py",
        "grt_gpt.py",
        "grt_layers.py",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= hf_names
    hf_config = json.loads((grt_export / "hf" / "config.json").read_text())
    ours = json.loads((grt_export / "config.json").read_text())
    assert {k: hf_config[k] for k in ours} == ours  # every ModelConfig field
    assert hf_config["model_type"] == "grt" and hf_config["trained_depth"] == hf_config["depth"] == 3
    assert set(hf_config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    for f in (grt_export / "hf").glob("*.py"):  # self-contained: transformers copies only this folder
        assert not re.search(r"^\s*(from|import) pretrain\b", f.read_text(), re.M), f.name
    no_hf = tmp_path / "no-hf"
    assert export_main(["--checkpoint", str(grt_run), "--out", str(no_hf), "--no-hf"]) == 0
    assert {p.name for p in no_hf.iterdir()} == names - {"hf"}
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
    from transformers import AutoTokenizer

    tok = load_model(out).tokenizer()
    assert AutoTokenizer.from_pretrained(str(out / "hf"))("To be")["input_ids"] == [tok.sep_id] + tok.encode("To be")
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == tok.sep_id


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


# What a user's machine runs: transformers alone, with the `pretrain` package made unimportable.
_HF_USER = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompt, out = sys.argv[1:]
idx = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
ids = tok(prompt, return_tensors="pt").input_ids
res = {"idx": idx.tolist(), "ids": ids.tolist()}
for kw in ({}, {"depth": 1}, {"depth": 5}, {"kv_cache": "average"}):
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw).eval()
    key = ",".join(f"{k}={v}" for k, v in kw.items()) or "default"
    with torch.no_grad():
        res[key] = {"depth": model.config.depth, "logits": model(idx).logits.tolist(),
                    "cached": model.generate(ids, max_new_tokens=12, do_sample=False).tolist(),
                    "uncached": model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False).tolist()}
json.dump(res, open(out, "w"))
"""


def test_grt_export_loads_with_transformers_alone(grt_export, tmp_path):
    """AutoModelForCausalLM(trust_remote_code=True) in a process that cannot import `pretrain`:
    the logits of our model at the trained depth and at depths set through from_pretrained, and
    generate()'s greedy tokens with the KV cache (full, and average set through the config) equal
    our generate()'s (what `grt generate --greedy --stop-at-separator` runs) and those without a cache."""
    from pretrain.infer.generate import generate

    shim = tmp_path / "shim" / "pretrain"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('the pretrain package is not on a user machine')\n")
    out = tmp_path / "hf_user.json"
    proc = subprocess.run(
        [sys.executable, "-c", _HF_USER, str(grt_export / "hf"), "ROMEO:", str(out)],
        cwd=tmp_path,
        env={**ENV, **OFFLINE, "PYTHONPATH": str(shim.parent), "HF_MODULES_CACHE": str(tmp_path / "modules")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    loaded = load_model(grt_export)
    model, tok = loaded.model, loaded.tokenizer()
    ids = torch.tensor(res["ids"])
    assert ids[0].tolist() == [tok.sep_id] + tok.encode("ROMEO:")  # the separator as BOS, as grt generate feeds it
    idx = torch.tensor(res["idx"])
    for key, depth, strategy in (
        ("default", 3, "full"),
        ("depth=1", 1, "full"),
        ("depth=5", 5, "full"),
        ("kv_cache=average", 3, "average"),
    ):
        got = res[key]
        assert got["depth"] == depth
        with torch.no_grad():
            want = model(idx, n_loops=depth).logits
        assert (torch.tensor(got["logits"]) - want).abs().max().item() < 1e-4, key
        # generate() stops at the separator (config eos_token_id) as `grt generate --stop-at-separator` does
        new = generate(model, ids, 12, strategy=strategy, n_loops=depth, greedy=True, stop_id=tok.sep_id)
        assert got["cached"][0] == ids[0].tolist() + new[0].tolist(), key
        uncached = generate(model, ids, 12, n_loops=depth, use_cache=False, greedy=True, stop_id=tok.sep_id)
        assert got["uncached"][0] == ids[0].tolist() + uncached[0].tolist(), key
    cli = json.loads(
        grt(
            "generate",
            str(grt_export),
            "--prompt",
            "ROMEO:",
            "--greedy",
            "--max-new-tokens",
            "12",
            "--stop-at-separator",
            "--json",
        ).stdout
    )
    assert res["default"]["cached"][0] == ids[0].tolist() + cli["tokens"][0]  # the command itself, default strategy
    # the depths give different functions, so the comparisons above can tell them apart
    assert (torch.tensor(res["default"]["logits"]) - torch.tensor(res["depth=1"]["logits"])).abs().max() > 1e-2


def _real_texts() -> list[str]:
    texts = [p for p in DEMO_TEXT.read_text()[:60_000].split("\n\n") if p]
    lambada = SHARED / "data" / "eval" / "lambada_openai.jsonl"
    if lambada.exists():
        rows = [json.loads(line) for line in lambada.read_text().splitlines()[:200]]
        texts += [r["context"] + " " + r["continuation"] for r in rows]
    return texts + [
        "  two leading spaces\n\n\ttab",
        "bytes: \u00fcn\u00efc\u00f6d\u00e9 \U0001f389",
        "a literal <|endoftext|>",
    ]


def test_hf_tokenizer_gives_our_ids(grt_export, offline):
    """AutoTokenizer on the export: our ids with the separator as BOS (how grt eval and grt
    generate feed text), on real text; decode gives the text back."""
    from transformers import AutoTokenizer

    ours = load_model(grt_export).tokenizer()
    hf = AutoTokenizer.from_pretrained(str(grt_export / "hf"), trust_remote_code=True)
    texts = _real_texts()
    assert len(texts) > 300
    for text in texts:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == [ours.sep_id] + ids, text[:60]
        assert hf.decode(ids) == text
    assert hf.bos_token_id == hf.eos_token_id == ours.sep_id
    # without trust_remote_code transformers asks whether to run the folder's config code; unanswered
    # (no terminal), it loads the tokenizer all the same
    plain = AutoTokenizer.from_pretrained(str(grt_export / "hf"))
    assert plain(texts[0])["input_ids"] == hf(texts[0])["input_ids"]


@pytest.mark.parametrize("variant", ["huginn", "rrt", "ouro", "mor"])
def test_looped_baselines_load_with_transformers(variant, tmp_path, offline):
    """Every looped baseline gets the same remote code for free: its logits load equal, and
    generate() recomputes (the KV cache is for grt and dense)."""
    from transformers import AutoModelForCausalLM

    from pretrain.model import build_model
    from pretrain.model.hf import save_pretrained
    from pretrain.presets import get_preset

    torch.manual_seed(0)
    ours = build_model(get_preset(f"micro-{variant}").replace(vocab_size=64, max_seq_len=32)).eval()
    save_pretrained(ours, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.manual_seed(2)
        a = ours(idx).logits
        torch.manual_seed(2)
        b = hf(idx).logits
        assert (a - b).abs().max().item() < 1e-4
        assert hf.generate(idx[:1, :5], max_new_tokens=4, do_sample=False).shape == (1, 9)


@pytest.fixture
def small_hf(tmp_path, offline):
    """A small random GRT (1+2x3+1, vocab 64) saved as an hf/ directory and loaded by transformers."""
    from trained_models import small_model
    from transformers import AutoModelForCausalLM

    from pretrain.model.hf import save_pretrained

    save_pretrained(small_model("1+2x3+1"), tmp_path / "hf")
    return AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()


def test_hf_beam_search_and_padding(small_hf):
    """Beam search through the KV cache (its rows reordered per step) picks what it picks
    without a cache; left padding, which the model cannot honour, is one clear error."""
    hf = small_hf
    idx = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    beams = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(hf.generate(idx, **beams), hf.generate(idx, use_cache=False, **beams))
    mask = torch.ones_like(idx)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="left padding is not supported"):
        hf.generate(idx, attention_mask=mask, max_new_tokens=2)


def test_hf_right_padding_scores_but_is_refused_by_generate(small_hf):
    """A right-padded batch scores its real tokens as unpadded (causal attention); generate()
    would predict a shorter prompt's next token from a pad and append after the pads, so any
    padding there is one clear error, with or without the cache."""
    idx = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(idx)
    mask[1, -2:] = 0
    with torch.no_grad():
        assert torch.equal(small_hf(idx, attention_mask=mask).logits, small_hf(idx).logits)
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="generate one prompt at a time, or prompts of equal length"):
            small_hf.generate(idx, attention_mask=mask, max_new_tokens=2, use_cache=use_cache)
        assert small_hf.generate(
            idx, attention_mask=torch.ones_like(idx), max_new_tokens=2, use_cache=use_cache
        ).shape == (2, 8)


def test_hf_model_saves_and_reloads_with_its_code(tmp_path, offline):
    """A loaded export saved again by transformers (after fine-tuning, to push it) carries its
    vendored code along and keeps the depth it was given, the trained R recorded beside it."""
    from trained_models import small_model
    from transformers import AutoModelForCausalLM

    from pretrain.model.hf import save_pretrained

    save_pretrained(small_model("1+2x3+1"), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True, depth=2).eval()
    hf.save_pretrained(str(tmp_path / "again"))
    assert {"grt_gpt.py", "grt_layers.py", "grt_kv_cache.py"} <= {p.name for p in (tmp_path / "again").iterdir()}
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"), trust_remote_code=True).eval()
    assert (again.config.depth, again.config.trained_depth) == (2, 3)
    idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)


def test_a_module_imported_by_name_is_refused_before_it_breaks_the_remote_code():
    """transformers copies only the files that `from .x import` lines name, so a vendored
    `from pretrain.kernels import probe` would export a model that no longer loads: refused, naming the line."""
    from pathlib import Path

    from pretrain.model.hf import refuse_module_imports, vendored_sources

    names = "from pretrain.kernels.probe import FusedPath\nfrom pretrain.model_config import ModelConfig\n"
    refuse_module_imports(Path("ok.py"), names)
    with pytest.raises(RuntimeError, match=r"'from pretrain.kernels import probe' imports a module"):
        refuse_module_imports(Path("bad.py"), "from pretrain.kernels import probe as p\n")
    assert "grt_probe.py" in vendored_sources()  # the fused paths' trials travel with the model
