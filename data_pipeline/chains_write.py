"""`grt data chains`: the chains task (data_pipeline/chains.py) written as a data set like any
other: a SentencePiece model with one piece per symbol, WebDataset shards of fixed-length samples
and a manifest (the writer and the manifest of `prepare`), so every training feature works on it.

Each sequence holds one sample, padded; sequence i's last token is sequence i + 1's separator
(as `prepare` packs a token stream). With ``loss_on="answers"`` each sample carries a loss mask
(data_pipeline/shards.py) that scores its answer tokens only: the answers-only loss the task
learns from at CPU scale (docs/comparison.md). The validation split may draw k from its own range
(``val_task``: chains longer than training's); `score_positions` recovers every query's k from the
tokens, so `grt eval --tasks chains` splits it by k with no side file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sys
import time
from dataclasses import asdict

import numpy as np

from grt_common.errors import Interrupted
from grt_common.files import check_output_path

from .chains import END, ChainTask, padded, sample, symbols
from .manifest import MANIFEST_NAME, Manifest, manifest_dict
from .prepare_encode import Packer
from .prepare_output import TOKENIZER_NAME, OutputDir, prepare_identity
from .shards import ext_for_vocab, sample_stride
from .tokenizer import Tokenizer, file_sha256


def tokenizer_model(task: ChainTask) -> bytes:
    """A SentencePiece model whose pieces are ``<unk>`` and the task's symbols, the separator a
    control symbol (trained on the symbols alone, so BPE learns nothing else; checked)."""
    import sentencepiece as spm

    sep, *pieces = symbols(task)
    text = END.join(pieces)  # each symbol followed by ';', as in the task: one way to split it
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([text]),
        model_writer=buf,
        model_type="bpe",
        vocab_size=len(pieces) + 2,
        user_defined_symbols=pieces,
        control_symbols=[sep],
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    model = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=model)
    got = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if got != ["<unk>", sep, *pieces] or sp.encode(text, out_type=str) != [t for p in pieces for t in (p, END)][:-1]:
        raise ValueError(f"SentencePiece made a tokenizer with other pieces than the task's: {got}")
    return model


def token_ids(task: ChainTask) -> dict[str, int]:
    """Each symbol's id in `tokenizer_model` (its order: <unk>, then the symbols)."""
    return {s: i + 1 for i, s in enumerate(symbols(task))}


LOSS_ON = ("all", "answers")  # what `grt data chains --loss-on` trains: every token, or the answers only


def sample_stream(
    task: ChainTask, n: int, seq_len: int, rng: random.Random, ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples padded to ``seq_len``, one after the other: the token stream `Packer` cuts
    into sequences of ``seq_len + 1`` (each sample and the separator of the next), and each token's
    answer bit (set on every query's answer token)."""
    out = np.empty(n * seq_len, dtype=np.uint32)
    answers = np.zeros(n * seq_len, dtype=bool)
    for i in range(n):
        drawn = sample(task, rng)
        out[i * seq_len : (i + 1) * seq_len] = [ids[t] for t in padded(drawn.tokens, seq_len)]
        answers[[i * seq_len + pos for pos, _ in drawn.answers]] = True
    return out, answers


def write_chains(
    out_dir: str,
    task: ChainTask,
    train_samples: int,
    val_samples: int,
    seq_len: int | None = None,
    val_task: ChainTask | None = None,
    shard_size_mb: float = 64.0,
    progress: bool = True,
    loss_on: str = "all",
    overwrite: bool = False,
) -> Manifest:
    """Write the task's tokenizer, shards and manifest under ``out_dir``; returns the manifest.
    ``seq_len`` defaults to the longest sample of either split; ``val_task`` (default: ``task``)
    sets the validation split's hops; ``loss_on`` (LOSS_ON): ``answers`` writes loss masks that
    score the answers only, in both splits (validation loss is then answer loss). A folder written
    before is replaced only once the new run is complete (`OutputDir`); one that holds anything but
    this task's own output only with ``overwrite``."""
    t0 = time.time()
    val_task = val_task or task
    task.check()
    val_task.check("val_max_hops")
    longest = max(task.max_length, val_task.max_length if val_samples else 0)
    seq_len = longest if seq_len is None else seq_len
    if seq_len < longest:
        raise ValueError(
            f"seq_len {seq_len} is too short for a sample of up to {longest} tokens: pass --seq-len >= {longest}, "
            "fewer --chains or fewer --max-hops"
        )
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    masked = loss_on == "answers"
    if train_samples < 1 or val_samples < 0:
        raise ValueError(f"train samples must be >= 1 and val samples >= 0, got {train_samples} and {val_samples}")
    check_output_path(out_dir, "output folder", is_dir=True)
    model = tokenizer_model(task)
    ids = token_ids(task)
    ext = ext_for_vocab(len(ids) + 1)
    per_shard = max(1, int(shard_size_mb * 1e6) // sample_stride(seq_len + 1, ext, masked))
    options = {"chains": asdict(task), "val_chains": asdict(val_task), "seq_len": seq_len}
    options |= {"loss_on": loss_on} if masked else {}
    # this command's own output again (the same task) is no other output; anything else needs --overwrite
    out = OutputDir(out_dir, prepare_identity([], options, hashlib.sha256(model).hexdigest()), overwrite)
    try:
        out.open()
        out.put_bytes(TOKENIZER_NAME, model)
        tok = Tokenizer(os.path.join(out_dir, TOKENIZER_NAME))
        splits = {}
        for split, n, t in (("train", train_samples, task), ("val", val_samples, val_task)):
            if n == 0:
                continue
            packer = Packer(split, out, seq_len, per_shard, ext, masked)
            rng = random.Random(f"chains:{task.seed}:{split}")  # the splits draw from separate streams
            for start in range(0, n, per_shard):  # a shard's samples at a time: memory stays one shard's
                m = min(per_shard, n - start)
                tokens, answers = sample_stream(t, m, seq_len, rng, ids)
                packer.add(tokens, m, answers if masked else None)
            last = np.array([tok.sep_id], dtype=np.uint32)  # the last sequence's last target
            packer.add(last, 0, np.zeros(1, dtype=bool) if masked else None)
            packer.finish()
            splits[split] = packer.entries
        doc = manifest_dict(
            seq_len=seq_len,
            vocab_size=tok.vocab_size,
            sep_id=tok.sep_id,
            sep_piece=tok.sep_piece,
            ext=ext,
            tokenizer_name=TOKENIZER_NAME,
            tokenizer_sha256=file_sha256(tok.model_path),
            splits=splits,
            sources=[],
            stats={"samples_per_split": {"train": train_samples, "val": val_samples}},
            options=options,
            loss_mask="bits" if masked else "",
        )
        out.put_bytes(MANIFEST_NAME, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        manifest = Manifest.load(os.path.join(out_dir, MANIFEST_NAME))
    except (Exception, Interrupted):
        problems = out.rollback()
        if problems:
            print(f"chains: could not restore {out_dir!r}: {'; '.join(problems)}", file=sys.stderr, flush=True)
        raise
    except BaseException:
        out.unlock()
        raise
    out.commit(keep={e["name"] for entries in splits.values() for e in entries})
    if progress:
        print(
            f"chains: {train_samples:,} train / {val_samples:,} val samples of seq_len {seq_len} "
            f"(k {task.min_hops}..{task.max_hops}, val k {val_task.min_hops}..{val_task.max_hops}, "
            f"{task.chains_per_sample} chains a sample, vocab {tok.vocab_size}, loss on {loss_on}) "
            f"in {time.time() - t0:.1f}s; "
            f"manifest {manifest.path}",
            file=sys.stderr,
            flush=True,
        )
    return manifest
