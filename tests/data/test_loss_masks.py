"""Loss masks in the shards (data_pipeline/shards.py): `grt data chains --loss-on answers` writes a
mask member after each sample's tokens, the manifest declares it, and the loader turns the targets
it leaves out into the loss's ignore index, so training, validation and every loader feature (seek,
stream, mixtures, resume) train on the answers alone; a shard whose mask is missing or malformed is
refused in one line naming it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from trained_models import single_thread, small_model, write_export  # noqa: F401 (single_thread: a fixture)

from data_pipeline.batches import open_train_batches
from data_pipeline.chains import score_positions
from data_pipeline.cli import main as data_main
from data_pipeline.epoch_plan import IGNORE_INDEX, collate
from data_pipeline.loader import TokenBatchLoader
from data_pipeline.manifest import Manifest
from data_pipeline.mixture import DataMixture, parse_sources
from data_pipeline.shard_reader import ShardReader
from data_pipeline.shards import DTYPES, ShardError, build_shard, iter_shard, pack_mask
from data_pipeline.tokenizer import Tokenizer

TASK = ["--min-hops", "1", "--max-hops", "2", "--num-vars", "8", "--num-values", "8", "--chains-per-sample", "4"]
TASK += ["--queries", "all", "--compact", "--order", "by-name", "--train-samples", "96", "--val-samples", "16", "-q"]


def chains(tmp_path: Path, loss_on: str) -> Manifest:
    out = tmp_path / loss_on
    assert data_main(["chains", "-o", str(out), *TASK, "--loss-on", loss_on]) == 0
    return Manifest.load(str(out))


def answer_mask(ids: list[int], pieces: list[str]) -> np.ndarray:
    """The positions of a stored sample (seq_len + 1 tokens) that are answers, from its tokens alone."""
    mask = np.zeros(len(ids), dtype=bool)
    mask[[pos for pos, _, _ in score_positions([pieces[t] for t in ids])]] = True
    return mask


def test_a_mask_round_trips_through_the_shards_and_the_loader(tmp_path):
    masked, plain = chains(tmp_path, "answers"), chains(tmp_path, "all")
    assert masked.masked and masked.raw["loss_mask"] == "bits"
    assert not plain.masked and "loss_mask" not in plain.raw  # data without masks: written as before
    pieces = [Tokenizer(masked.tokenizer_path).sp.id_to_piece(i) for i in range(masked.vocab_size)]
    s, p = masked.shards("train")[0], plain.shards("train")[0]
    T1, nbytes = masked.sample_tokens, masked.sample_tokens * DTYPES[masked.ext].itemsize
    stored = list(iter_shard(s.url, s.sequences, T1, masked.ext, masked=True))
    plain_samples = list(iter_shard(p.url, p.sequences, T1, plain.ext))
    want_targets = []
    for (_, payload), (_, tokens) in zip(stored, plain_samples, strict=True):
        assert payload[:nbytes] == tokens  # the same samples; the mask after them
        ids = np.frombuffer(tokens, DTYPES[masked.ext]).astype(np.int64)
        mask = answer_mask(ids.tolist(), pieces)
        assert payload[nbytes:] == pack_mask(mask) and 4 <= mask.sum() <= 8  # a query per variable of 4 chains
        want_targets.append(np.where(mask[1:], ids[1:], IGNORE_INDEX))
    # the loader, reading by seeking: the targets the mask leaves out are the loss's ignore index
    loader = TokenBatchLoader(masked, micro_batch_size=8, loop=False, shuffle_buffer=0, shuffle_shards=False)
    got = torch.cat([b["targets"] for b in loader])
    assert torch.equal(got, torch.from_numpy(np.stack(want_targets)[: len(got)]))
    # ... and streaming (a file: URL), the same payloads
    seek = ShardReader([s.sequences], T1, masked.ext, masked.vocab_size, masked=True)
    stream = ShardReader([s.sequences], T1, masked.ext, masked.vocab_size, masked=True)
    assert seek.read(0, s.url, [1, 5]) == stream.read(0, "file://" + s.url, [1, 5]) == [stored[1][1], stored[5][1]]
    seek.close()
    stream.close()
    # grt data inspect --verify reads every mask member
    assert data_main(["inspect", str(tmp_path / "answers"), "--verify"]) == 0


def test_the_loss_ignores_the_targets_a_mask_leaves_out():
    """Two samples that differ in their last token, which is only ever a target: with that target
    masked out the loss is the same, scored it differs (the mask reaches the loss)."""
    from pretrain.model import build_model
    from pretrain.model.loss import IGNORE_INDEX as LOSS_IGNORES
    from pretrain.presets import get_preset

    assert IGNORE_INDEX == LOSS_IGNORES  # the loader's unscored target is the one the loss skips
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt").replace(vocab_size=32, max_seq_len=16)).eval()
    rng = np.random.default_rng(0)
    a = rng.integers(1, 32, size=(2, 17)).astype("<u2")
    b = a.copy()
    b[:, -1] = (a[:, -1] + 1) % 32
    mask = rng.random((2, 17)) < 0.5
    mask[:, 5] = True  # some target scored in each row

    def loss(samples: np.ndarray, last_scored: bool) -> float:
        m = mask.copy()
        m[:, -1] = last_scored
        batch = collate([row.tobytes() + pack_mask(mr) for row, mr in zip(samples, m, strict=True)], 16, "u16", 0)
        assert torch.equal(batch["targets"] != IGNORE_INDEX, torch.from_numpy(m[:, 1:]))
        with torch.no_grad():
            return float(model(batch["input_ids"], batch["targets"], n_loops=2, return_logits=False).loss)

    assert loss(a, last_scored=False) == loss(b, last_scored=False)
    assert loss(a, last_scored=True) != loss(b, last_scored=True)


@pytest.mark.parametrize("impl", ["eager", "compiled"])
def test_a_micro_batch_whose_mask_scores_nothing_has_loss_0_not_nan(impl):
    """Masked data can give a micro-batch with no scored target: its loss is 0 with zero gradients in
    every loss path (0/0 was NaN, which stops a run as non-finite), and a scored batch's is the mean."""
    from pretrain.model.loss import linear_cross_entropy, lm_loss

    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    none = torch.full((6,), IGNORE_INDEX)
    for loss in (linear_cross_entropy(h, w, none, 16, impl=impl), lm_loss((h @ w.t())[None], none[None])):
        loss.backward()
        assert loss.item() == 0.0 and h.grad is not None and w.grad is not None
        assert not h.grad.any() and not w.grad.any()
        h.grad = w.grad = None
    some = none.clone()
    some[2] = 3
    want = torch.nn.functional.cross_entropy((h @ w.t())[2:3], some[2:3])
    torch.testing.assert_close(linear_cross_entropy(h, w, some, 16, impl=impl), want)
    torch.testing.assert_close(lm_loss((h @ w.t())[None], some[None]), want)


def test_resume_is_exact_with_masks_alone_and_in_a_mixture(tmp_path):
    masked, plain = chains(tmp_path, "answers"), chains(tmp_path, "all")
    text = f"qa=0.5:{masked.path},text=0.5:{plain.path}"
    sources = parse_sources(text)
    assert sources is not None
    for data in (masked, DataMixture.load(text, sources)):

        def loader(data=data):
            return open_train_batches(
                data,
                micro_batch_size=4,
                rank=0,
                world_size=1,
                num_workers=0,
                seed=3,
                global_batch=8,
                shuffle_buffer=32,
                skip_corrupt=False,
                stages=[],
                max_repeats=0.0,
            )

        whole = loader()
        it = iter(whole)
        straight = [next(it) for _ in range(8)]
        first = loader()
        it = iter(first)
        for _ in range(4):
            next(it)
        resumed = loader()
        resumed.load_state_dict(first.state_dict())
        again = [b for _, b in zip(range(4), resumed, strict=False)]
        for want, got in zip(straight[4:], again, strict=True):
            assert torch.equal(want["input_ids"], got["input_ids"]) and torch.equal(want["targets"], got["targets"])
        scored = torch.cat([b["targets"] != IGNORE_INDEX for b in straight]).sum(1)
        # masked samples score their 4..8 answers, a mixture's plain ones every target
        answers = [n for n in scored.tolist() if n <= 8]
        assert answers and min(answers) >= 4 and set(scored.tolist()) - set(answers) <= {masked.seq_len}
        assert (masked.seq_len in scored.tolist()) == isinstance(data, DataMixture)


def rewrite_shard(manifest: Manifest, samples: np.ndarray, masks: np.ndarray | None, bad_mask: bytes = b"") -> None:
    """The manifest's first train shard written again from `samples` (and `masks`); `bad_mask`: sample
    0's mask member replaced by these bytes."""
    s = manifest.shards("train")[0]
    stem = Path(s.url).name[: -len(".tar")]
    data = build_shard(stem, samples, manifest.ext, masks)
    if bad_mask:
        buf = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(data)) as src, tarfile.open(fileobj=buf, mode="w") as dst:
            for info in src.getmembers():
                payload = src.extractfile(info).read()  # type: ignore[union-attr]
                if info.name.endswith("_0000000.mask"):
                    info.size, payload = len(bad_mask), bad_mask
                dst.addfile(info, io.BytesIO(payload))
        data = buf.getvalue()
    Path(s.url).write_bytes(data)
    raw = json.loads(Path(manifest.path).read_text())
    entry = raw["splits"]["train"][0]
    entry["bytes"], entry["head_sha256"] = len(data), ""  # its size checked, not its first member's hash
    Path(manifest.path).write_text(json.dumps(raw))


@pytest.mark.parametrize("stream", [False, True], ids=["seek", "stream"])
def test_a_missing_or_malformed_mask_member_is_one_clear_error(tmp_path, stream):
    masked = chains(tmp_path, "answers")
    s = masked.shards("train")[0]
    T1, nbytes = masked.sample_tokens, masked.sample_tokens * DTYPES[masked.ext].itemsize
    payloads = [p for _, p in iter_shard(s.url, s.sequences, T1, masked.ext, masked=True)]
    samples = np.stack([np.frombuffer(p[:nbytes], DTYPES[masked.ext]) for p in payloads])
    url = ("file://" if stream else "") + s.url

    def read() -> None:
        reader = ShardReader([s.sequences], T1, masked.ext, masked.vocab_size, masked=True)
        try:
            reader.read(0, url, [0, 1])
        finally:
            reader.close()

    # the manifest declares masks, the shard has none
    rewrite_shard(Manifest.load(masked.path), samples, None)
    want = "with the loss masks the manifest declares" if not stream else "member, its loss mask"
    with pytest.raises(ShardError, match=want) as err:
        read()
    assert "\n" not in str(err.value) and s.url in str(err.value)
    # a mask member of the wrong size
    masks = np.ones(samples.shape, dtype=bool)
    rewrite_shard(Manifest.load(masked.path), samples, masks, bad_mask=b"\xff")
    with pytest.raises(ShardError, match=r"loss mask member '.*_0000000.mask' has 1 bytes, want 8"):
        read()
    # an unknown kind of mask in the manifest: refused when it is loaded
    raw = json.loads(Path(masked.path).read_text())
    Path(masked.path).write_text(json.dumps({**raw, "loss_mask": "bytes"}))
    with pytest.raises(ValueError, match="has loss_mask 'bytes'; this code reads bits"):
        Manifest.load(masked.path)


def test_grt_eval_scores_masked_chains_as_the_same_samples_unmasked(tmp_path):
    """`grt eval --tasks chains` on data with masks: the same answers, accuracies and losses as on
    the same samples without (the masked-out last target, the next sample's separator, is not read)."""
    from pretrain.infer.evaluation.chains_score import chains_sums
    from pretrain.model import build_model
    from pretrain.presets import get_preset

    masked, plain = chains(tmp_path, "answers"), chains(tmp_path, "all")
    torch.manual_seed(0)
    model = build_model(get_preset("micro-grt").replace(vocab_size=masked.vocab_size, max_seq_len=masked.seq_len))
    tok = Tokenizer(masked.tokenizer_path)
    got, want = (chains_sums(model.eval(), tok, m, "val", [1, 3], torch.device("cpu"), 8) for m in (masked, plain))
    assert torch.equal(got, want) and got[0, :, 2].sum() > 0


def scored_targets(manifest: Manifest, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of a split as (samples [N, seq_len + 1], scored targets [N, seq_len]), the scored
    ones found from the tokens alone (`answer_mask`), not from the stored masks or the loader."""
    pieces = [Tokenizer(manifest.tokenizer_path).sp.id_to_piece(i) for i in range(manifest.vocab_size)]
    T1, dtype = manifest.sample_tokens, DTYPES[manifest.ext]
    rows = [
        np.frombuffer(payload[: T1 * dtype.itemsize], dtype).astype(np.int64)  # the mask member after: not read
        for s in manifest.shards(split)
        for _, payload in iter_shard(s.url, s.sequences, T1, manifest.ext, masked=True)
    ]
    scored = np.stack([answer_mask(ids.tolist(), pieces)[1:] for ids in rows])
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(scored)


def test_every_loss_figure_counts_and_averages_the_scored_targets_only(tmp_path):
    """On data with loss masks, `grt analyze` (its token count, its loss by exit depth, its token
    buckets and the training-split frequencies that make them), `grt eval` and the validation of a
    training run count the scored targets and average the loss over them alone: each figure equals
    the one computed here from the shards' tokens."""
    from collections import Counter

    import torch.nn.functional as F

    from pretrain.infer.analyze.analysis import main as analyze_main
    from pretrain.infer.analyze.analysis import token_counts
    from pretrain.infer.evaluation.evaluate import main as eval_main
    from pretrain.infer.evaluation.scoring import val_batches
    from pretrain.training.evaluation.validation import evaluate_depths

    masked = chains(tmp_path, "answers")
    model = small_model(vocab=masked.vocab_size)  # 1+2x3+1, R = 3
    samples, scored = scored_targets(masked, "val")
    n = int(scored.sum())
    assert 0 < n < scored.numel()
    targets = samples[:, 1:]
    want: dict[int, float] = {}
    with torch.no_grad():
        for r in range(4):
            nll = F.cross_entropy(
                model(samples[:, :-1], n_loops=r).logits.float().transpose(1, 2), targets, reduction="none"
            )
            want[r] = float(nll[scored].sum()) / n
    # every validation sample, in whole batches of 4: the same targets as here
    export = write_export(model, tmp_path / "model", Path(masked.tokenizer_path), {"data": masked.path})
    args = ["--batch-size", "4", "--max-batches", str(len(samples) // 4)]
    assert analyze_main([str(export), "--out", str(tmp_path / "report"), *args, "--freq-batches", "100"]) == 0
    res = json.loads((tmp_path / "report" / "analysis.json").read_text())
    assert res["tokens"] == n and sum(b["tokens"] for b in res["buckets"].values()) == n
    assert [res["loss_by_depth"][str(r)] for r in range(4)] == pytest.approx(list(want.values()), rel=1e-5)
    for r in range(4):  # the buckets split the same scored targets
        split_up = sum(b["tokens"] * b["loss_by_depth"][r] for b in res["buckets"].values()) / n
        assert split_up == pytest.approx(want[r], rel=1e-5)
    train, train_scored = scored_targets(masked, "train")
    assert token_counts(masked.path, 100) == Counter(train[:, 1:][train_scored].tolist())
    ev = ["--tasks", "val", "--depths", "0-3", "--quiet", "--json-out", str(tmp_path / "e.json")]
    assert eval_main([str(export), *ev, *args]) == 0
    val = json.loads((tmp_path / "e.json").read_text())["val"]
    assert [val[str(r)]["tokens"] for r in range(4)] == [n] * 4
    assert [val[str(r)]["loss"] for r in range(4)] == pytest.approx(list(want.values()), rel=1e-5)
    # a training run's validation: batches whose scored counts differ, averaged per scored target
    batches = list(val_batches(masked.path, 4))
    assert len({int((b["targets"] != IGNORE_INDEX).sum()) for b in batches}) > 1
    losses, _ = evaluate_depths(model, batches, [0, 1, 2, 3], torch.device("cpu"))
    assert list(losses.values()) == pytest.approx(list(want.values()), rel=1e-5)
