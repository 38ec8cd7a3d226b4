"""Training on a mixture (issue 29; docs/data.md, "Mixtures"): the bundled text split in two
sources (a, b) tokenised alike with the real `grt data` commands, a tiny third (c) that hits
its repetition cap, and two foreign ones (another tokenizer, another sequence length)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from multiproc import grt
from train_jobs import Job, last_step, losses, per_step, run_job, train_args, wait_for

from data_pipeline.loader import TokenBatchLoader
from data_pipeline.mixture import DataMixture, MixtureError, parse_sources, parse_stages
from data_pipeline.mixture_loader import MixtureLoader
from grt_common.errors import ConfigError
from pretrain.runs.data_spec import load_manifest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    """name -> manifest.json: a and b (the two halves of the text), c (a few samples, no
    validation split), foreign_tok (another tokenizer), seq32 (seq_len 32)."""
    root = tmp_path_factory.mktemp("mixture")
    text = DEMO.read_text()
    half = len(text) // 2
    parts = {"a": text[: half - 3000], "b": text[half:], "c": text[half - 3000 : half], "seq32": text[:40000]}
    parts["foreign_tok"] = text[:40000]
    for tok, vocab in (("tok", "512"), ("other", "384")):
        r = grt("data", "tokenizer", "-i", str(DEMO), "--txt-mode", "paragraph", "--vocab-size", vocab, "-o",
                str(root / tok), "-q")  # fmt: skip
        assert r.returncode == 0, r.stderr
    out = {}
    for name, part in parts.items():
        (root / f"{name}.txt").write_text(part)
        seq = "32" if name == "seq32" else "64"
        val = "0" if name == "c" else "0.05"
        tok = root / ("other.model" if name == "foreign_tok" else "tok.model")
        r = grt(
            "data", "prepare", "-i", str(root / f"{name}.txt"), "--txt-mode", "paragraph", "-t", str(tok),
            "-o", str(root / name), "--seq-len", seq, "--shard-size-mb", "0.05", "--val-fraction", val, "-q",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out[name] = root / name / "manifest.json"
    return out


def mixture(sources: dict[str, Path], **weights: float) -> DataMixture:
    text = ",".join(f"{n}={w}:{sources[n]}" for n, w in weights.items())
    data = load_manifest(text)
    assert isinstance(data, DataMixture)
    return data


def sample_sources(data: DataMixture) -> dict[bytes, str]:
    """Each train sample's first 32 token ids -> the source it belongs to (all of them read)."""
    owner = {}
    for name, manifest in zip(data.names, data.manifests, strict=True):
        loader = TokenBatchLoader(manifest, micro_batch_size=1, shuffle_buffer=0, loop=False)
        for batch in loader:
            owner[batch["input_ids"][0, :32].numpy().tobytes()] = name
    return owner


def steps(data: DataMixture, world: int, micro: int, workers: int, n: int, global_batch: int = 8, state=None, **kw):
    """Each step's sorted samples (first 32 tokens) over `world` ranks, and the loaders."""
    loaders = [
        MixtureLoader(
            data,
            micro_batch_size=micro,
            rank=r,
            world_size=world,
            num_workers=workers,
            global_batch=global_batch,
            shuffle_buffer=64,
            **kw,
        )
        for r in range(world)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    out = []
    for _ in range(n):
        rows = [
            row[:32].numpy().tobytes()
            for _ in range(global_batch // (world * micro))
            for it in its
            for row in next(it)["input_ids"]
        ]
        out.append(sorted(rows))
    return out, loaders


# -- what is refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("web=0.7:a.json,b.json", "'b.json' is not a mixture source"),
        ("web=-1:a.json", "source 'web' has weight '-1'"),
        ("web=x:a.json", "source 'web' has weight 'x', not a number"),
        ("web=0:a.json,books=0:b.json", "every weight is zero"),
        ("web=1:a.json,web=2:b.json", "source name 'web' is given twice"),
    ],
)
def test_bad_mixture_strings_are_one_line(text, expected):
    with pytest.raises(MixtureError, match=expected):
        parse_sources(text)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1e6:web=1,code=1", "no source 'code' in the mixture"),
        ("1e6:web=0,books=0", "every weight is zero"),
        ("2e6:web=1;1e6:books=1", "increasing token counts"),
        ("later:web=1", "TOKENS a token count > 0"),
        ("1e6:web=-0.5", "weight '-0.5'"),
    ],
)
def test_bad_stages_are_one_line(text, expected):
    with pytest.raises(MixtureError, match=expected):
        parse_stages(text, ["web", "books"])


def test_sources_must_be_tokenised_alike(sources):
    for other, what in (("foreign_tok", "tokenizer sha256"), ("seq32", "seq_len")):
        with pytest.raises(ConfigError, match=rf"source '{other}' .* has {what}"):
            mixture(sources, a=1, **{other: 1})
    with pytest.raises(ConfigError, match="source 'd': manifest .* not found"):
        load_manifest(f"a=1:{sources['a']},d=1:{sources['a'].parent / 'nowhere' / 'manifest.json'}")


def test_cli_refusals_before_anything_starts(sources, tmp_path):
    mix = ["--data", f"a=0.5:{sources['a']}", "--data", f"b=0.5:{sources['b']}"]
    cases = [
        (["--data", str(sources["a"]), "--set", "train.data_stages=1e5:a=1"], "needs a mixture of sources"),
        ([*mix, "--set", "train.data_stages=1e5:z=1"], "no source 'z' in the mixture"),
        ([*mix, "--steps", "2000", "--set", "train.max_repeats=0.5"], "with train.max_repeats=0.5 the sources give"),
    ]
    for args, expected in cases:
        r = grt("train", "--preset", "micro-grt", "--out", str(tmp_path / "run"), *args, "--dry-run")
        assert r.returncode == 2 and expected in r.stderr, r.stderr
        assert not (tmp_path / "run").exists()


# -- the order ------------------------------------------------------------------------------


def test_order_is_independent_of_the_split_and_resumes_on_any_world_size(sources):
    data = mixture(sources, a=0.7, b=0.3)
    one, loaders = steps(data, world=1, micro=8, workers=0, n=12)
    two, _ = steps(data, world=2, micro=2, workers=2, n=12)  # grad_accum 2, two loader workers per rank
    assert one == two
    state = loaders[0].state_dict()
    longer, _ = steps(data, world=1, micro=8, workers=0, n=20)
    resumed, _ = steps(data, world=4, micro=1, workers=1, n=8, state=state)
    assert longer[12:] == resumed
    assert longer[:12] == one
    for step in one:
        assert len(set(step)) == len(step)  # a step never takes a sample twice (each source's stream goes on)


def test_realised_shares_match_the_weights(sources):
    data = mixture(sources, a=0.7, b=0.3)
    owner = sample_sources(data)
    drawn, loaders = steps(data, world=1, micro=16, workers=0, n=150, global_batch=16)
    names = [owner[row] for step in drawn for row in step]
    n = len(names)
    share = names.count("a") / n
    sigma = math.sqrt(0.7 * 0.3 / n)
    assert abs(share - 0.7) < 4 * sigma, (share, sigma)
    # the loader's own count is what was read (TensorBoard's data/<source>/tokens is what was trained)
    assert loaders[0].drawn_tokens() == {"a": names.count("a") * 64, "b": names.count("b") * 64}


def test_draws_in_windows_are_the_draws_one_batch_at_a_time(sources):
    """The loader draws 64 global batches at once away from any cap: the same draws as one batch at a time."""
    data = mixture(sources, a=0.6, b=0.4)
    stages = parse_stages(f"{37 * 8 * 64}:a=0.1,b=0.9", data.names)
    loader = MixtureLoader(data, micro_batch_size=8, stages=stages)
    plan = loader._plan()
    windowed = plan.draws(0, np.zeros(2, dtype=np.int64))
    cursors = np.zeros(2, dtype=np.int64)
    for g in range(150):
        sources_g, numbers, counts = next(windowed)
        one = plan.draw(g, cursors)
        assert np.array_equal(sources_g, one), g
        for s in (0, 1):
            assert np.array_equal(numbers[one == s], cursors[s] + np.arange((one == s).sum()))
        assert np.array_equal(counts, np.bincount(one, minlength=2))
        cursors += counts


def test_stages_switch_weights_at_their_token_count_and_resume_inside_a_stage(sources):
    data = mixture(sources, a=0.5, b=0.5)
    owner = sample_sources(data)
    at = 10 * 8 * 64  # global batch 10: 10 batches of 8 samples of 64 tokens read before it
    stages = parse_stages(f"{at}:a=0,b=1;{2 * at}:a=1", data.names)
    drawn, loaders = steps(data, world=1, micro=8, workers=0, n=30, stages=stages)
    by_step = [{owner[row] for row in step} for step in drawn]
    assert by_step[:10].count({"a", "b"}) >= 8  # the mixture's own weights first
    assert all(s == {"b"} for s in by_step[10:20]) and all(s == {"a"} for s in by_step[20:])
    assert loaders[0].stage() == (2, 20, {"a": 1.0, "b": 0.0})  # what the log and data/stage say
    first, loaders = steps(data, world=1, micro=8, workers=0, n=15, stages=stages)
    assert loaders[0].stage() == (1, 10, {"a": 0.0, "b": 1.0})
    rest, _ = steps(data, world=2, micro=4, workers=0, n=15, stages=stages, state=loaders[0].state_dict())
    assert first + rest == drawn


def test_repetition_cap_takes_the_source_out_and_says_so(sources):
    data = mixture(sources, c=0.5, a=0.5)
    owner = sample_sources(data)
    size_c = data.source_sequences("train")["c"]
    drawn, loaders = steps(data, world=1, micro=8, workers=0, n=20, max_repeats=1.0)
    rows = [row for step in drawn for row in step]
    from_c = [row for row in rows if owner[row] == "c"]
    assert len(from_c) == size_c == len(set(from_c))  # every sample of c once, none oversampled
    assert set(loaders[0].exhausted) == {"c"}
    capped_at = loaders[0].exhausted["c"]
    assert all(owner[row] == "a" for step in drawn[capped_at:] for row in step)
    budget = data.source_sequences("train")
    with pytest.raises(MixtureError, match=r"train.max_repeats=1 the sources give at most"):
        data.check_budget(budget["a"] + budget["c"] + 1, 1.0, [], 64)


CAPPED_AND_DROPPED = r"""
import multiprocessing, sys, time
from data_pipeline.mixture import DataMixture, parse_sources
from data_pipeline.mixture_loader import MixtureLoader
text = sys.argv[1]
data = DataMixture.load(text, parse_sources(text))
loader = MixtureLoader(data, micro_batch_size=4, num_workers=2, global_batch=4, seed=3, max_repeats=1.0)
it = iter(loader)
for _ in range(sum(data.source_sequences("train").values()) // 4):  # every batch the sources fill
    next(it)
del it  # its workers read ahead to the cap (AllCapped): they must end now, and not hold up the exit
deadline = time.time() + 10
while multiprocessing.active_children() and time.time() < deadline:
    time.sleep(0.1)
print(len(multiprocessing.active_children()))
"""


def test_loader_workers_that_read_to_the_cap_end_with_the_iterator(sources):
    """Before: the iterator's AllCapped was kept with its traceback (a cycle through the loader's
    frame), so the DataLoader iterator was freed by the garbage collector after its queues: its
    workers never heard the shutdown (20 s of joins) and, ignoring SIGTERM, held the
    interpreter's exit forever."""
    text = f"a=0.5:{sources['a']},c=0.5:{sources['c']}"
    started = time.time()
    r = subprocess.run([sys.executable, "-c", CAPPED_AND_DROPPED, text], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "0", r.stdout  # no worker left once the iterator is gone
    assert time.time() - started < 60


# -- a run ----------------------------------------------------------------------------------


def final_val(out: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "val" in r][-1]["val"]


@pytest.mark.slow
def test_mixture_run_resumes_exactly_and_validates_each_source(sources, tmp_path):
    """Two ranks, ZeRO-3, three sources (c capped), a token budget: SIGKILLed and resumed, every
    step's loss is the uninterrupted run's; resumed on one rank, every step reads the same
    samples (the data digest summed over the ranks); each source's validation at every depth equals
    `grt eval --data <its manifest>` on the final checkpoint, and `grt eval` of the run's own
    mixture gives the same table and the same weighted mean."""
    data = ",".join(f"{n}={w}:{sources[n]}" for n, w in (("a", 0.5), ("b", 0.2), ("c", 0.3)))
    budget = 14 * 8 * 64  # 14 steps of 2 ranks x micro-batch 4 x 64 tokens
    sets = ["train.save_every=4", "train.eval_every=14", "train.eval_batches=2", "train.max_repeats=1"]
    sets.append(f"train.tokens={budget}")

    def args(out: Path) -> list[str]:
        a = train_args(Path("unused"), out, 1000, *sets)
        a[a.index("unused")] = data
        del a[a.index("--steps") : a.index("--steps") + 2]  # the budget sets the length (--steps too: refused)
        return a

    ref = tmp_path / "ref"
    rcs, job = run_job(args(ref), tmp_path / "logs")
    assert rcs == [0, 0], job.output()
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["steps"] == 14 and "c" in summary["sources_at_cap"], summary
    log = (ref / "train.log").read_text()
    said = job.output(0, tail=100_000)  # the whole log: the start's phase lines come before the budget's
    assert "train.tokens=7168: 14 steps" in said and "mixture source 'c' reached train.max_repeats=1" in log

    out = tmp_path / "run"
    job = Job(args(out), tmp_path / "logs")
    with job:
        wait_for(lambda: last_step(out) >= 6, 240, job, "step 6")
        job.kill()
    rcs, job = run_job([*args(out), "--resume"], tmp_path / "logs")
    assert rcs == [0, 0], job.output()
    assert losses(out) == losses(ref)

    # the reference's step-8 checkpoint continued on 1 rank: every later step reads the same samples
    one = tmp_path / "one-rank"
    shutil.copytree(ref, one)
    for tag in (one / "checkpoints").iterdir():
        if tag.name.startswith("step") and tag.name > "step00000008":
            shutil.rmtree(tag)
    rcs, job = run_job([*args(one), "--resume"], tmp_path / "logs", world=1)
    assert rcs == [0], job.output()
    assert "on 1 rank(s) instead of 2" in job.output(0), job.output(0)
    want, got = per_step(ref), per_step(one)
    assert sorted(got) == sorted(want) and all(got[s][1] == want[s][1] for s in range(9, 15)), (got, want)

    val = final_val(ref)
    assert set(k for k in val if k.startswith("val/") and k.endswith("/loss") and k != "val/loss") == {
        "val/a/loss",
        "val/b/loss",
    }  # c has no validation split
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in val if k.startswith("val/a/loss_depth_"))
    assert depths[0] == 0 and len(depths) >= 3  # every exit depth, from the prelude's output to R
    for name in ("a", "b"):  # 2 ranks x 2 batches of 4 = the first 16 samples: one process, 4 batches of 4
        r = grt("eval", str(ref), "--tasks", "val", "--data", str(sources[name]), "--batch-size", "4",
                "--max-batches", "4", "--json-out", str(tmp_path / f"{name}.json"))  # fmt: skip
        assert r.returncode == 0, r.stderr
        alone = json.loads((tmp_path / f"{name}.json").read_text())["val"]
        for k in depths:
            assert val[f"val/{name}/loss_depth_{k}"] == pytest.approx(alone[str(k)]["loss"], rel=1e-5)
    r = grt("eval", str(ref), "--tasks", "val", "--batch-size", "4", "--max-batches", "4",
            "--json-out", str(tmp_path / "mix.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    mixed = json.loads((tmp_path / "mix.json").read_text())
    assert set(mixed["val_by_source"]) == {"a", "b"} and "val loss a" in r.stdout
    for k in depths:
        assert mixed["val_by_source"]["a"][str(k)]["loss"] == pytest.approx(val[f"val/a/loss_depth_{k}"], rel=1e-5)
        assert mixed["val"][str(k)]["loss"] == pytest.approx(val[f"val/loss_depth_{k}"], rel=1e-5)
        expect = (0.5 * val[f"val/a/loss_depth_{k}"] + 0.2 * val[f"val/b/loss_depth_{k}"]) / 0.7
        assert val[f"val/loss_depth_{k}"] == pytest.approx(expect, rel=1e-9)


def test_a_resume_may_change_the_weights_not_the_sources(sources):
    """The state carries each source's draws: new weights go on from them; another source list is refused."""
    _, loaders = steps(mixture(sources, a=0.7, b=0.3), world=1, micro=8, workers=0, n=5)
    state = loaders[0].state_dict()
    _, again = steps(mixture(sources, a=0.1, b=0.9), world=1, micro=8, workers=0, n=5, state=state)
    before, after = state["cursors"], again[0].state_dict()["cursors"]
    grew = {n: after[n] - before[n] for n in "ab"}
    assert again[0].state_dict()["position"] == state["position"] + 40 and sum(grew.values()) == 40
    assert grew["b"] > 2 * grew["a"] >= 0, grew  # the new weights, from the draws so far
    with pytest.raises(ValueError, match="loader state was saved for mixture sources"):
        MixtureLoader(mixture(sources, a=0.5, c=0.5), micro_batch_size=8).load_state_dict(state)


def test_single_manifest_runs_keep_their_loader(sources):
    """A plain manifest is not a mixture: its loader (and its checkpoints' state) is the single-manifest one."""
    assert not isinstance(load_manifest(str(sources["a"])), DataMixture)
    data = mixture(sources, a=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = MixtureLoader(data, micro_batch_size=4)
        with pytest.raises(ValueError, match="single manifest's"):
            loader.load_state_dict(TokenBatchLoader(data.manifest, micro_batch_size=4).state_dict())
    assert np.array_equal(loader.cursors, [0])
