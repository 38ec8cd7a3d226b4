"""Bad input never gets a traceback, and a run is never silently changed (issue 15;
docs/reliability.md, "Bad input").

A table-driven suite feeds every `grt` command and subcommand malformed paths, wrong
types, empty files, truncated shards, a mismatched tokenizer, a foreign manifest version
and unknown flags. Each case must end with rc 2 and exactly one line on stderr, no
traceback, and leave the run directory byte-for-byte as it was (hashes before and after).
Cases run in-process through `pretrain.cli.main` (the dispatcher a `grt` process runs);
the ones where the process itself matters (launcher, a missing package, resume) run as
real processes. Inputs are built once per session.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from commands import error_lines
from commands import grt_in_process as in_process
from train_jobs import Job, run_job
from trained_models import DEMO_TEXT, ENV, REPO, grt, grt_run, manifest, single_thread  # noqa: F401 (fixtures)

TRIED: Counter = Counter()  # inputs tried per class, printed at the end (-s) for docs/reliability.md
HANDLED: Counter = Counter()


def tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def as_process(argv: list[str], env: dict | None = None) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *argv],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stderr


def check_one_line(kind: str, rc: int, stderr: str, want: str) -> None:
    TRIED[kind] += 1
    lines = error_lines(stderr)
    assert "Traceback" not in stderr, stderr
    assert rc == 2, f"rc {rc}: {stderr}"
    assert len(lines) == 1, stderr
    assert want in lines[0], lines[0]
    HANDLED[kind] += 1


# ------------------------------------------------------------------------------- inputs, built once
def prepare_with(tok_args: list[str], root: Path) -> Path:
    """Shards of a slice of the demo text made with a tokenizer trained with tok_args."""
    grt("data", "tokenizer", "-i", str(DEMO_TEXT), "--txt-mode", "paragraph", *tok_args, "-o", str(root / "tok"), "-q")
    grt(
        "data",
        "prepare",
        "-i",
        str(DEMO_TEXT),
        "--txt-mode",
        "paragraph",
        "-t",
        str(root / "tok.model"),
        "-o",
        str(root / "shards"),
        "--seq-len",
        "64",
        "--shard-size-mb",
        "0.1",
        "--val-fraction",
        "0.05",
        "--max-mb",
        "0.15",
        "-q",
    )
    return root / "shards" / "manifest.json"


def edited_manifest(src: Path, dest: Path, edit) -> Path:
    """A copy of manifest `src` (shard and tokenizer paths made absolute) after edit(raw)."""
    raw = json.loads(src.read_text())
    for entries in raw["splits"].values():
        for e in entries:
            e["name"] = str(src.parent / e["name"])
    raw["tokenizer"]["path"] = str(src.parent / raw["tokenizer"]["path"])
    edit(raw)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "manifest.json").write_text(json.dumps(raw))
    return dest / "manifest.json"


@pytest.fixture(scope="module")
def bad(grt_run, manifest, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_input")
    val_shard = Path(json.loads(manifest.read_text())["splits"]["val"][0]["name"])
    truncated = root / "truncated" / val_shard.name
    truncated.parent.mkdir()
    truncated.write_bytes((manifest.parent / val_shard).read_bytes()[:3000])

    def truncate_val(raw):
        raw["splits"]["val"] = [dict(raw["splits"]["val"][0], name=str(truncated))]

    empty = root / "empty.json"
    empty.write_text("")
    empty_txt = root / "empty.txt"
    empty_txt.write_text("")
    not_json = root / "notjson.json"
    not_json.write_text("{ this is not json")
    run_copy = root / "run"
    shutil.copytree(grt_run, run_copy)
    return {
        "run": run_copy,
        "manifest": manifest,
        "empty": empty,
        "empty_txt": empty_txt,
        "not_json": not_json,
        "missing": root / "does" / "not" / "exist",
        "no_val": edited_manifest(manifest, root / "no_val", lambda raw: raw["splits"].pop("val")),
        "truncated_val": edited_manifest(manifest, root / "truncated_val", truncate_val),
        "version": edited_manifest(manifest, root / "version", lambda raw: raw.update(version=99)),
        "foreign": edited_manifest(manifest, root / "foreign", lambda raw: raw.update(format="something-else")),
        "no_seq_len": edited_manifest(manifest, root / "no_seq_len", lambda raw: raw.pop("seq_len")),
        # another tokenizer of the same vocabulary size (trained on less text), and a larger one
        "other_tok": prepare_with(["--vocab-size", "512", "--max-chars", "60000"], root / "other_tok"),
        "big_tok": prepare_with(["--vocab-size", "600"], root / "big_tok"),
        "tokenizer": grt_run
        / "checkpoints"
        / (grt_run / "checkpoints" / "latest").read_text().strip()
        / "tokenizer.model",
        "other_tokenizer": root / "other_tok" / "tok.model",
    }


def fill(args: list, paths: dict) -> list[str]:
    return [str(paths[a[1:]]) if isinstance(a, str) and a.startswith("@") else a for a in args]


# (class, argv with @name for a built input, text the one line must contain)
CASES = [
    # -- unknown flags and wrong types (argparse, every command)
    ("unknown flag", ["presets", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["train", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["export", "--checkpoint", "@run", "--out", "@missing", "--frobnicate"], "unrecognized"),
    ("unknown flag", ["eval", "@run", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["generate", "@run", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["analyze", "@run", "--out", "@missing", "--frobnicate"], "unrecognized"),
    (
        "unknown flag",
        ["compare", "--configs", "micro-grt", "--data", "@manifest", "--out", "@missing", "--frobnicate"],
        "unrecognized arguments: --frobnicate",
    ),
    ("unknown flag", ["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["data", "inspect", "@manifest", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["data", "frobnicate"], "invalid choice: 'frobnicate'"),
    ("unknown flag", ["bench", "frobnicate"], "invalid choice: 'frobnicate'"),
    ("unknown flag", ["bench", "data", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["bench", "decode", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown flag", ["frobnicate"], "unknown command 'frobnicate'"),
    ("wrong type", ["train", "--steps", "many"], "argument --steps: invalid int value: 'many'"),
    ("wrong type", ["eval", "@run", "--batch-size", "eight"], "invalid int value: 'eight'"),
    ("wrong type", ["generate", "@run", "--temperature", "hot"], "invalid float value: 'hot'"),
    (
        "wrong type",
        ["data", "prepare", "-i", "@empty_txt", "-t", "@tokenizer", "-o", "@missing", "--seq-len", "x"],
        "invalid int value: 'x'",
    ),
    ("wrong type", ["bench", "train-step", "--steps", "x"], "'x': expected a whole number >= 1"),
    ("bad value", ["bench", "loss", "--tokens", "0"], "'0': expected a whole number >= 1"),
    ("bad value", ["bench", "precision", "--preset", "nope", "--train-steps", "0"], "unknown preset 'nope'"),
    ("bad value", ["bench", "zero", "--vocab", "100", "--presets", "micro-grt"], "vocab_size must be in [258, 50257]"),
    (
        "bad value",
        [
            "train",
            "--preset",
            "micro-grt",
            "--data",
            "@manifest",
            "--out",
            "@missing",
            "--set",
            "model.state_dtype=fp16",
            "--dry-run",
        ],
        "state_dtype='fp16': accepted values are fp32, weights",
    ),
    ("wrong type", ["eval", "@run", "--kv-cache", "half"], "invalid choice: 'half'"),
    (
        "wrong type",
        ["train", "--set", "train.steps=many", "--preset", "micro-grt", "--data", "@manifest"],
        "train.steps='many'",
    ),
    ("wrong type", ["eval", "@run", "--depths", "two"], "--depths 'two'"),
    ("wrong type", ["export", "--checkpoint", "@run", "--out", "@missing", "--dtype", "fp7"], "dtype='fp7'"),
    # -- malformed or missing paths
    ("missing path", ["eval", "@missing", "--tasks", "val"], "no such file or directory"),
    ("missing path", ["generate", "@missing"], "no such file or directory"),
    ("missing path", ["analyze", "@missing", "--out", "@missing"], "no such file or directory"),
    ("missing path", ["export", "--checkpoint", "@missing", "--out", "@missing"], "neither an exported model"),
    ("missing path", ["eval", "@run", "--tasks", "val", "--data", "@missing"], "pass --data"),
    ("missing path", ["train", "--preset", "micro-grt", "--data", "@missing", "--out", "@missing"], "no such manifest"),
    ("missing path", ["train", "--config-json", "@missing"], "no such file"),
    ("missing path", ["demo", "--text", "@missing", "--out", "@missing"], "no such file"),
    ("missing path", ["demo", "--out", "@run"], "already holds a run"),
    ("wrong type", ["demo", "--steps", "x"], "invalid int value: 'x'"),
    ("wrong type", ["presets", "--json", "yes"], "unrecognized arguments: yes"),
    ("missing path", ["data", "inspect", "@missing"], "not found"),
    ("missing path", ["data", "tokenizer", "-i", "@missing", "-o", "@missing"], "does/not/exist"),
    ("missing path", ["data", "prepare", "-i", "@empty_txt", "-t", "@missing", "-o", "@missing"], "not found"),
    ("missing path", ["generate", "@run", "--tokenizer", "@missing"], "not found"),
    ("missing path", ["bench", "data", "--input", "@missing", "--tokenizer", "@tokenizer"], "does/not/exist"),
    ("missing path", ["compare", "--configs", "@missing", "--data", "@manifest", "--out", "@missing"], "not a preset"),
    ("missing path", ["train", "--data", "@manifest", "--model-config", "@missing"], "no such file"),
    # -- empty and malformed files
    ("empty file", ["train", "--config-json", "@empty"], "not valid JSON"),
    ("empty file", ["train", "--preset", "micro-grt", "--data", "@empty", "--out", "@missing"], "not valid JSON"),
    ("empty file", ["data", "inspect", "@empty"], "not valid JSON"),
    ("empty file", ["data", "inspect", "@not_json"], "not valid JSON"),
    ("empty file", ["eval", "@run", "--tasks", "val", "--data", "@empty"], "not valid JSON"),
    (
        "empty file",
        ["data", "tokenizer", "-i", "@empty_txt", "-o", "@missing", "--vocab-size", "300", "-q"],
        "empty.txt",
    ),
    ("empty file", ["compare", "--configs", "@empty", "--data", "@manifest", "--out", "@missing"], "not valid JSON"),
    ("empty file", ["generate", "@run", "--tokenizer", "@empty"], "empty.json"),
    # -- foreign manifest (version, format, missing field)
    ("foreign manifest", ["data", "inspect", "@version"], "has version 99"),
    ("foreign manifest", ["eval", "@run", "--tasks", "val", "--data", "@version"], "has version 99"),
    (
        "foreign manifest",
        ["train", "--preset", "micro-grt", "--data", "@version", "--out", "@missing"],
        "has version 99",
    ),
    ("foreign manifest", ["eval", "@run", "--tasks", "val", "--data", "@foreign"], "is not a grt-token-shards"),
    ("foreign manifest", ["eval", "@run", "--tasks", "val", "--data", "@no_seq_len"], "malformed"),
    ("foreign manifest", ["analyze", "@run", "--out", "@missing", "--data", "@version"], "has version 99"),
    # -- truncated shards and missing splits (issue 15, rows 1-2)
    ("truncated shard", ["eval", "@run", "--tasks", "val", "--data", "@truncated_val"], "corrupt or truncated shard"),
    ("truncated shard", ["eval", "@run", "--tasks", "val", "--data", "@no_val"], "its splits: train"),
    ("truncated shard", ["eval", "@run", "--tasks", "val", "--split", "test"], "has no 'test' split"),
    # -- another tokenizer (issue 15, rows 3 and 5)
    ("mismatched tokenizer", ["eval", "@run", "--tasks", "val", "--data", "@other_tok"], "cannot switch tokenizer"),
    ("mismatched tokenizer", ["eval", "@run", "--tasks", "val", "--data", "@big_tok"], "cannot switch tokenizer"),
    ("mismatched tokenizer", ["generate", "@run", "--tokenizer", "@other_tokenizer"], "cannot switch tokenizer"),
    (
        "mismatched tokenizer",
        ["analyze", "@run", "--out", "@missing", "--data", "@other_tok"],
        "cannot switch tokenizer",
    ),
]


@pytest.mark.parametrize(
    "kind,argv,want", CASES, ids=[f"{c[0]}:{' '.join(map(str, c[1][:2]))}-{i}" for i, c in enumerate(CASES)]
)
def test_bad_input_is_one_line_and_changes_nothing(bad, capsys, kind, argv, want):
    before = tree_hash(bad["run"])
    rc, err = in_process(fill(argv, bad), capsys)
    check_one_line(kind, rc, err, want)
    assert not bad["missing"].exists(), "an output was written for a refused command"
    assert tree_hash(bad["run"]) == before, "the run directory changed"


# ------------------------------------------------------------------- resume (issue 15, rows 4, 6, 7)
def resume_argv(run: Path, data: Path, *extra: str) -> list[str]:
    """Resume `run` with its own saved config, on `data`."""
    step = (run / "checkpoints" / "latest").read_text().strip()
    return [
        "train",
        "--config-json",
        str(run / "checkpoints" / step / "config.json"),
        "--out",
        str(run),
        "--data",
        str(data),
        "--resume",
        *extra,
    ]


RESUME_CASES = [
    ("mismatched tokenizer", ["@other_tok"], "cannot switch tokenizer"),
    ("mismatched tokenizer", ["@other_tok", "--set", "train.allow_data_change=true"], "cannot switch tokenizer"),
    ("mismatched tokenizer", ["@big_tok", "--set", "train.allow_data_change=true"], "cannot switch tokenizer"),
    ("changed schedule", ["@manifest", "--set", "train.lr=1e-3"], "train.lr 0.003 -> 0.001"),
    ("changed schedule", ["@manifest", "--set", "train.warmup_steps=2"], "train.warmup_steps 10 -> 2"),
    # the global batch is kept (micro-batch 4 would be accepted, with grad_accum 2): a size that cannot keep it
    ("changed schedule", ["@manifest", "--micro-batch-size", "3"], "global batch of 8 sequences"),
    ("changed schedule", ["@manifest", "--grad-accum", "2"], "train.grad_accum 2 would change the global batch of 8"),
    ("changed schedule", ["@manifest", "--set", "train.schedule_steps=60"], "train.schedule_steps 30 -> 60"),
    ("changed schedule", ["@manifest", "--set", "model.d_model=64"], "model.d_model 32 -> 64"),
]


@pytest.mark.parametrize("kind,args,want", RESUME_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RESUME_CASES)])
def test_resume_refusals_change_nothing(bad, capsys, kind, args, want):
    """A resume that would switch tokenizer, model, schedule or batch size is refused in one
    line naming what changes, before any process group; config.json is not rewritten."""
    import torch.distributed as dist

    run = bad["run"]
    before = tree_hash(run)
    data, *extra = fill(args, bad)
    rc, err = in_process(resume_argv(run, Path(data), *extra), capsys)
    check_one_line(kind, rc, err, want)
    assert not dist.is_initialized()
    assert tree_hash(run) == before, "the run directory changed"


def test_launch_with_missing_manifest_is_one_line_before_any_rank(bad, tmp_path):
    """Issue 15, row 8: checked once by the launcher, no rank started."""
    rc, err = as_process(
        [
            "launch",
            "--procs-per-node",
            "2",
            "--",
            "--preset",
            "micro-grt",
            "--data",
            str(bad["missing"]),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    check_one_line("missing path", rc, err, "no such manifest")
    assert not (tmp_path / "run").exists()
    rc, err = as_process(["launch", "--dry-run", "--", *resume_argv(bad["run"], bad["other_tok"])[1:]])
    check_one_line("mismatched tokenizer", rc, err, "cannot switch tokenizer")


def test_launch_on_a_world_size_that_cannot_keep_the_global_batch_is_one_line_before_any_rank(bad):
    """Issue 28, 4.: the checkpoint's global batch of 8 (micro-batch 8 x 1 rank) cannot be split
    over 3 ranks: `grt launch` refuses it once, naming the sizes that can, and starts no rank;
    on 2 ranks with micro-batch 4 it is kept (grad_accum 1) and the launch is accepted."""
    before = tree_hash(bad["run"])

    def launch_resume(ranks: int, *extra: str) -> tuple[int, str]:
        train = resume_argv(bad["run"], bad["manifest"], *extra)[1:]
        return as_process(["launch", "--dry-run", "--procs-per-node", str(ranks), "--", *train])

    rc, err = launch_resume(3)
    check_one_line("changed schedule", rc, err, "world sizes that can, with micro-batch 8: 1; micro-batch sizes")
    assert "allow_batch_change" in err
    rc, err = launch_resume(2, "--micro-batch-size", "4")
    assert rc == 0, err
    assert tree_hash(bad["run"]) == before


def test_launch_of_selective_checkpointing_under_zero3_is_one_line_before_any_rank(bad, tmp_path):
    """The launcher refuses it once, as the Trainer would on every rank (docs/performance.md)."""
    rc, err = as_process(
        [
            "launch",
            "--dry-run",
            "--procs-per-node",
            "2",
            "--",
            "--preset",
            "micro-grt",
            "--data",
            str(bad["manifest"]),
            "--out",
            str(tmp_path / "run"),
            "--ds-config",
            "ds_configs/zero3.json",
            "--set",
            "train.activation_checkpointing=selective",
        ]
    )
    check_one_line("wrong type", rc, err, "train.activation_checkpointing='selective' is refused under ZeRO stage 3")
    assert not (tmp_path / "run").exists()


def test_export_without_transformers_is_one_line_and_writes_nothing(tmp_path, capsys):
    """Issue 15, last row: a dense export without transformers names the pip extra and
    leaves no folder. transformers is made unimportable in a real process."""
    from trained_models import train

    dense = train("micro-dense", 6)
    shim = tmp_path / "shim" / "transformers"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'transformers'\")\n")
    out = tmp_path / "export"
    rc, err = as_process(
        ["export", "--checkpoint", str(dense), "--out", str(out)],
        env={"PYTHONPATH": f"{shim.parent}{os.pathsep}{REPO}"},
    )
    check_one_line("missing dependency", rc, err, "pip install 'grt-pretrain[hf]'")
    assert not out.exists() and not list(tmp_path.glob(".export*")), "a half-written export was left"


def export_contents(out: Path) -> dict[str, str]:
    """Hashes of an export's files; the weights by their tensors (safetensors orders its
    metadata differently from one write to the next)."""
    from safetensors.torch import load_file

    files = tree_hash(out)
    weights = load_file(str(out / "model.safetensors"))
    files["model.safetensors"] = hashlib.sha256(
        b"".join(k.encode() + weights[k].numpy().tobytes() for k in sorted(weights))
    ).hexdigest()
    return files


def test_export_is_complete_or_absent(grt_run, tmp_path, monkeypatch):
    """A failure while writing leaves neither --out nor the temporary folder; --overwrite
    replaces a previous export only once the new one is complete."""
    import safetensors.torch

    from pretrain.infer.export import export

    out = tmp_path / "export"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_disk)
        with pytest.raises(OSError):
            export(grt_run, out)
    assert list(tmp_path.iterdir()) == [], "a partial export was left"
    export(grt_run, out)
    (out / "mine.txt").write_text("from before")
    previous = export_contents(out)
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_disk)
        with pytest.raises(OSError):
            export(grt_run, out, overwrite=True)
    assert export_contents(out) == previous, "the previous export changed"
    export(grt_run, out, overwrite=True)
    assert export_contents(out) == {k: v for k, v in previous.items() if k != "mine.txt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_zz_report_counts():
    """The figures for docs/reliability.md (run with -s)."""
    print(
        "\nBAD INPUT "
        + "; ".join(f"{k}: {HANDLED[k]}/{TRIED[k]}" for k in sorted(TRIED))
        + f"; total {sum(HANDLED.values())}/{sum(TRIED.values())}"
    )
    assert HANDLED == TRIED


@pytest.mark.slow
def test_resume_with_more_steps_keeps_the_started_schedule(grt_run, tmp_path):
    """Issue 15, row 7: a run of 30 steps resumed with --steps 40 says so in one line and
    keeps its 30-step schedule: the learning rate goes on at min_lr (where the cosine of
    the started run ended) instead of being rebuilt over 40 steps (which would raise it
    to ~6.7e-4 at step 31)."""
    run = tmp_path / "run"
    shutil.copytree(grt_run, run)
    saved = json.loads((run / "checkpoints" / "step00000030" / "config.json").read_text())
    argv = resume_argv(run, Path(saved["data"]), "--steps", "40", "--set", "train.log_every=1")
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *argv], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("grt train: resuming")]
    assert len(notes) == 1 and "train.steps 30 -> 40" in notes[0] and "keeps its 30-step horizon" in notes[0], notes
    min_lr = saved["train"]["min_lr"]
    for step in (31, 40):
        lr = float(proc.stdout.split(f"step {step}/40 |")[1].split("| lr ")[1].split()[0])
        assert lr == pytest.approx(min_lr, rel=1e-2), f"step {step}: the learning rate jumped to {lr} (not {min_lr})"
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["steps"] == 40 and config["train"]["schedule_steps"] == 30


# ---------------------------------------------------- a rank that fails in a multi-rank `grt eval`
# sitecustomize for the failing rank: once its command ends with an error, the process (and its
# connections) stays alive, as a rank whose exit an NCCL collective does not notice. The others
# must stop on the error it reported, not on its exit.
HOLD_AFTER_ERROR = """import time
import pretrain.distributed.error_boundary as pd  # where run_command finds it
exit_now = pd.exit_process
def exit_later(code):
    if code:
        time.sleep(600)
    return exit_now(code)
pd.exit_process = exit_later
"""
STOP_WITHIN_S = 60  # the process group's timeout is 600 s


def rank_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("grt eval: error:")]
    assert len(lines) == 1 and "Traceback" not in output, output[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def one_rank_corrupt(bad, tmp_path_factory) -> tuple[Path, Path, int]:
    """A manifest whose val split is a copy of the val shard with one member corrupt (token ids
    beyond the vocabulary), a member that only one of 2 ranks reads at --batch-size 5 and
    --max-batches 1 (round 0: rank 0 reads samples 0-4, rank 1 samples 5-9); the shard; the rank
    that reads it."""
    from data_pipeline.shards import ShardError, member_size
    from pretrain.distributed import Dist
    from pretrain.infer.evaluation.scoring import val_batches

    raw = json.loads(bad["manifest"].read_text())
    entry = raw["splits"]["val"][0]
    root = tmp_path_factory.mktemp("one_rank_corrupt")
    corrupt = root / Path(entry["name"]).name
    shard = bytearray((bad["manifest"].parent / entry["name"]).read_bytes())
    stride = member_size(raw["seq_len"] + 1, raw["dtype_ext"])
    shard[7 * stride + 512 : 7 * stride + 520] = b"\xff" * 8  # member 7's first tokens: id 65535
    corrupt.write_bytes(bytes(shard))
    data = edited_manifest(
        bad["manifest"], root, lambda raw: raw["splits"].update(val=[dict(entry, name=str(corrupt))])
    )
    failing = []
    for rank in (0, 1):
        try:
            list(val_batches(str(data), 5, Dist(rank, 2), 1, seed=1234))
        except ShardError:
            failing.append(rank)
    assert failing == [1], failing
    return data, corrupt, failing[0]


def eval_argv(run: Path, data: Path) -> list[str]:
    return ["eval", str(run), "--tasks", "val", "--data", str(data), "--batch-size", "5", "--max-batches", "1"]


@pytest.mark.slow
def test_multi_rank_eval_stops_every_rank_on_one_ranks_corrupt_shard(bad, one_rank_corrupt, tmp_path):
    """The rank that cannot read its shard names it; the other stops at once with the same line,
    without waiting for that rank's process to end (it is kept alive here)."""
    data, truncated, failing = one_rank_corrupt
    healthy = 1 - failing
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_AFTER_ERROR)
    with Job(
        eval_argv(bad["run"], data),
        tmp_path / "logs",
        env={"CUDA_VISIBLE_DEVICES": ""},
        rank_env={failing: {"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}},
    ) as job:
        try:
            job.procs[healthy].wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {healthy} still waits {STOP_WITHIN_S} s after start:\n{job.output()}") from None
        waited = time.time() - job.started
        assert job.procs[healthy].returncode == 2, job.output()
        assert job.alive()[failing], "the failing rank was to stay alive"
        for rank in (0, 1):
            line = rank_error(job.output(rank, tail=20000))
            assert line.startswith(
                f"grt eval: error: rank {failing} failed: corrupt or truncated shard '{truncated}'"
            ), line
    print(f"\nrank {healthy} stopped {waited:.1f} s after start, rank {failing} still alive")


MODEL_MISSING_ON_THIS_NODE = (
    HOLD_AFTER_ERROR
    + """
import pretrain.infer.load as load
def missing(path, **kw):
    raise FileNotFoundError(f"{path}: no such directory on this node")
load.load_model = missing
"""
)


@pytest.mark.slow
def test_multi_rank_eval_stops_every_rank_when_one_cannot_load_the_model(bad, tmp_path):
    """A rank that fails before any sum (the model missing on its node) waits at the ranks'
    first agreement; the others must reach that agreement before any other collective (the
    held-out manifest check), or they would pair with it wrongly and wait out the timeout."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(MODEL_MISSING_ON_THIS_NODE)
    with Job(
        eval_argv(bad["run"], bad["manifest"]),
        tmp_path / "logs",
        env={"CUDA_VISIBLE_DEVICES": ""},
        rank_env={1: {"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}},
    ) as job:
        try:
            job.procs[0].wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank 0 still waits {STOP_WITHIN_S} s after start:\n{job.output()}") from None
        assert job.procs[0].returncode == 2, job.output()
        for rank in (0, 1):
            assert (
                rank_error(job.output(rank, tail=20000))
                == f"grt eval: error: rank 1 failed: {bad['run']}: no such directory on this node"
            )


@pytest.mark.slow
def test_multi_rank_eval_failure_collectives_are_on_the_comm_device(bad, one_rank_corrupt, tmp_path):
    """The same failure with a communication device that is not the CPU (tests/comm_guard.py):
    the agreement and the errors it carries travel on it; both ranks exit 2 with one line."""
    from multiproc import run_ranks

    data, truncated, failing = one_rank_corrupt
    violations = tmp_path / "violations"
    procs = run_ranks(
        [str(REPO / "tests" / "comm_guard.py"), str(violations), *eval_argv(bad["run"], data)],
        env={"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""},
        timeout=STOP_WITHIN_S,
    )
    assert violations.read_text() == ""
    for proc in procs:
        assert proc.returncode == 2, proc.stdout[-3000:]
        assert f"rank {failing} failed: corrupt or truncated shard '{truncated}'" in rank_error(proc.stdout)


@pytest.mark.slow
def test_multi_rank_eval_stops_every_rank_on_a_task_file_missing_on_one_rank(bad, tmp_path):
    """After a held-out part both ranks scored, rank 1 lacks the zero-shot file: every rank
    exits 2 naming rank 1 and the file; no table is printed."""
    eval_dir, empty = tmp_path / "eval", tmp_path / "empty"
    eval_dir.mkdir(), empty.mkdir()
    (eval_dir / "piqa.jsonl").write_text(
        "".join(
            json.dumps({"query": f"Question: q{i}\n", "choices": ["yes", "no"], "gold": i % 2}) + "\n" for i in range(4)
        )
    )
    argv = [
        "eval",
        str(bad["run"]),
        "--tasks",
        "val,piqa",
        "--data",
        str(bad["manifest"]),
        "--batch-size",
        "2",
        "--max-batches",
        "1",
    ]
    codes, job = run_job(
        argv,
        tmp_path / "logs",
        timeout=STOP_WITHIN_S,
        env={"CUDA_VISIBLE_DEVICES": "", "GRT_EVAL_DIR": str(eval_dir)},
        rank_env={1: {"GRT_EVAL_DIR": str(empty)}},
    )
    assert codes == [2, 2], job.output()
    for rank in (0, 1):
        output = job.output(rank, tail=20000)
        assert (
            rank_error(output)
            == f"grt eval: error: rank 1 failed: piqa: {empty / 'piqa.jsonl'} not found (pass --eval-dir)"
        )
        assert "val loss" not in output


def test_rank_failures_are_one_line_grouped_by_error():
    """What every rank prints when ranks failed: identical errors once, with their ranks."""
    from pretrain.distributed import RankFailed

    failed = RankFailed({5: "disk full", 0: "bad shard", 1: "bad shard", 2: "bad shard"}, code=2)
    assert str(failed) == "ranks 0-2 failed: bad shard; rank 5 failed: disk full" and failed.code == 2


def test_multi_rank_eval_refuses_a_manifest_that_only_some_ranks_see(bad, monkeypatch):
    """`--tasks all` skips the held-out split when there is no manifest; if some ranks saw one
    and others did not, their next sums would pair different parts, with the same shape. The
    ranks agree first (ranks_with); here the agreement answers as on a job where they differ."""
    from grt_common.errors import ConfigError
    from pretrain.distributed import Dist
    from pretrain.infer.evaluation import evaluate, loss_by_depth

    monkeypatch.setattr(evaluate, "ranks_with", lambda flag: 1)  # of 2: neither every rank nor none found it
    agreements = []
    monkeypatch.setattr(evaluate, "check_ranks", lambda: agreements.append("checked"))
    missing = bad["run"] / "no-such-manifest.json"
    args = evaluate.build_parser().parse_args([str(bad["run"]), "--data", str(missing)])
    with pytest.raises(ConfigError, match="no manifest .* on this node, while other ranks have it"):
        evaluate.evaluate(args, list(evaluate.ALL_PARTS), Dist(rank=0, world=2))
    assert agreements == ["checked"]  # a rank that failed before (loading) is met first
    # a rank that has it meets the ranks without it at a second agreement, which names them
    monkeypatch.setattr(evaluate, "evaluate_task", lambda *a, **k: pytest.fail("scored past the disagreement"))
    monkeypatch.setattr(loss_by_depth, "lm_sums", lambda *a, **k: pytest.fail("scored past the disagreement"))
    args = evaluate.build_parser().parse_args([str(bad["run"]), "--data", str(bad["manifest"])])
    agreements.clear()

    def fail_at_second(*_):
        agreements.append("checked")
        if len(agreements) == 2:
            raise RuntimeError("RankFailed, as raised on every rank")

    monkeypatch.setattr(evaluate, "check_ranks", fail_at_second)
    with pytest.raises(RuntimeError, match="as raised on every rank"):
        evaluate.evaluate(args, list(evaluate.ALL_PARTS), Dist(rank=0, world=2))
