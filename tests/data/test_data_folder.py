"""A data folder has one owner while written and is replaced only whole and only when asked
(issue 49, docs/reliability.md "Nothing clobbered"):

- `grt data join` refuses to replace an existing manifest that says something else (its shards
  would be orphaned, a run trained on it could no longer resume) unless `--overwrite`;
- `grt data prepare` owns its output folder while it writes (a lock): a second prepare into the
  same folder is refused, changing nothing;
- a prepare over an existing folder stopped by SIGINT or SIGTERM leaves the old folder as it was
  (hashed), never set aside as `.NAME.oldPID` without a manifest.

Real `grt data` processes on the bundled text.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under `root`: path -> sha256 ('dir' for a folder)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def grt(*args: object, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *map(str, args)], cwd=REPO, env=ENV, capture_output=True, text=True, **kw
    )


def start(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pretrain.cli", *map(str, args)],
        cwd=REPO,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal gives it
    )


def one_line(rc: int, stderr: str, code: int, *words: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == code, f"exit {rc}: {stderr[-3000:]}"
    assert len(lines) == 1 and "Traceback" not in stderr, lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A tokenizer (vocab 512) and two input files: the bundled text in two halves, and the whole
    text 8 times (a prepare of several seconds)."""
    root = tmp_path_factory.mktemp("folder")
    text = TEXT.read_text()
    half = len(text) // 2
    (root / "in").mkdir()
    (root / "in" / "a.txt").write_text(text[:half])
    (root / "in" / "b.txt").write_text(text[half:])
    (root / "big.txt").write_text(text * 8)
    res = grt("data", "tokenizer", "-i", TEXT, "--txt-mode", "paragraph", "--vocab-size", 512, "-o", root / "tok", "-q")
    assert res.returncode == 0, res.stderr
    return root


def prepare_args(data: Path, inputs: Path, out: Path) -> list[object]:
    return ["data", "prepare", "-i", inputs, "--txt-mode", "paragraph", "-t", data / "tok.model", "-o", out]


def parts(data: Path, out: Path, seq_len: int) -> None:
    for i in range(2):
        args = prepare_args(data, data / "in", out) + ["--seq-len", seq_len, "--part", f"{i}/2", "-q"]
        res = grt(*args)
        assert res.returncode == 0, res.stderr


def test_join_replaces_an_existing_manifest_only_when_asked(data, tmp_path):
    """Before: a second join (parts prepared again with another seq_len) replaced the manifest
    without a word, orphaning the shards the first described."""
    out = tmp_path / "joined"
    parts(data, out, 64)
    assert grt("data", "join", out).returncode == 0
    again = grt("data", "join", out)  # the same parts: the same manifest, nothing replaced
    assert again.returncode == 0, again.stderr
    first = (out / "manifest.json").read_bytes()
    for d in out.glob("part-*"):
        shutil.rmtree(d)
    parts(data, out, 32)
    before = tree(out)
    res = grt("data", "join", out)
    one_line(res.returncode, res.stderr, 2, "grt data join: error: ", "manifest.json", "--overwrite")
    assert tree(out) == before and (out / "manifest.json").read_bytes() == first
    res = grt("data", "join", out, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").read_bytes() != first


def wait_for_shard(proc: subprocess.Popen, out: Path, before: set[str]) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        made = set(os.listdir(out)) - before if out.is_dir() else set()
        if any(name.endswith(".tar") for name in made):
            return
        time.sleep(0.02)
    raise AssertionError("prepare ended before its first shard: make the text bigger")


def test_a_second_prepare_into_a_folder_being_written_is_refused(data, tmp_path):
    """Before: both exited 0, one tokenizer's shards under the other's manifest."""
    out = tmp_path / "shards"
    first = start(
        *prepare_args(data, data / "big.txt", out), "--seq-len", 64, "--shard-size-mb", 0.1, "--workers", 1, "-q"
    )
    try:
        wait_for_shard(first, out, set())
        second = grt(*prepare_args(data, data / "in", out), "--seq-len", 32, "-q", timeout=120)
        one_line(second.returncode, second.stderr, 2, "grt data prepare: error: ", str(out), "another")
    finally:
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    check = grt("data", "inspect", out, "--verify")
    assert check.returncode == 0 and "seq_len 64" in check.stdout, check.stdout + check.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_a_prepare_over_an_existing_folder_leaves_it_as_it_was(data, tmp_path, sig):
    """Before: SIGTERM left the old manifest and shards set aside as `.NAME.oldPID`, the folder
    without a manifest (the data lost until renamed by hand)."""
    out = tmp_path / "shards"
    res = grt(*prepare_args(data, data / "in", out), "--seq-len", 64, "--shard-size-mb", 0.1, "-q")
    assert res.returncode == 0, res.stderr
    before = tree(tmp_path)
    proc = start(  # another prepare's output: replaced only with --overwrite
        *prepare_args(data, data / "big.txt", out), "--seq-len", 64, "--shard-size-mb", 0.1, "--workers", 2, "-q",
        "--overwrite",
    )  # fmt: skip
    wait_for_shard(proc, out, set(os.listdir(out)))
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    one_line(proc.returncode, stderr, 128 + sig, f"grt data prepare: interrupted by {sig.name}")
    assert tree(tmp_path) == before
