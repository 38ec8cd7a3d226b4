"""Shards are checked against the manifest's identity when read (issue 49, docs/reliability.md
"Nothing clobbered"): a shard of the same size made with another tokenizer (or rewritten since) is
refused by the loader, naming it, with the check made once per shard and reader; `grt train
--dry-run` checks that every shard exists or answers and is the one listed; the environment the
loader's workers read (GRT_SHARD_*) is checked at the start.

Real shards of the bundled text from two tokenizers of the same vocabulary size (vocab 512, seq 64).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import data_commands, error_lines, grt_in_process, manifest_of
from train_jobs import train_args

from data_pipeline import shard_reader
from data_pipeline.loader import TokenBatchLoader
from data_pipeline.shards import ShardError

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """Shards of the bundled text made with another tokenizer of the same vocabulary (trained on the
    text's second half): the same shard sizes, other tokens."""
    root = tmp_path_factory.mktemp("other")
    half = root / "half.txt"
    text = TEXT.read_text()
    half.write_text(text[len(text) // 2 :])
    tokenizer, prepare = data_commands(TEXT, root)
    tokenizer[tokenizer.index("-i") + 1] = str(half)
    for args in (tokenizer, prepare):
        res = subprocess.run([sys.executable, "-m", "pretrain.cli", *args], cwd=REPO, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    return manifest_of(root)


def swapped(shards: Path, other: Path, tmp_path: Path, name: str = "train-000001.tar") -> tuple[Path, Path]:
    """A copy of `shards`' folder whose shard `name` is the other tokenizer's of that name (same size)."""
    copy = tmp_path / "shards"
    shutil.copytree(shards.parent, copy)
    assert (copy / name).stat().st_size == (other.parent / name).stat().st_size
    shutil.copy(other.parent / name, copy / name)
    return copy / "manifest.json", copy / name


def test_a_shard_of_another_tokenizer_is_refused_when_read(shards, other, tmp_path):
    """Before: it trained silently on the other tokenizer's ids."""
    manifest, bad = swapped(shards, other, tmp_path)
    loader = TokenBatchLoader(str(manifest), micro_batch_size=4, shuffle_buffer=0)
    with pytest.raises(ShardError, match="is not the one the manifest lists") as info:
        for _ in loader:
            pass
    assert str(bad) in str(info.value) and "another tokenizer" in str(info.value)


def test_a_shard_of_another_size_is_refused_when_read(shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(shards.parent, copy)
    with open(copy / "train-000000.tar", "ab") as fh:
        fh.write(b"\0" * 512)  # a longer file: another prepare's, or appended to
    loader = TokenBatchLoader(str(copy / "manifest.json"), micro_batch_size=4, shuffle_buffer=0)
    with pytest.raises(ShardError, match="bytes, the manifest lists"):
        for _ in loader:
            pass


def test_the_identity_is_checked_once_per_shard_and_reader(shards, monkeypatch):
    """Cheap: one check (a stat and one member read) per shard a reader (a worker's epoch) opens,
    however often it opens it again (one file open at a time, shuffle blocks across shards)."""
    calls: list[str] = []
    real = shard_reader.check_identity
    monkeypatch.setattr(shard_reader, "check_identity", lambda url, *a: (calls.append(url), real(url, *a))[1])
    loader = TokenBatchLoader(str(shards), micro_batch_size=4, shuffle_buffer=64)
    n = len(json.loads(shards.read_text())["splits"]["train"])
    it = iter(loader)
    for _ in range(loader.batches_per_epoch):
        next(it)
    assert sorted(calls) == sorted(set(calls)) and len(calls) == n, (len(calls), n)


@pytest.mark.parametrize("fault", ["missing", "another tokenizer's"])
def test_a_dry_run_checks_every_shard(shards, other, tmp_path, capsys, fault):
    """Before: --dry-run said "would train" over a missing last shard and over another tokenizer's."""
    manifest, bad = swapped(shards, other, tmp_path)
    if fault == "missing":
        shutil.copy(shards.parent / bad.name, bad)
        bad = bad.with_name(sorted(p.name for p in bad.parent.glob("train-*.tar"))[-1])
        os.unlink(bad)
    rc, err = grt_in_process([*train_args(manifest, tmp_path / "run", 2), "--dry-run"], capsys)
    said = error_lines(err, "[WARNING]")
    assert rc == 2 and len(said) == 1, err
    assert said[0].startswith("grt train: error: ") and str(bad) in said[0], said
    assert not (tmp_path / "run").exists()
    rc, err = grt_in_process([*train_args(shards, tmp_path / "run", 2), "--dry-run"], capsys)
    assert rc == 0 and "would train" in err, err


@pytest.mark.parametrize("name, value", [("GRT_SHARD_TIMEOUT_S", "soon"), ("GRT_SHARD_CONNECTIONS", "0")])
def test_the_loaders_environment_is_checked_at_the_start(shards, tmp_path, capsys, monkeypatch, name, value):
    """Before: read first inside a loader worker, so --dry-run passed and training failed there."""
    monkeypatch.setenv(name, value)
    rc, err = grt_in_process([*train_args(shards, tmp_path / "run", 2), "--dry-run"], capsys)
    said = error_lines(err, "[WARNING]")
    assert rc == 2 and len(said) == 1 and f"{name}={value!r}" in said[0], err
    assert not (tmp_path / "run").exists()


def test_skipping_corrupt_shards_when_every_shard_is_corrupt_is_one_data_error(shards, tmp_path):
    """Before: a RuntimeError listing every shard (a traceback in training, not the data error's line)."""
    copy = tmp_path / "shards"
    shutil.copytree(shards.parent, copy)
    for shard in copy.glob("train-*.tar"):
        shard.write_bytes(b"\0" * 1000)
    loader = TokenBatchLoader(str(copy / "manifest.json"), micro_batch_size=4, shuffle_buffer=0, skip_corrupt=True)
    with pytest.warns(RuntimeWarning, match="skipping"), pytest.raises(ShardError) as info:
        next(iter(loader))
    assert "every other shard of the split" in str(info.value) and len(str(info.value)) < 400, info.value


def test_a_redirected_shard_url_is_said_as_a_redirect(tmp_path):
    """Before: "cannot read shard ...: HTTP 302", which read as the shard's fault; now the line says
    where the server sends it and what to list instead."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from data_pipeline.remote import RangedReader
    from data_pipeline.shards import UnreachableShardError

    class Moved(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1/elsewhere/train-000000.tar")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Moved)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reader = RangedReader()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/train-000000.tar"
        with pytest.raises(UnreachableShardError, match="redirects it to http://127.0.0.1/elsewhere/"):
            reader.fetch(url, 4096, 1024, [0])
    finally:
        reader.close()
        server.shutdown()


def test_a_url_shard_of_another_tokenizer_is_refused_by_a_reader_that_starts_past_member_0(shards, other, tmp_path):
    """Every reader checks the hash of a shard behind a URL, whatever member it reads first (before:
    only the reader whose first read held member 0; the others checked the size alone, the same here)."""
    from servers import RangeServer

    from data_pipeline.manifest import Manifest

    manifest, bad = swapped(shards, other, tmp_path)
    listed = Manifest.load(str(manifest))
    entries = listed.shards("train")
    reader = shard_reader.ShardReader(
        [e.sequences for e in entries],
        listed.sample_tokens,
        listed.ext,
        listed.vocab_size,
        identities=[(e.bytes, e.head_sha256) for e in entries],
    )
    server = RangeServer(bad.parent)
    try:
        shard = [Path(e.url).name for e in entries].index(bad.name)
        url = f"{server.url}/{bad.name}"
        with pytest.raises(ShardError, match="is not the one the manifest lists") as info:
            reader.read(shard, url, [3, 4])
        assert url in str(info.value)
        good = [Path(e.url).name for e in entries].index("train-000000.tar")
        assert len(reader.read(good, f"{server.url}/train-000000.tar", [3, 4])) == 2  # the listed shard reads
    finally:
        server.stop()
