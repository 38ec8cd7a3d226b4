"""SentencePiece BPE tokenizer with byte fallback and a document separator.

The separator (``<|endoftext|>`` by default) is a SentencePiece *control* symbol: it has
an id, but encoding text never produces it, even when the text contains the literal
string ``<|endoftext|>``. A document boundary in the token stream therefore cannot be
forged by the data. ``decode`` renders it as the empty string (SentencePiece's rule for
control symbols); split a token sequence on ``sep_id`` to recover documents.

Normalisation is the identity (no NFKC, no whitespace collapsing, no dummy prefix), so
``decode(encode(text)) == text`` for any valid Unicode text: characters outside the
vocabulary fall back to their UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

from grt_common.files import atomic_write_bytes, check_output_path

DEFAULT_SEP_PIECE = "<|endoftext|>"
MAX_VOCAB_SIZE = 50257  # GPT-2's vocabulary size
# SentencePiece drops training sentences longer than max_sentence_length bytes; cut
# lines into pieces of at most this many characters (4 bytes per char worst case).
_TRAIN_PIECE_CHARS = 1000
_MAX_SENTENCE_BYTES = 4 * _TRAIN_PIECE_CHARS + 16


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """A trained SentencePiece model plus the id of its document separator."""

    def __init__(self, model_path: str, sep_piece: str | None = None) -> None:
        import sentencepiece as spm

        self.model_path = os.path.abspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"tokenizer model {model_path!r} not found")
        self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        self.vocab_size = int(self.sp.get_piece_size())
        self.sha256 = file_sha256(self.model_path)
        if sep_piece is not None:
            sep_id = self.sp.piece_to_id(sep_piece)
            if sep_id == self.sp.unk_id() and sep_piece != self.sp.id_to_piece(sep_id):
                raise ValueError(f"tokenizer {model_path!r} has no piece {sep_piece!r}")
        else:
            specials = {self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()}
            controls = [i for i in range(self.vocab_size) if self.sp.is_control(i) and i not in specials]
            if controls:
                sep_id = controls[0]
            elif self.sp.eos_id() >= 0:  # a model trained elsewhere: use </s>
                sep_id = self.sp.eos_id()
            else:
                raise ValueError(f"tokenizer {model_path!r} has no separator (control) symbol")
        self.sep_id = int(sep_id)
        self.sep_piece = self.sp.id_to_piece(self.sep_id)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (
            f"Tokenizer({os.path.basename(self.model_path)!r}, vocab_size={self.vocab_size}, "
            f"sep={self.sep_piece!r}:{self.sep_id}, sha256={self.sha256[:12]})"
        )


def load_tokenizer(model_path: str, sep_piece: str | None = None) -> Tokenizer:
    """`Tokenizer`, with a file that is not a SentencePiece model refused by a ``ValueError``
    naming it (SentencePiece says ``RuntimeError``)."""
    try:
        return Tokenizer(model_path, sep_piece=sep_piece)
    except RuntimeError as err:
        raise ValueError(f"tokenizer {model_path!r} is not a SentencePiece model ({err})") from None
    except IsADirectoryError:
        raise ValueError(f"tokenizer {model_path!r} is a directory, not a SentencePiece model") from None


def _training_pieces(doc: str) -> Iterator[str]:
    """Lines of a document, cut to lengths SentencePiece accepts as training sentences."""
    for line in doc.split("\n"):
        if not line.strip():
            continue
        while len(line) > _TRAIN_PIECE_CHARS:
            cut = line.rfind(" ", _TRAIN_PIECE_CHARS // 2, _TRAIN_PIECE_CHARS)
            cut = cut if cut > 0 else _TRAIN_PIECE_CHARS
            yield line[:cut]
            line = line[cut:]
        if line.strip():
            yield line


def sample_training_text(
    inputs: Sequence[str],
    max_chars: int,
    text_field: str = "text",
    txt_mode: str = "file",
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[str], dict[str, Any]]:
    """Pick a reproducible sample of at most ~max_chars characters of lines from the inputs.

    Two passes: the first counts the characters of the usable documents, the second keeps
    each line with probability max_chars / total (seeded), so the sample is spread over
    the whole input rather than taken from its beginning.
    Returns (sentences, info dict).
    """
    from tqdm import tqdm

    from .sources import SourceStats, check_readable, expand_inputs, iter_documents, iter_file_documents

    files = expand_inputs(inputs)
    for path in files:
        check_readable(path, text_field)
    stats = SourceStats()
    truncated: list[tuple[str, int]] = []  # (path, documents read up to the damage)
    with tqdm(desc="tokenizer: scan", unit="B", unit_scale=True, disable=not progress, file=sys.stderr) as bar:
        for path in files:
            fstats = SourceStats()
            for doc in iter_file_documents(path, text_field=text_field, txt_mode=txt_mode, stats=fstats):
                bar.update(len(doc))
            if fstats.truncated_files:
                truncated.append((path, fstats.documents))
            stats.add(fstats)
    if stats.documents == 0:
        raise ValueError(f"no usable documents in {list(inputs)} (stats: {stats.to_dict()})")
    for path, documents in truncated:  # after the refusal above, which says it in its one line
        print(
            f"tokenizer: warning: input {path!r} ends early or is damaged (compressed data cut short): "
            f"{documents} documents read up to the damage, the rest is lost",
            file=sys.stderr,
            flush=True,
        )
    rate = min(1.0, max_chars / max(1, stats.chars))
    rng = random.Random(seed)
    sentences: list[str] = []
    kept = 0
    with tqdm(
        total=stats.chars, desc="tokenizer: sample", unit="B", unit_scale=True, disable=not progress, file=sys.stderr
    ) as bar:
        for doc in iter_documents(files, text_field=text_field, txt_mode=txt_mode):
            for piece in _training_pieces(doc):
                if rate >= 1.0 or rng.random() < rate:
                    sentences.append(piece)
                    kept += len(piece)
            bar.update(len(doc))
            if kept >= max_chars:
                break
    info = {
        "files": files,
        "documents": stats.documents,
        "input_chars": stats.chars,
        "sample_chars": kept,
        "sample_sentences": len(sentences),
        "source_stats": stats.to_dict(),
    }
    return sentences, info


def train_tokenizer(
    inputs: Sequence[str],
    out: str,
    vocab_size: int = 32000,
    text_field: str = "text",
    txt_mode: str = "file",
    max_chars: int = 20_000_000,
    sep_piece: str = DEFAULT_SEP_PIECE,
    seed: int = 0,
    num_threads: int | None = None,
    character_coverage: float = 0.9995,
    progress: bool = True,
) -> Tokenizer:
    """Train a SentencePiece BPE model on a sample of ``inputs`` and write it to ``out``.

    ``out`` is the model file (``.model`` is appended if missing). The options, the output
    path and the inputs are checked first, and nothing (not even the folder) is written
    before the model is trained and loads; it is then written under a temporary name and
    renamed, so a refused run changes nothing and an interrupted one never leaves a
    truncated model. The same inputs and flags give a byte-identical model.
    """
    import sentencepiece as spm

    _check_options(vocab_size, max_chars, sep_piece, character_coverage, num_threads)
    if not out.endswith(".model"):
        out = out + ".model"
    check_output_path(out, "output model", is_dir=False)
    t0 = time.time()
    sentences, info = sample_training_text(
        inputs, max_chars, text_field=text_field, txt_mode=txt_mode, seed=seed, progress=progress
    )
    if progress:
        print(
            f"tokenizer: training BPE vocab={vocab_size} on {info['sample_chars']:,} chars "
            f"({info['sample_sentences']:,} lines) sampled from {info['input_chars']:,} chars "
            f"in {len(info['files'])} file(s)",
            file=sys.stderr,
            flush=True,
        )
    import io

    buf = io.BytesIO()
    # model_writer instead of model_prefix: the model bytes then do not depend on the
    # output path, so the same inputs and flags give the same file (and sha256).
    with _Heartbeat("tokenizer: train BPE", enabled=progress):
        _train(
            spm,
            sentence_iterator=iter(sentences),
            model_writer=buf,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=character_coverage,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0,
            bos_id=-1,
            eos_id=-1,
            pad_id=-1,
            control_symbols=[sep_piece],
            max_sentence_length=_MAX_SENTENCE_BYTES,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=num_threads or min(16, os.cpu_count() or 1),
            minloglevel=1 if progress else 2,
        )
    model = buf.getvalue()
    _check_model(model, sep_piece)
    # only now, with a complete model in hand, does the file system change
    parent = os.path.dirname(os.path.abspath(out))
    missing, folder = [], parent  # the folders made here, innermost first
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        atomic_write_bytes(out, model)
    except BaseException:  # a full disk, Ctrl-C: no folder made for a model that is not there
        for made in missing:
            if os.path.isdir(made) and not os.listdir(made):
                os.rmdir(made)
        raise
    tok = Tokenizer(out, sep_piece=sep_piece)
    if progress:
        print(
            f"tokenizer: wrote {out} ({tok.vocab_size} pieces, sep {sep_piece!r} = {tok.sep_id}, "
            f"sha256 {tok.sha256[:12]}) in {time.time() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return tok


def _check_options(
    vocab_size: int, max_chars: int, sep_piece: str, character_coverage: float, num_threads: int | None
) -> None:
    """Refuse a setting SentencePiece cannot train with, before the input is read."""
    checks = (
        (
            256 + 2 <= vocab_size <= MAX_VOCAB_SIZE,
            f"vocab_size must be in [258, {MAX_VOCAB_SIZE}] (256 byte pieces + unk + separator), got {vocab_size}",
        ),
        (max_chars >= 1, f"max_chars must be >= 1, got {max_chars}"),
        (bool(sep_piece), "sep_piece must not be empty"),
        (0.0 < character_coverage <= 1.0, f"character_coverage must be in (0, 1], got {character_coverage}"),
        (
            num_threads is None or num_threads >= 1,
            f"workers must be >= 1 (leave it out for the CPU count), got {num_threads}",
        ),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _check_model(model: bytes, sep_piece: str) -> None:
    """The trained model loads and has the separator (checked before it is written)."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_proto=model)
    except RuntimeError as err:
        raise ValueError(f"SentencePiece wrote a model it cannot load ({err})") from None
    if not sp.is_control(sp.piece_to_id(sep_piece)):
        raise ValueError(f"the trained model has no control symbol {sep_piece!r}")


def _train(spm: ModuleType, **kwargs: Any) -> None:
    try:
        spm.SentencePieceTrainer.train(**kwargs)
    except RuntimeError as exc:  # SentencePiece reports bad settings as RuntimeError
        raise ValueError(f"SentencePiece training failed: {exc}") from exc


class _Heartbeat:
    """A progress line that ticks every second while a blocking call runs."""

    def __init__(self, desc: str, enabled: bool = True) -> None:
        self.desc, self.enabled = desc, enabled

    def __enter__(self) -> _Heartbeat:
        import threading

        from tqdm import tqdm

        if not self.enabled:
            return self
        self._stop = threading.Event()
        self._bar = tqdm(desc=self.desc, unit="s", file=sys.stderr, bar_format="{desc}: {elapsed} elapsed")

        def tick() -> None:
            while not self._stop.wait(1.0):
                self._bar.update(1)

        self._thread = threading.Thread(target=tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self._bar.close()
