"""The chains task (data_pipeline/chains.py) and `grt data chains`: every answer needs the number
of lookups its chain says and can be recovered from the tokens alone, and the task is written as
real SentencePiece + WebDataset shards + manifest that training and evaluation read as any data."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from data_pipeline.chains import ASK, EQ, PAD, SEP, ChainTask, padded, sample, score_positions, symbols
from data_pipeline.cli import main as data_main
from data_pipeline.manifest import Manifest
from data_pipeline.shards import DTYPES, iter_shard
from data_pipeline.tokenizer import Tokenizer


def test_a_sample_is_shuffled_chains_whose_queries_need_k_lookups():
    task = ChainTask(num_vars=24, num_values=7, min_hops=2, max_hops=5, chains_per_sample=4)
    rng = random.Random(0)
    seen_k: set[int] = set()
    unresolved = 0
    for _ in range(300):
        s = sample(task, rng)
        assert s.tokens[0] == SEP and len(s.tokens) <= task.max_length
        statements = s.tokens[1 : s.tokens.index(ASK)]
        names = statements[0::4]
        assert len(names) == len(set(names)) == sum(k for _, k in s.answers)  # distinct, one per hop
        assert set(statements[1::4]) == {EQ}
        # (position, k) as made; the value parsed back is the token there
        parsed = score_positions(padded(s.tokens, task.max_length))
        assert [(p, k) for p, _, k in parsed] == s.answers
        assert all(s.tokens[p] == str(v) for p, v, _ in parsed)
        seen_k.update(k for _, k in s.answers)
        # shuffled: some statement reads a variable that is defined only after it
        defined: set[str] = set()
        for i in range(0, len(statements), 4):
            unresolved += statements[i + 2].startswith("v") and statements[i + 2] not in defined
            defined.add(statements[i])
    assert seen_k == {2, 3, 4, 5}
    assert unresolved > 100


def test_queries_all_asks_every_variable_of_each_chain():
    task = ChainTask(min_hops=1, max_hops=4, queries="all")
    rng = random.Random(1)
    for _ in range(100):
        s = sample(task, rng)
        assert len(s.tokens) <= task.max_length
        first = s.tokens.index(ASK)
        asked = s.tokens[first + 1 :: 5]
        assert sorted(asked) == sorted(s.tokens[1:first:4])  # every defined variable asked once
        assert [(p, k) for p, _, k in score_positions(s.tokens)] == s.answers


def test_queries_per_sample_asks_a_random_few_the_other_chains_distractors():
    task = ChainTask(min_hops=1, max_hops=3, chains_per_sample=4, queries_per_sample=1)
    rng = random.Random(2)
    ks = []
    for _ in range(300):
        s = sample(task, rng)
        assert len(s.tokens) <= task.max_length == 1 + 4 * 4 * 3 + 5
        assert s.tokens.count(ASK) == len(s.answers) == 1
        assert [(p, k) for p, _, k in score_positions(s.tokens)] == s.answers
        ks.append(s.answers[0][1])
    assert {k: ks.count(k) > 60 for k in (1, 2, 3)} == {1: True, 2: True, 3: True}  # k still uniform


def test_by_name_order_defines_every_variable_in_its_place_and_chains_still_point_forward():
    task = ChainTask(num_vars=12, min_hops=2, max_hops=4, chains_per_sample=3, queries_per_sample=1, order="by-name")
    rng = random.Random(3)
    forward = 0
    for _ in range(200):
        s = sample(task, rng)
        assert len(s.tokens) <= task.max_length == 1 + 4 * 12 + 5
        assert s.tokens[1 : 4 * 12 : 4] == [f"v{i}" for i in range(12)]  # vj's statement at 1 + 4j
        assert [(p, k) for p, _, k in score_positions(s.tokens)] == s.answers
        rhs = s.tokens[3 : 4 * 12 : 4]
        forward += sum(r.startswith("v") and int(r[1:]) > j for j, r in enumerate(rhs))
    assert forward > 200  # a statement often names a variable defined after it


def test_compact_puts_each_key_just_before_its_value():
    task = ChainTask(num_vars=16, min_hops=1, max_hops=4, chains_per_sample=3, compact=True)
    rng = random.Random(4)
    for _ in range(200):
        s = sample(task, rng)
        assert len(s.tokens) <= task.max_length == 1 + 3 * 12 + 4 * 3
        assert EQ not in s.tokens
        parsed = score_positions(s.tokens)
        assert [(p, k) for p, _, k in parsed] == s.answers
        assert all(s.tokens[p - 2] == ASK and s.tokens[p] == chr(65 + v) for p, v, _ in parsed)


def test_score_positions_refuses_tokens_that_are_not_the_task():
    tokens = [SEP, "v1", EQ, "3", ";", "v2", EQ, "v1", ";", ASK, "v2", EQ, "3", ";"]
    assert score_positions(tokens) == [(12, 3, 2)]
    with pytest.raises(ValueError, match="answers '4', but its chain holds '3'"):
        score_positions(tokens[:12] + ["4", ";"])
    with pytest.raises(ValueError, match="which no statement before it defines"):
        score_positions([SEP, *tokens[9:]])
    # a separator starts a new sample: the statements before it do not count
    with pytest.raises(ValueError, match="no statement before it defines"):
        score_positions(tokens[:9] + [SEP] + tokens[9:])


def test_a_compact_data_set_has_one_piece_per_symbol(tmp_path):
    out = tmp_path / "compact"
    assert data_main(["chains", "-o", str(out), "--compact", "--num-values", "12", "--train-samples", "40", "-q"]) == 0
    m = Manifest.load(str(out))
    tok = Tokenizer(m.tokenizer_path)
    task = ChainTask(num_values=12, compact=True)
    assert [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)] == ["<unk>", *symbols(task)]
    s = m.shards("train")[0]
    _, data = next(iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext))
    ids = [i for i in np.frombuffer(data, DTYPES[m.ext]).tolist()[1:-1] if tok.sp.id_to_piece(i) != PAD]
    assert tok.encode(tok.decode(ids)) == ids  # "v3H;v5v3;?v5H;" splits back into its symbols


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seq-len", "20"], "seq_len 20 is too short for a sample of up to 85 tokens"),
        (["--chains-per-sample", "9"], "num_vars (32) must be >= chains_per_sample x max_hops (9 x 4)"),
        (["--val-max-hops", "9"], "num_vars (32) must be >= chains_per_sample x val_max_hops (4 x 9)"),
        (["--min-hops", "3", "--max-hops", "2"], "max_hops (2) must be >= min_hops (3)"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert data_main(["chains", "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_grt_data_chains_writes_shards_a_tokenizer_and_a_manifest(tmp_path):
    out = tmp_path / "chains"
    flags = ["--train-samples", "300", "--val-samples", "200", "--max-hops", "3", "--val-max-hops", "5"]
    flags += ["--num-values", "12", "-q"]  # values 10 and 11 beside 1: the text still splits one way
    assert data_main(["chains", "-o", str(out), "--seed", "7", *flags]) == 0
    m = Manifest.load(str(out))
    task = ChainTask(num_values=12, max_hops=3, seed=7)
    assert m.seq_len == replace(task, max_hops=5).max_length  # the longest sample of either split
    assert (m.sequences("train"), m.sequences("val")) == (300, 200)
    tok = Tokenizer(m.tokenizer_path)
    assert tok.sep_id == m.sep_id and tok.sep_piece == SEP
    pieces = [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
    assert pieces == ["<unk>", *symbols(task)]  # one piece per symbol, nothing else
    ks: dict[str, set[int]] = {}
    for split in ("train", "val"):
        ks[split] = set()
        for s in m.shards(split):
            for _, data in iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext, vocab_size=m.vocab_size):
                ids = np.frombuffer(data, DTYPES[m.ext]).tolist()
                assert ids[0] == ids[-1] == m.sep_id  # a sample, then the next one's separator
                text = [pieces[i] for i in ids]
                body = "".join(t for t in text[1:-1] if t != PAD)
                assert tok.encode(body) == [i for i in ids[1:-1] if pieces[i] != PAD]  # the text encodes back
                parsed = score_positions(text)
                assert len(parsed) == task.chains_per_sample
                ks[split].update(k for _, _, k in parsed)
    assert ks == {"train": {1, 2, 3}, "val": {1, 2, 3, 4, 5}}
    # the same flags give the same bytes; another seed other samples
    again, other = tmp_path / "again", tmp_path / "other"
    assert data_main(["chains", "-o", str(again), "--seed", "7", *flags]) == 0
    assert data_main(["chains", "-o", str(other), "--seed", "8", *flags]) == 0
    assert Manifest.load(str(again)).fingerprint("train") == m.fingerprint("train")
    assert Manifest.load(str(other)).fingerprint("train") != m.fingerprint("train")


def test_grt_eval_scores_each_answer_at_each_depth_and_k(tmp_path):
    """chains_sums against a by-hand count from the model's own forward at each depth: the logits
    at the position before each answer, argmax and NLL, summed per k; a manifest that is not a
    chains data set is refused in one line."""
    import torch
    import torch.nn.functional as F

    from grt_common.errors import ConfigError
    from pretrain.infer.evaluation.chains_score import chains_settings, chains_sums, chains_table, format_chains
    from pretrain.model import build_model
    from pretrain.presets import get_preset

    out = tmp_path / "chains"
    flags = ["--train-samples", "8", "--val-samples", "24", "--max-hops", "2", "--val-max-hops", "3", "-q"]
    assert data_main(["chains", "-o", str(out), *flags]) == 0
    m = Manifest.load(str(out))
    tok = Tokenizer(m.tokenizer_path)
    pieces = [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt").replace(vocab_size=m.vocab_size, max_seq_len=m.seq_len)).eval()
    depths = [0, 1, 3]
    sums = chains_sums(model, tok, m, "val", depths, torch.device("cpu"), batch_size=8)
    want = torch.zeros_like(sums)
    s = m.shards("val")[0]
    with torch.no_grad():
        for _, data in iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext):
            ids = np.frombuffer(data, DTYPES[m.ext]).astype(np.int64)
            x = torch.from_numpy(ids[:-1])[None]
            for i, r in enumerate(depths):
                logits = model(x, n_loops=r).logits[0].float()
                for pos, _, k in score_positions([pieces[t] for t in ids]):
                    gold = torch.tensor(ids[pos])
                    want[i, k] += torch.stack(
                        [
                            (logits[pos - 1].argmax() == gold).double(),
                            F.cross_entropy(logits[pos - 1], gold).double(),
                            torch.tensor(1.0).double(),
                        ]
                    )
    assert torch.allclose(sums, want, atol=1e-4), (sums, want)
    assert want[0, 3, 2] > 0  # k = 3 items: beyond training's range, scored
    table = chains_table(sums, depths, "val")
    results = {"chains": {"split": "val", "trained_hops": [1, 2], "chance_acc": 0.1, "by_depth": table}}
    text = format_chains({**results, "trained_loops": 3, "depth_unit": "loop steps"})
    assert "k=3+" in text and "+ k beyond the trained range" in text
    with pytest.raises(ConfigError, match="is not a chains data set"):
        chains_settings(replace(m, options={}))
