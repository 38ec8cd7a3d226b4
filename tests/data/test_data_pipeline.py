"""Tests of data_pipeline: tokenizer, sources, shard preparation and the streaming loader.

All on real text: a slice of examples/data/tinyshakespeare.txt (shipped in the repo),
copied into temporary directories.
"""

import collections
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import tarfile
import warnings

import numpy as np
import pytest
import torch

from data_pipeline import shards as shards_mod
from data_pipeline.loader import TokenBatchLoader
from data_pipeline.manifest import Manifest
from data_pipeline.prepare import prepare
from data_pipeline.shards import MissingShardError, ShardError
from data_pipeline.sources import SourceStats, expand_inputs, iter_documents
from data_pipeline.tokenizer import file_sha256, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAKESPEARE = os.path.join(REPO, "examples", "data", "tinyshakespeare.txt")
SEQ = 32


def _paragraphs(n_chars):
    with open(SHAKESPEARE, encoding="utf-8") as fh:
        text = fh.read(n_chars)
    paras = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    return paras[:-1]  # the last one may be cut mid-paragraph


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text as JSON lines (one speech per document) and as paragraph .txt."""
    d = tmp_path_factory.mktemp("corpus")
    paras = _paragraphs(120_000)
    half = len(paras) // 2
    with open(d / "a.jsonl", "w", encoding="utf-8") as fh:
        for p in paras[:half]:
            fh.write(json.dumps({"text": p, "id": "x"}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        for p in paras[half:]:
            fh.write(json.dumps({"text": p}) + "\n")
    return {"dir": str(d), "docs": paras}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("tok") / "tok.model"
    return train_tokenizer([corpus["dir"]], str(out), vocab_size=400, max_chars=200_000, progress=False)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, corpus, tokenizer):
    """5 train shards (the last one smaller) of SEQ-token sequences."""
    out = tmp_path_factory.mktemp("shards")
    probe = prepare(
        [corpus["dir"]], tokenizer.model_path, str(out), seq_len=SEQ, shard_size_mb=100, workers=1, progress=False
    )
    n = probe.sequences("train")
    per = -(-n // 5)  # ceil: 4 full shards and a smaller fifth
    size_mb = per * shards_mod.member_size(SEQ + 1, "u16") / 1e6
    m = prepare(
        [corpus["dir"]],
        tokenizer.model_path,
        str(out),
        seq_len=SEQ,
        shard_size_mb=size_mb + 1e-9,
        workers=2,
        progress=False,
        overwrite=True,  # the probe's output, replaced by design
    )
    assert len(m.shards("train")) == 5, [s.sequences for s in m.shards("train")]
    return m


def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _all_samples(m, split="train"):
    out = []
    for s in m.shards(split):
        out += [bytes(d) for _, d in shards_mod.iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext)]
    return out


def _rows(batch):
    x = torch.cat([batch["input_ids"], batch["targets"][:, -1:]], dim=1)
    return [r.numpy().astype("<u2").tobytes() for r in x]


# -- tokenizer -------------------------------------------------------------------------


def test_tokenizer_round_trip_and_separator(tokenizer, tmp_path, corpus):
    texts = [
        "First Citizen:\nBefore we proceed any further, hear me speak.",
        "  leading spaces,\ttabs\n\n\nand blank lines  ",
        "unicode: naïve café — “quotes” 日本語 🤖",
        "a literal <|endoftext|> in the text is not a separator",
    ]
    for t in texts:
        ids = tokenizer.encode(t)
        assert tokenizer.decode(ids) == t
        assert tokenizer.sep_id not in ids
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.vocab_size == 400
    assert tokenizer.sp.id_to_piece(tokenizer.sep_id) == "<|endoftext|>"
    assert tokenizer.sha256 == hashlib.sha256(open(tokenizer.model_path, "rb").read()).hexdigest()
    again = train_tokenizer(
        [corpus["dir"]], str(tmp_path / "again.model"), vocab_size=400, max_chars=200_000, progress=False
    )
    assert again.sha256 == tokenizer.sha256  # same inputs and flags -> same model bytes
    from data_pipeline.tokenizer import sample_training_text

    sample, info = sample_training_text([corpus["dir"]], max_chars=20_000, seed=1, progress=False)
    assert 15_000 < info["sample_chars"] <= 21_000 and info["input_chars"] > 100_000
    assert len({s for s in sample} & set(corpus["docs"][-200:])) > 0  # spread over the input, not its start
    with pytest.raises(ValueError, match="50257"):
        train_tokenizer([corpus["dir"]], str(tmp_path / "big.model"), vocab_size=50258, progress=False)


# -- sources ---------------------------------------------------------------------------


def test_bad_documents_are_skipped_and_counted(tmp_path, corpus, tokenizer):
    import zstandard

    good = corpus["docs"][:6]
    lines = [
        json.dumps({"text": good[0]}).encode(),
        json.dumps({"text": ""}).encode(),  # empty
        json.dumps({"text": "  \n\t "}).encode(),  # whitespace only = empty
        b'{"text": "caf\xe9 latin-1 bytes"}',  # not UTF-8
        json.dumps({"text": "lone surrogate \ud800 here"}).encode(),  # not encodable as UTF-8
        b'{"text": "unterminated',  # malformed JSON
        json.dumps({"body": good[1]}).encode(),  # no text field
        json.dumps({"text": good[2]}).encode(),
    ]
    raw = b"\n".join(lines) + b"\n"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.jsonl").write_bytes(raw)
    (tmp_path / "in" / "y.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "in" / "z.txt").write_bytes(good[3].encode() + b"\n\n" + b"\xff\xfe broken\n\n" + good[4].encode())
    (tmp_path / "in" / "ignored.csv").write_text("not an input")
    files = expand_inputs([str(tmp_path / "in")])
    assert [os.path.basename(f) for f in files] == ["x.jsonl", "y.jsonl.zst", "z.txt"]
    stats = SourceStats()
    docs = list(iter_documents(files, txt_mode="paragraph", stats=stats))
    assert docs == [good[0], good[2], good[0], good[2], good[3], good[4]]
    assert (
        stats.documents,
        stats.skipped_empty,
        stats.skipped_non_utf8,
        stats.skipped_bad_json,
        stats.skipped_missing_field,
    ) == (6, 4, 5, 2, 2)
    # txt as one document per file: the invalid byte loses the whole file
    stats = SourceStats()
    assert list(iter_documents(files[2:], txt_mode="file", stats=stats)) == []
    assert stats.skipped_non_utf8 == 1
    m = prepare(
        [str(tmp_path / "in")],
        tokenizer.model_path,
        str(tmp_path / "out"),
        seq_len=8,
        workers=1,
        txt_mode="paragraph",
        progress=False,
    )
    assert m.stats["skipped_non_utf8"] == 5 and m.stats["skipped_empty"] == 4 and m.stats["documents"] == 6
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        expand_inputs([str(tmp_path / "nothing-here*.jsonl")])


# -- prepare + loader round trip ---------------------------------------------------------


def test_round_trip_text_tokens_shards_batches_text(shards, corpus, tokenizer):
    m = shards
    assert m.tokenizer_sha256 == tokenizer.sha256 and file_sha256(m.tokenizer_path) == tokenizer.sha256
    assert os.path.dirname(m.tokenizer_path) == os.path.dirname(m.path)  # travels with the shards
    assert m.sep_id == tokenizer.sep_id and m.vocab_size == tokenizer.vocab_size and m.seq_len == SEQ
    loader = TokenBatchLoader(m.path, micro_batch_size=3, shuffle_buffer=0, shuffle_shards=False, loop=False)
    assert loader.batches_per_epoch == m.sequences("train") // 3
    rows = []
    for b in loader:
        assert b["input_ids"].dtype == torch.long and b["targets"].dtype == torch.long
        assert b["doc_ids"].dtype == torch.int32 and b["input_ids"].shape == (3, SEQ) == b["doc_ids"].shape
        assert torch.equal(b["input_ids"][:, 1:], b["targets"][:, :-1])
        sep = (b["input_ids"] == m.sep_id).int()
        expect = torch.cumsum(sep, 1) - sep[:, :1]
        assert torch.equal(b["doc_ids"], expect)
        rows += [r for r in torch.cat([b["input_ids"], b["targets"][:, -1:]], 1)]
    # consecutive samples overlap by one token: rebuild the token stream
    stream = [rows[0][0].item()] + [t for r in rows for t in r[1:].tolist()]
    assert stream[0] == m.sep_id  # a separator before every document
    pieces = []
    cur = []
    for t in stream[1:]:
        if t == m.sep_id:
            pieces.append(cur)
            cur = []
        else:
            cur.append(t)
    decoded = [tokenizer.decode(p) for p in pieces]
    docs = corpus["docs"]  # files are read in sorted order: a.jsonl then b.jsonl.gz, lines in order
    assert len(decoded) > 20
    assert decoded == docs[: len(decoded)]
    assert docs[len(decoded)].startswith(tokenizer.decode(cur))  # the cut last document


def test_shards_readable_by_plain_webdataset_and_tar(shards):
    import webdataset as wds

    m = shards
    s = m.shards("train")[1]
    samples = list(wds.WebDataset(s.url, shardshuffle=False))
    assert len(samples) == s.sequences
    first = samples[0]
    assert first["__key__"] == "train-000001_0000000" and set(first) >= {"__key__", "u16"}
    arr = np.frombuffer(first["u16"], "<u2")
    assert arr.shape == (SEQ + 1,) and arr.max() < m.vocab_size
    with tarfile.open(s.url) as tf:
        names = tf.getnames()
        infos = tf.getmembers()
        assert {(i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) for i in infos} == {(0, 0, 0, "", "", 0o644)}
        assert names[:2] == ["train-000001_0000000.u16", "train-000001_0000001.u16"]
        assert tf.extractfile(names[0]).read() == first["u16"]
    if shutil.which("tar"):
        listing = subprocess.run(["tar", "tf", s.url], check=True, capture_output=True, text=True).stdout.split()
        assert listing == names
    assert hashlib.sha256(open(s.url, "rb").read()).hexdigest() == s.sha256


# -- distribution across ranks and workers ------------------------------------------------


@pytest.mark.parametrize("world,workers,batch", [(2, 2, 4), (3, 2, 5), (2, 3, 7)])
def test_ranks_x_workers_disjoint_covering_equal(shards, world, workers, batch):
    m = shards
    all_samples = collections.Counter(_all_samples(m))
    n = sum(all_samples.values())
    assert n == m.sequences("train")
    seen = collections.Counter()
    counts = []
    for rank in range(world):
        loader = TokenBatchLoader(
            m.path,
            micro_batch_size=batch,
            rank=rank,
            world_size=world,
            num_workers=workers,
            seed=7,
            shuffle_buffer=50,
            loop=False,
        )
        got = [r for b in loader for r in _rows(b)]
        counts.append((loader.batches_per_epoch, len(got)))
        seen.update(got)
    k = n // (world * batch)
    assert counts == [(k, k * batch)] * world  # every rank: the same number of batches
    assert not (seen - all_samples)  # disjoint: nothing read more often than it is stored
    assert n - sum(seen.values()) < world * batch  # covering: only the remainder is left out


def _two_shard_mb(m):
    per = -(-m.sequences("train") // 2)
    return per * shards_mod.member_size(SEQ + 1, "u16") / 1e6 + 1e-9


def test_more_consumers_than_shards(tmp_path, corpus, tokenizer, shards):
    m = prepare(
        [corpus["dir"]],
        tokenizer.model_path,
        str(tmp_path / "s"),
        seq_len=SEQ,
        shard_size_mb=_two_shard_mb(shards),
        workers=1,
        progress=False,
    )
    assert len(m.shards("train")) == 2
    all_samples = collections.Counter(_all_samples(m))
    seen = collections.Counter()
    per_rank = []
    for rank in range(3):  # 3 ranks x 2 workers = 6 consumers on 2 shards
        loader = TokenBatchLoader(
            m.path, micro_batch_size=4, rank=rank, world_size=3, num_workers=2, seed=3, loop=False
        )
        batches = list(loader)
        per_rank.append(len(batches))
        seen.update(r for b in batches for r in _rows(b))
    assert per_rank == [m.sequences("train") // 12] * 3
    assert not (seen - all_samples)
    assert sum(seen.values()) == per_rank[0] * 12


def test_epochs_reshuffle_and_validation_passes_repeat(shards):
    m = shards
    loader = TokenBatchLoader(m.path, micro_batch_size=4, seed=1, shuffle_buffer=64, loop=True)
    it = iter(loader)
    k = loader.batches_per_epoch
    e0 = [next(it)["input_ids"] for _ in range(k)]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch_in_epoch"] == 0
    e1 = [next(it)["input_ids"] for _ in range(k)]
    assert not all(torch.equal(a, b) for a, b in zip(e0, e1))  # a new order every epoch
    val = TokenBatchLoader(m.path, micro_batch_size=4, seed=1, loop=False)
    p1 = [b["input_ids"] for b in val]
    p2 = [b["input_ids"] for b in val]
    assert len(p1) == val.batches_per_epoch == len(p2) and all(torch.equal(a, b) for a, b in zip(p1, p2))
    too_big = shards.sequences("train") // 2 + 1  # not one batch per rank for 2 ranks
    with pytest.raises(ValueError, match="fewer than one batch per rank"):
        TokenBatchLoader(m.path, micro_batch_size=too_big, world_size=2, loop=True)
    with pytest.warns(RuntimeWarning, match="0 batches"):
        empty = TokenBatchLoader(m.path, micro_batch_size=too_big, world_size=2, rank=1, loop=False)
    assert empty.batches_per_epoch == 0 and list(empty) == []


# -- exact resume -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_and_across_epoch_boundary(shards, workers):
    m = shards
    kw = dict(micro_batch_size=4, rank=1, world_size=2, num_workers=workers, seed=11, shuffle_buffer=37)
    ref = TokenBatchLoader(m.path, **kw)
    k = ref.batches_per_epoch
    total = k + 5  # into the second epoch
    # mid-epoch at both parities (worker round-robin phase), and one batch before the epoch ends
    cut_points = {k // 3, k // 3 + 1, k - 1}
    states, seq = {}, []
    it = iter(ref)
    for i in range(total):
        seq.append(next(it))
        if i + 1 in cut_points:
            states[i + 1] = json.loads(json.dumps(ref.state_dict()))  # must survive a JSON checkpoint
    for done, state in states.items():
        assert state["epoch"] == 0 and state["batch_in_epoch"] == done and state["samples_consumed"] == done * 4
        resumed = TokenBatchLoader(m.path, **kw)
        resumed.load_state_dict(state)
        it2 = iter(resumed)
        for i in range(done, total):
            b = next(it2)
            for key in ("input_ids", "targets", "doc_ids"):
                assert torch.equal(b[key], seq[i][key]), (done, i, key)
        assert resumed.state_dict() == ref.state_dict()


@pytest.mark.parametrize("workers", [2, 3])
def test_loader_workers_live_across_epochs_and_give_the_in_process_order(shards, workers):
    """A looping loader's workers start once, not at every epoch (a restart put the workers' start,
    and their first reads, inside a training step at each epoch's end): the same worker processes
    from the first epoch to the fourth, and the batches those made in this process, across epochs
    whose length is not a multiple of the workers (the round-robin carries over the boundary)."""
    kw = dict(micro_batch_size=4, rank=1, world_size=2, seed=11, shuffle_buffer=37)
    ref = TokenBatchLoader(shards.path, num_workers=0, **kw)
    k = ref.batches_per_epoch
    before = {p.pid for p in multiprocessing.active_children()}
    loader = TokenBatchLoader(shards.path, num_workers=workers, **kw)
    it, it_ref = iter(loader), iter(ref)
    pids = []
    for i in range(3 * k + 2):
        b, want = next(it), next(it_ref)
        assert all(torch.equal(b[key], want[key]) for key in ("input_ids", "targets", "doc_ids")), i
        if i % k == 1:  # just past each epoch's start
            pids.append(sorted(p.pid for p in multiprocessing.active_children() if p.pid not in before))
    assert k % workers or workers == 3, k
    assert len(pids) == 4 and len(pids[0]) == workers and all(p == pids[0] for p in pids), pids
    assert {**loader.state_dict(), "num_workers": 0} == ref.state_dict()


def test_resume_with_another_layout_warns_and_keeps_the_position(shards):
    a = TokenBatchLoader(shards.path, micro_batch_size=4, seed=2)
    it = iter(a)
    for _ in range(10):
        next(it)
    b = TokenBatchLoader(shards.path, micro_batch_size=8, seed=2)  # another global batch: another order
    with pytest.warns(RuntimeWarning, match="order changed.*'global_batch': 4.*'global_batch': 8"):
        b.load_state_dict(a.state_dict())
    assert (b.epoch, b.batch_in_epoch, b.samples_consumed) == (0, 5, 40)


# every split of one global batch of 8 into ranks x micro-batch x accumulation (and workers)
SPLITS = [(1, 8, 1, 0), (2, 4, 1, 2), (1, 4, 2, 2), (4, 1, 2, 0), (2, 2, 2, 3)]  # world, micro-batch, accum, workers


def _steps(m, world, batch, accum, workers, steps, state=None, seed=9):
    """The samples of each optimizer step (a set of rows over every rank), and the ranks' states after."""
    loaders = [
        TokenBatchLoader(
            m.path,
            micro_batch_size=batch,
            rank=r,
            world_size=world,
            num_workers=workers,
            seed=seed,
            shuffle_buffer=29,
            global_batch=world * batch * accum,
        )
        for r in range(world)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        rows = [r for it in its for _ in range(accum) for r in _rows(next(it))]
        out.append(collections.Counter(rows))
    return out, [loader.state_dict() for loader in loaders]


def test_the_global_order_is_the_same_on_any_split_and_a_resume_re_splits_it(shards):
    m = shards
    k = m.sequences("train") // 8  # steps per epoch
    total = k + 3  # into the second epoch
    reference, _ = _steps(m, *SPLITS[0], total)
    assert all(sum(s.values()) == 8 for s in reference)
    epoch = collections.Counter()
    for s in reference[:k]:
        epoch.update(s)
    assert max(epoch.values()) == 1  # each sample at most once an epoch
    for split in SPLITS[1:]:
        got, _ = _steps(m, *split, total)
        assert got == reference, split
    # stop after some steps on one split, continue on another: the same steps as the reference
    for i, j in [(1, 2), (2, 1), (3, 4), (4, 0)]:
        before, after = SPLITS[i], SPLITS[j]
        done = k // 2 + 1
        first, states = _steps(m, *before, done)
        state = json.loads(json.dumps(states[0]))  # as a checkpoint keeps it
        assert state["position"] == done * 8
        rest, _ = _steps(m, *after, total - done, state=state)
        assert first + rest == reference, (before, after)


def test_resume_rejects_other_shards(shards, tmp_path, corpus, tokenizer):
    other = prepare(
        [corpus["dir"]],
        tokenizer.model_path,
        str(tmp_path / "o"),
        seq_len=SEQ,
        shard_size_mb=_two_shard_mb(shards),
        workers=1,
        progress=False,
    )
    a = TokenBatchLoader(shards.path, micro_batch_size=4)
    b = TokenBatchLoader(other.path, micro_batch_size=4)
    with pytest.raises(ValueError, match="fingerprint"):
        b.load_state_dict(a.state_dict())


# -- bad shards and manifests -------------------------------------------------------------


def test_corrupt_truncated_and_missing_shards(shards, tmp_path):
    d = _copy_dir(os.path.dirname(shards.path), tmp_path / "c")
    m = Manifest.load(d)
    victim = m.shards("train")[2]
    data = open(victim.url, "rb").read()
    with open(victim.url, "wb") as fh:
        fh.write(data[: len(data) // 2 + 100])  # truncated mid-member
    kw = dict(micro_batch_size=4, shuffle_buffer=0, loop=False)
    with pytest.raises(ShardError, match="train-000002.tar"):
        list(TokenBatchLoader(d, **kw))
    loader = TokenBatchLoader(d, skip_corrupt=True, **kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        batches = list(loader)
    assert len(batches) == loader.batches_per_epoch  # the count never changes
    assert loader.skipped_shards == 1 and loader.bad_shards == [victim.url]
    assert any("train-000002.tar" in str(x.message) for x in w)
    # the same through DataLoader worker processes: the count still never changes
    loader = TokenBatchLoader(d, skip_corrupt=True, num_workers=2, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(list(loader)) == loader.batches_per_epoch
    assert loader.skipped_shards >= 1 and loader.bad_shards == [victim.url]
    # garbage in a header
    with open(victim.url, "wb") as fh:
        fh.write(data[: 512 * 7] + b"\x13" * 700 + data[512 * 7 + 700 :])
    with pytest.raises(ShardError, match="train-000002.tar"):
        list(TokenBatchLoader(d, **kw))
    # missing
    os.unlink(victim.url)
    with pytest.raises(MissingShardError, match="train-000002.tar"):
        list(TokenBatchLoader(d, **kw))


def test_manifest_mismatch_is_refused_with_both_values(shards):
    with pytest.raises(ValueError, match=rf"seq_len {SEQ}.*\b64\b"):
        TokenBatchLoader(shards.path, expected_seq_len=64)
    wrong = "0" * 64
    with pytest.raises(ValueError) as err:
        TokenBatchLoader(shards.path, expected_tokenizer_sha256=wrong)
    assert shards.tokenizer_sha256 in str(err.value) and wrong in str(err.value)
    ok = TokenBatchLoader(shards.path, expected_seq_len=SEQ, expected_tokenizer_sha256=shards.tokenizer_sha256)
    assert ok.batches_per_epoch > 0
    with pytest.raises(KeyError, match="val"):
        TokenBatchLoader(shards.path, split="val")


def test_swapped_tokenizer_next_to_the_shards_is_refused(shards, tmp_path, corpus):
    d = _copy_dir(os.path.dirname(shards.path), tmp_path / "t")
    train_tokenizer(
        [corpus["dir"]], os.path.join(d, "tokenizer.model"), vocab_size=350, max_chars=50_000, progress=False
    )
    with pytest.raises(ValueError, match=shards.tokenizer_sha256):
        TokenBatchLoader(d)


def test_a_command_in_a_manifest_is_refused(shards, tmp_path):
    """webdataset runs a `pipe:` shard name as a shell command: one from a manifest is refused when
    the manifest is read, naming it and the entry, and nothing runs (no switch allows it)."""
    from data_pipeline.manifest import RefusedEntry

    d = _copy_dir(os.path.dirname(shards.path), tmp_path / "p")
    raw = json.load(open(os.path.join(d, "manifest.json")))
    marker = tmp_path / "MARKER"
    raw["splits"]["train"][1]["name"] = f"pipe:touch {marker}; cat " + os.path.join(
        d, raw["splits"]["train"][1]["name"]
    )
    with open(os.path.join(d, "manifest.json"), "w") as fh:
        json.dump(raw, fh)
    with pytest.raises(RefusedEntry, match=r"manifest .*: train shard 1 'pipe:touch .* names a pipe: shard"):
        list(TokenBatchLoader(d, micro_batch_size=4, loop=False))
    assert not marker.exists()


# -- prepare: reproducible, atomic ---------------------------------------------------------


def _dir_bytes(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_prepare_is_byte_for_byte_reproducible_and_splits_val(tmp_path, corpus, tokenizer):
    kw = dict(seq_len=SEQ, shard_size_mb=0.5, val_fraction=0.2, seed=3, progress=False)
    a = prepare([corpus["dir"]], tokenizer.model_path, str(tmp_path / "a"), workers=2, **kw)
    b = prepare([corpus["dir"]], tokenizer.model_path, str(tmp_path / "b"), workers=1, **kw)
    assert len(a.shards("train")) > 2 and len(a.shards("val")) >= 1
    assert _dir_bytes(a.path.rsplit(os.sep, 1)[0]) == _dir_bytes(b.path.rsplit(os.sep, 1)[0])
    per = a.stats["documents_per_split"]
    assert per["val"] > 0 and per["train"] + per["val"] == a.stats["documents"]
    assert 0.1 < per["val"] / a.stats["documents"] < 0.3
    c = prepare([corpus["dir"]], tokenizer.model_path, str(tmp_path / "c"), workers=1, **{**kw, "seed": 4})
    assert c.fingerprint("train") != a.fingerprint("train")


def test_interrupted_prepare_leaves_no_complete_looking_shard(tmp_path, corpus, tokenizer, monkeypatch):
    kw = dict(seq_len=SEQ, shard_size_mb=0.5, workers=1, progress=False)
    ref = prepare([corpus["dir"]], tokenizer.model_path, str(tmp_path / "ref"), **kw)
    ref_files = _dir_bytes(os.path.dirname(ref.path))
    out = str(tmp_path / "out")
    prepare([corpus["dir"]], tokenizer.model_path, out, **kw)  # an older complete run in the same place
    real_write = shards_mod._write_chunks
    calls = {"n": 0}

    def dying_write(fh, data, chunk=1 << 22):
        calls["n"] += 1
        if calls["n"] == 3:  # third shard: write half of it, then the process "dies"
            fh.write(data[: len(data) // 2])
            fh.flush()
            raise KeyboardInterrupt
        real_write(fh, data, chunk)

    monkeypatch.setattr(shards_mod, "_write_chunks", dying_write)
    with pytest.raises(KeyboardInterrupt):
        prepare([corpus["dir"]], tokenizer.model_path, out, **kw)
    monkeypatch.setattr(shards_mod, "_write_chunks", real_write)
    names = os.listdir(out)
    assert "manifest.json" not in names  # no manifest describes an incomplete set
    with pytest.raises(FileNotFoundError, match="manifest"):
        Manifest.load(out)
    partial = [f for f in names if f.endswith(".tmp")]
    assert partial == ["train-000002.tar.tmp"]
    for f in names:
        if f.endswith(".tar"):  # whatever looks like a shard is a whole, correct shard
            assert open(os.path.join(out, f), "rb").read() == ref_files[f], f
    prepare([corpus["dir"]], tokenizer.model_path, out, **kw)  # the re-run completes it
    assert _dir_bytes(out) == ref_files


# -- command line and benchmark -------------------------------------------------------------


def test_cli_tokenizer_prepare_inspect(tmp_path, capsys):
    from data_pipeline.cli import main

    src = tmp_path / "in.txt"
    src.write_text(open(SHAKESPEARE, encoding="utf-8").read(60_000), encoding="utf-8")
    tok = str(tmp_path / "t.model")
    assert (
        main(["tokenizer", "--input", str(src), "--txt-mode", "paragraph", "--vocab-size", "400", "--out", tok, "-q"])
        == 0
    )
    out = str(tmp_path / "shards")
    assert (
        main(
            [
                "prepare",
                "--input",
                str(src),
                "--txt-mode",
                "paragraph",
                "--tokenizer",
                tok,
                "--out",
                out,
                "--seq-len",
                "16",
                "--shard-size-mb",
                "0.05",
                "--workers",
                "2",
                "--val-fraction",
                "0.1",
                "-q",
            ]
        )
        == 0
    )
    m = Manifest.load(out)
    assert m.seq_len == 16 and len(m.shards("train")) >= 2 and "val" in m.splits
    assert main(["inspect", out, "--verify"]) == 0
    assert "0 bad shard" in capsys.readouterr().out
    with open(m.shards("train")[0].url, "r+b") as fh:
        fh.seek(600)
        fh.write(b"\x00\x01" * 8)  # flip payload bytes: only the checksum can tell
    assert main(["inspect", out, "--verify"]) == 1
    assert main(["prepare", "--input", str(tmp_path / "nope"), "--tokenizer", tok, "--out", out, "-q"]) == 2
    capsys.readouterr()
    assert (
        main(
            [
                "prepare",
                "--input",
                str(src),
                "--tokenizer",
                tok,
                "--out",
                str(tmp_path / "loud"),
                "--seq-len",
                "16",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "tok/s" in err and "MB/s" in err and "tokens/s" in err  # progress display and summary


def test_bench_json(tmp_path, capsys):
    from data_pipeline.bench import main

    src = tmp_path / "in.txt"
    src.write_text(open(SHAKESPEARE, encoding="utf-8").read(200_000), encoding="utf-8")
    assert (
        main(["--input", str(src), "--vocab-size", "400", "--seq-len", "64", "--loader-seconds", "0.2", "--json"]) == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["prepare_mb_per_s"] > 0 and res["loader_tokens_per_s"] > 0
    assert res["command"].startswith("grt bench data")
    # prepare beside its limit: SentencePiece's encode of the same text, the same tokens
    assert res["encode_limit_mb_per_s_per_core"] > 0 and res["prepare_vs_limit"] > 0
    assert res["encode_limit_tokens"] == res["encode_whole_docs_tokens"] > 0  # cut as prepare cuts: the same tokens
    assert res["shard_write_mb_per_s"] > 0 and res["read_s"] >= 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mixture", "-2"], "--mixture must be >= 0"),
        (["--loader-seconds", "0"], "--loader-seconds must be > 0"),
        (["--max-mb", "nan"], "--max-mb must be > 0"),
        (["--vocab-size", "10"], "--vocab-size must be in [258, "),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--loader-workers", "-1"], "--loader-workers must be >= 0"),
        (["--seq-len", "0"], "--seq-len must be >= 1"),
        (["--shard-size-mb", "0"], "--shard-size-mb must be > 0"),
        (["--tokenizer-chars", "0"], "--tokenizer-chars must be >= 1"),
        (["--tokenizer", "no/such.model"], "--tokenizer 'no/such.model' is not a file"),
    ],
)
def test_bench_flags_are_checked_at_the_door(flags, message, capsys):
    from data_pipeline.bench import main

    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grt bench data: error: {message}") and len(err.splitlines()) == 1, err


def test_long_documents_tokenise_exactly_as_the_tokenizer(tmp_path, tokenizer):
    text = open(SHAKESPEARE, encoding="utf-8").read(150_000)  # one long document (segmented encoding)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    m = prepare(
        [str(tmp_path / "one.txt")], tokenizer.model_path, str(tmp_path / "s"), seq_len=SEQ, workers=2, progress=False
    )
    samples = [np.frombuffer(b, "<u2") for b in _all_samples(m)]
    stream = np.concatenate([samples[0][:1]] + [s[1:] for s in samples]).tolist()
    expect = [tokenizer.sep_id] + tokenizer.encode(text)
    assert len(stream) == len(samples) * SEQ + 1 and len(expect) - len(stream) < SEQ
    assert stream == expect[: len(stream)]


@pytest.mark.slow
def test_prepare_killed_with_sigkill_then_rerun(tmp_path, tokenizer):
    import signal
    import sys
    import time

    src = tmp_path / "in.txt"
    src.write_text(open(SHAKESPEARE, encoding="utf-8").read(), encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "data_pipeline.cli",
        "prepare",
        "--input",
        str(src),
        "--txt-mode",
        "paragraph",
        "--tokenizer",
        tokenizer.model_path,
        "--seq-len",
        "16",
        "--shard-size-mb",
        "0.03",
        "--workers",
        "2",
        "-q",
    ]
    ref = str(tmp_path / "ref")
    subprocess.run(cmd + ["--out", ref], check=True, cwd=REPO)
    ref_files = _dir_bytes(ref)
    assert len([f for f in ref_files if f.endswith(".tar")]) > 20
    out = str(tmp_path / "out")
    proc = subprocess.Popen(cmd + ["--out", out], cwd=REPO)
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.isdir(out) and any(f.endswith(".tar") for f in os.listdir(out))):
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    names = os.listdir(out)
    assert "manifest.json" not in names, "the run finished before it was killed: use more input"
    for f in names:
        if f.endswith(".tar"):
            assert open(os.path.join(out, f), "rb").read() == ref_files[f], f
    subprocess.run(cmd + ["--out", out], check=True, cwd=REPO)
    assert _dir_bytes(out) == ref_files


def _shared_corpus_docs(n_docs, max_chars):
    """The first documents of the shared Gutenberg corpus (real pretraining-dump text)."""
    from conftest import SHARED

    path = SHARED / "data" / "corpus" / "train-00000.jsonl.gz"
    if not path.exists():
        pytest.skip(f"{path} not found (set GRT_SHARED_DIR)")
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            docs.append(json.loads(line)["text"][:max_chars])
            if len(docs) == n_docs:
                break
    return docs


def test_parquet_input_streams_row_groups_and_equals_jsonl(tmp_path, tokenizer, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = _shared_corpus_docs(12, 20_000)
    rows = docs + ["", None]  # an empty and a null text are skipped and counted, as in JSON lines
    src = tmp_path / "parquet"
    src.mkdir()
    pq.write_table(
        pa.table({"id": [str(i) for i in range(len(rows))], "content": rows}), src / "part-0.parquet", row_group_size=3
    )
    assert pq.ParquetFile(src / "part-0.parquet").num_row_groups == 5
    with open(tmp_path / "same.jsonl", "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"content": d}) + "\n")

    read_groups = []
    real_read = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("a whole Parquet file was read at once"))
    monkeypatch.setattr(
        pq.ParquetFile,
        "read_row_group",
        lambda self, i, **k: read_groups.append((i, k.get("columns"))) or real_read(self, i, **k),
    )
    stats = SourceStats()
    assert list(iter_documents(expand_inputs([str(src)]), text_field="content", stats=stats)) == docs
    assert read_groups == [(i, ["content"]) for i in range(5)]
    assert stats.documents == len(docs) and stats.skipped_empty == 1 and stats.skipped_missing_field == 1

    kw = dict(seq_len=SEQ, shard_size_mb=0.5, text_field="content", workers=1, progress=False)
    a = prepare([str(src)], tokenizer.model_path, str(tmp_path / "a"), **kw)
    b = prepare([str(tmp_path / "same.jsonl")], tokenizer.model_path, str(tmp_path / "b"), **kw)
    assert a.fingerprint("train") == b.fingerprint("train")


def test_parquet_without_the_text_column_is_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: body\).*--text-field"):
        list(iter_documents([str(tmp_path / "x.parquet")]))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        list(iter_documents([str(tmp_path / "bad.parquet")]))
