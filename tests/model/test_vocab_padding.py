"""The padded vocabulary (ModelConfig.pad_vocab_multiple, pretrain/model_config.py): every preset trains
the head at a multiple of 64 rows; what a user sees (logits, generated and sampled tokens, scores,
the Hugging Face export) has the real vocabulary; a model saved unpadded (before the change) still
loads and runs."""

import pytest
import torch
from trained_models import write_export

from pretrain.infer.evaluation.scoring import lm_sums
from pretrain.infer.generate import generate
from pretrain.infer.load import load_model
from pretrain.model import build_model
from pretrain.model.layers import AttentionContext
from pretrain.model.loss import lm_loss
from pretrain.model_config import VOCAB_PAD_MULTIPLE, ModelConfig
from pretrain.presets import PRESETS

VOCAB = 97  # padded to 128


def test_every_preset_pads_its_vocabulary_to_the_one_multiple():
    assert ModelConfig().pad_vocab_multiple == VOCAB_PAD_MULTIPLE == 64
    for name, cfg in PRESETS.items():
        assert cfg.pad_vocab_multiple == VOCAB_PAD_MULTIPLE, name
        assert cfg.padded_vocab_size % 64 == 0 and 0 <= cfg.padded_vocab_size - cfg.vocab_size < 64, name
    assert PRESETS["dense-small"].padded_vocab_size == 50304 == PRESETS["grt-small"].padded_vocab_size


def _model(variant: str, **kw) -> torch.nn.Module:
    """A model whose padded rows would win every argmax and most of the softmax if they took part."""
    layout = "1+1x2+1" if variant == "grt" else "3"
    cfg = ModelConfig(variant=variant, layout=layout, d_model=32, n_heads=2, vocab_size=VOCAB, max_seq_len=32, **kw)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # each padded row a real row's 8x: its logit 8x that token's
        model.wte.weight[VOCAB:] = 8 * model.wte.weight[: 128 - VOCAB]
    return model


@pytest.mark.parametrize("variant", ["grt", "dense"])
def test_logits_tokens_scores_and_the_loss_have_the_real_vocabulary(variant):
    model = _model(variant, state_noise_std=0.0, gate_noise_std=0.0)
    assert model.lm_head.weight.shape[0] == 128
    idx = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        padded = model.lm_head(model.final_hidden(model.embed(idx), AttentionContext()))
    assert padded.shape[-1] == 128 and (padded.argmax(-1) >= VOCAB).float().mean() > 0.5  # the trap is set
    out = model(idx, idx)
    assert out.logits.shape[-1] == VOCAB
    # the training loss (no logits, padded rows masked) equals the plain loss on the sliced logits
    assert torch.allclose(model(idx, idx, return_logits=False).loss, lm_loss(out.logits, idx), atol=1e-6)
    for greedy in (True, False):  # `grt generate`: argmax and sampling
        new = generate(model, idx, 6, greedy=greedy, seed=0)
        assert int(new.max()) < VOCAB, (greedy, new)
    # `grt eval`'s sums: the real vocabulary's cross-entropy
    depth = [model.max_loops] if model.loop is not None else [0]
    sums = lm_sums(model, [{"input_ids": idx, "targets": idx}], depth, torch.device("cpu"))
    assert torch.allclose(sums[0, 0] / sums[0, 1], lm_loss(out.logits, idx).double(), atol=1e-5)


def test_the_hugging_face_export_has_the_real_vocabulary_and_imports_back_padded():
    pytest.importorskip("transformers")
    from pretrain.model.hf import from_hf, to_hf

    model = _model("dense", bias=True)
    hf = to_hf(model).eval()
    assert hf.transformer.wte.weight.shape[0] == VOCAB and hf.config.vocab_size == VOCAB
    idx = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        ours, theirs = model(idx).logits, hf(idx).logits
        back = from_hf(hf).eval()
        assert back.lm_head.weight.shape[0] == 128 and back.cfg.padded_vocab_size == 128
        again = back(idx).logits
    assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(ours, again, atol=1e-5)


@pytest.mark.parametrize("variant", ["grt", "dense"])
def test_a_model_saved_unpadded_before_the_change_still_loads_and_runs(tmp_path, variant):
    """Before the padding had one home, a dense config saved `pad_vocab_multiple: 1` with weights of
    the real vocabulary's rows: such an export loads as it was, generates and trains."""
    layout = "1+1x2+1" if variant == "grt" else "3"
    old = ModelConfig(
        variant=variant, layout=layout, d_model=32, n_heads=2, vocab_size=VOCAB, max_seq_len=32, pad_vocab_multiple=1
    )
    torch.manual_seed(0)
    saved = build_model(old).eval()
    out = write_export(saved, tmp_path / "old-export")
    assert '"pad_vocab_multiple": 1' in (out / "config.json").read_text()
    loaded = load_model(out).model
    assert loaded.lm_head.weight.shape[0] == VOCAB == loaded.cfg.padded_vocab_size
    idx = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, saved(idx).logits)
    assert int(generate(loaded, idx, 4, greedy=True).max()) < VOCAB
    loaded.train()
    loss = loaded(idx, idx, return_logits=False).loss
    loss.backward()
    assert torch.isfinite(loss) and loaded.lm_head.weight.grad is not None
