"""The Hugging Face folder of an export (<export>/hf/): our SentencePiece tokenizer as a transformers
one, checked to give our ids, then the model beside it (pretrain/model/hf.py, which needs only the
separator's id: the model never reads the data side).

transformers converts our SentencePiece BPE into a `tokenizers` one; it prepends the document
separator as BOS, as `grt eval` and `grt generate` do, and never makes a separator out of text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from data_pipeline.tokenizer import Tokenizer
from grt_common.errors import ConfigError
from pretrain.model.gpt import GPT
from pretrain.model.hf import save_pretrained


def save_hf(model: GPT, directory: Path, tokenizer: Path | None) -> None:
    """<export>/hf/: the HF tokenizer of `tokenizer` (our SentencePiece model) when given, then the model."""
    sep_id = None
    if tokenizer is not None:  # first: with config.json there, AutoTokenizer would ask to run its code
        sep_id = save_tokenizer(tokenizer, directory, model.cfg.max_seq_len)
    save_pretrained(model, directory, sep_id)


# probes of the tokenizer conversion: spaces, newlines, digits, punctuation, bytes beyond the vocabulary
_PROBES = (
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "  two spaces,\ttab; 3.14 + 42 = x",
    "Ünïcödé and emoji \U0001f389 fall back to bytes",
    "a literal <|endoftext|> is text",
    "",
)


def save_tokenizer(model_file: Path, directory: Path, max_len: int) -> int:
    """Our SentencePiece tokenizer as a transformers one in `directory` (tokenizer.json, its
    config and the .model itself); checked to give our ids on probe texts. Returns the BOS id
    (the document separator)."""
    from transformers import AutoTokenizer

    ours = Tokenizer(str(model_file))
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_file, directory / "tokenizer.model")
    # transformers converts a SentencePiece BPE .model into a `tokenizers` BPE (TokenizersBackend)
    # offline; split_special_tokens keeps a literal separator in text from becoming the separator
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ours.sep_piece,
        "eos_token": ours.sep_piece,
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "model_max_length": max_len,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    AutoTokenizer.from_pretrained(str(directory)).save_pretrained(str(directory))  # adds tokenizer.json:
    saved = json.loads((directory / "tokenizer_config.json").read_text())  # later loads need no conversion
    for key in ("is_local", "local_files_only"):  # how this load was made, not true of the folder once shared
        saved.pop(key, None)
    (directory / "tokenizer_config.json").write_text(json.dumps(saved, indent=2) + "\n")
    hf = AutoTokenizer.from_pretrained(str(directory))  # what later loads get, checked against ours
    for text in _PROBES:
        got, want = hf(text)["input_ids"], [ours.sep_id] + ours.encode(text)
        if got != want:
            raise ConfigError(f"the Hugging Face conversion of {model_file} encodes {text!r} as {got}, ours as {want}")
    return ours.sep_id
