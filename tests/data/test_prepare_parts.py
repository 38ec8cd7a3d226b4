"""`grt data prepare --part i/N` + `grt data join` (issue 42): three parts give the documents and
tokens of one prepare of the same input, the join is deterministic, and a missing part is named
while nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from multiproc import grt

from data_pipeline.manifest import Manifest
from data_pipeline.prepare import prepare
from data_pipeline.shards import DTYPES, iter_shard

SEQ = 16


def _streams(m: Manifest, split: str) -> dict[str, np.ndarray]:
    """Each packed token stream of a split, by folder (one per part): samples overlap by one token."""
    out: dict[str, list[np.ndarray]] = {}
    for s in m.shards(split):
        folder = os.path.dirname(s.name)
        for _, data in iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext):
            sample = np.frombuffer(data, DTYPES[m.ext])
            out.setdefault(folder, []).append(sample[1:] if out.get(folder) else sample)
    return {k: np.concatenate(v) for k, v in out.items()}


def test_three_parts_give_the_documents_and_tokens_of_one_prepare(shards, demo_text, tmp_path, monkeypatch):
    tokenizer = str(Path(shards).parent / "tokenizer.model")
    paragraphs = [p for p in demo_text.read_text().split("\n\n") if p.strip()][:1500]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(7):  # 7 files over 3 parts: 2, 2 and 3 files
        with open(corpus / f"f{i}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs[i::7])
    common = {"seq_len": SEQ, "shard_size_mb": 0.05, "workers": 1, "val_fraction": 0.1, "progress": False}
    one = prepare([str(corpus)], tokenizer, str(tmp_path / "one"), **common)
    out = tmp_path / "parts"
    prepare([str(corpus)], tokenizer, str(out), part=(0, 3), **common)
    args = ["data", "prepare", "-i", str(corpus), "-t", tokenizer, "-o", str(out), "--seq-len", str(SEQ)]
    args += ["--shard-size-mb", "0.05", "--workers", "1", "--val-fraction", "0.1", "-q"]
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")  # task 2 of `sbatch --array=0-2`
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    r = grt(*args, "--part", "slurm")
    assert r.returncode == 0, r.stderr

    r = grt("data", "join", str(out))  # part 1 has not run
    assert r.returncode == 2 and "part 1/3 is missing" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (out / "manifest.json").exists()

    prepare([str(corpus)], tokenizer, str(out), part=(1, 3), **common)
    r = grt("data", "join", str(out))
    assert r.returncode == 0, r.stderr
    first = (out / "manifest.json").read_bytes()
    assert grt("data", "join", str(out), "--parts", "3").returncode == 0
    assert (out / "manifest.json").read_bytes() == first  # deterministic
    joined = Manifest.load(str(out))
    assert joined.fingerprint("train") != one.fingerprint("train")

    assert joined.stats["documents_per_split"] == one.stats["documents_per_split"]
    assert joined.stats["stream_tokens_per_split"] == one.stats["stream_tokens_per_split"]
    assert joined.stats["documents"] == one.stats["documents"] == 1500
    for split in ("train", "val"):
        whole = next(iter(_streams(one, split).values()))
        parts = _streams(joined, split)
        assert sorted(parts) == [f"part-0000{i}-of-00003" for i in range(3)]
        offset = 0
        for name in sorted(parts):
            stream = parts[name]
            shared = whole[offset : offset + len(stream)]
            assert np.array_equal(stream[: len(shared)], shared), (split, name)
            full = Manifest.load(str(out / name)).stats["stream_tokens_per_split"][split]
            assert full - len(stream) <= SEQ  # a part drops less than one sample at its end
            offset += full
        assert offset == len(whole) + one.stats["dropped_tail_tokens"][split]
