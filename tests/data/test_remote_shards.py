"""Shards behind a URL (issue 42): ranged reads against real servers started here on 127.0.0.1,
Debian's nginx for HTTP and moto's S3 server mode for s3://. Each step's samples must be the
local copy's (the per-step data digest, as the trainer records it), the bytes served for an
epoch of 2 ranks x 2 workers at most 1.1 x the shards' bytes, and a server restarted in the
middle of an epoch must lose or repeat no sample."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from moto_s3 import moto_s3  # noqa: F401 (a fixture)
from servers import HOST, MotoS3, Nginx, RangeServer

from data_pipeline.loader import DIGEST_MOD, TokenBatchLoader, sample_digest
from data_pipeline.manifest import Manifest
from data_pipeline.mixture import DataMixture, parse_sources
from data_pipeline.mixture_loader import MixtureLoader
from data_pipeline.shards import MissingShardError, ShardError, UnreachableShardError, member_size

SHARDS = 24  # of the session's seq-64 shards: ~2,300 samples, enough for several shuffle blocks
KW: dict[str, Any] = {"micro_batch_size": 4, "seed": 7, "shuffle_buffer": 256, "loop": False}


def _write_manifest(src: Path, dest: Path, names: list[str], first: int, count: int) -> Path:
    """A manifest in `dest` of `src`'s train shards [first, first + count), named `names`."""
    raw = json.loads((src / "manifest.json").read_text())
    entries = raw["splits"]["train"][first : first + count]
    for e, name in zip(entries, names, strict=True):
        e["name"] = name
    raw["splits"] = {"train": entries}
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.model", dest / "tokenizer.model")
    (dest / "manifest.json").write_text(json.dumps(raw))
    return dest / "manifest.json"


@pytest.fixture(scope="module")
def served(shards, tmp_path_factory):
    """nginx serving the session's shards under /shards/, with local and http manifests of the
    first SHARDS train shards (and of two halves of them, for a mixture)."""
    src = Path(shards).parent
    tmp = tmp_path_factory.mktemp("remote")
    (tmp / "www").mkdir()
    shutil.copytree(src, tmp / "www" / "shards")
    (tmp / "www" / "cut").mkdir()
    names = [e["name"] for e in json.loads((src / "manifest.json").read_text())["splits"]["train"][:SHARDS]]
    server = Nginx(tmp / "www", tmp / "nginx")
    url = f"{server.url}/shards"
    half = SHARDS // 2
    out = {
        "server": server,
        "tmp": tmp,
        "src": str(src),
        "names": names,
        "local": _write_manifest(src, tmp / "local", [str(src / n) for n in names], 0, SHARDS),
        "http": _write_manifest(src, tmp / "http", [f"{url}/{n}" for n in names], 0, SHARDS),
        "a": _write_manifest(src, tmp / "a", [str(src / n) for n in names[:half]], 0, half),
        "b_local": _write_manifest(src, tmp / "b_local", [str(src / n) for n in names[half:]], half, half),
        "b_http": _write_manifest(src, tmp / "b_http", [f"{url}/{n}" for n in names[half:]], half, half),
    }
    yield out
    server.stop()


def _step_digests(manifest: Path, world: int, workers: int) -> list[int]:
    """Each step's data digest (summed over the ranks, as in the trainer's metrics) of one epoch."""
    per_rank = []
    for rank in range(world):
        loader = TokenBatchLoader(str(manifest), rank=rank, world_size=world, num_workers=workers, **KW)
        per_rank.append([sample_digest(b["input_ids"]) for b in loader])
    return [sum(d) % DIGEST_MOD for d in zip(*per_rank, strict=True)]


def _shard_bytes(manifest: Path) -> int:
    return sum(s.bytes for s in Manifest.load(str(manifest)).shards("train"))


def _assert_each_byte_once(ranges: list[tuple[str, int, int]], manifest: Path) -> None:
    """Every byte fetched once, but member 0: each reader (a loader worker) fetches it once for the
    shard's identity (its hash) whatever member it reads first (shard_reader.py)."""
    listed = Manifest.load(str(manifest))
    first = member_size(listed.sample_tokens, listed.ext)
    by_path: dict[str, list[tuple[int, int]]] = {}
    for path, a, b in ranges:
        by_path.setdefault(path, []).append((a, b))
    for path, spans in by_path.items():
        spans.sort()
        end = -1
        for a, b in spans:
            assert a > end or min(b, end) < first, f"{path}: bytes {a}..{min(b, end)} were fetched twice"
            end = max(end, b)


@pytest.fixture(scope="module")
def local_digests(served):
    return _step_digests(served["local"], world=2, workers=2)


def test_http_epoch_reads_each_byte_once_but_member_0_and_the_local_samples(served, local_digests):
    server = served["server"]
    server.clear_log()
    assert _step_digests(served["http"], world=2, workers=2) == local_digests
    ratio = server.bytes_served("/shards/") / _shard_bytes(served["http"])
    ranges = server.ranges("/shards/")
    samples = len(local_digests) * 2 * KW["micro_batch_size"]
    print(f"http: {ratio:.3f} x the shards' bytes, {len(ranges)} requests for {samples} samples")
    assert 0.9 < ratio <= 1.1  # all of it, once (today's streaming read about 4x)
    assert len(ranges) < samples  # neighbouring members share a request
    _assert_each_byte_once(ranges, served["http"])


def _restarted_epoch(manifest: Path, stop, start, steps: int, outage_s: float) -> tuple[list[int], float]:
    """One epoch of 2 ranks x 2 workers, the server stopped a third into it and started again
    `outage_s` later: each step's digest and the longest a step waited."""
    loaders = [TokenBatchLoader(str(manifest), rank=r, world_size=2, num_workers=2, **KW) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    digests, longest_wait, restarter = [], 0.0, None
    for step in range(steps):
        if step == steps // 3:
            stop()
            restarter = threading.Timer(outage_s, start)
            restarter.start()
        t0 = time.monotonic()
        digests.append(sum(sample_digest(next(it)["input_ids"]) for it in its) % DIGEST_MOD)
        longest_wait = max(longest_wait, time.monotonic() - t0)
    assert restarter is not None
    restarter.join()
    assert all(next(it, None) is None for it in its)  # nothing more in the epoch
    return digests, longest_wait


def test_http_server_restarted_mid_epoch_loses_or_repeats_nothing(served, local_digests, monkeypatch):
    monkeypatch.setenv("GRT_SHARD_RETRY_S", "60")
    server = served["server"]  # connections in flight are dropped, then refused for 1.5 s
    digests, longest_wait = _restarted_epoch(served["http"], server.stop, server.start, len(local_digests), 1.5)
    assert digests == local_digests
    assert longest_wait > 0.5, "the loader never waited for the server: the outage was not hit"


def test_http_faults_are_one_line_naming_the_url(served, monkeypatch):
    monkeypatch.setenv("GRT_SHARD_RETRY_S", "1")
    server, tmp, names = served["server"], served["tmp"], served["names"]
    src = Path(served["local"]).parent
    first = Path(Manifest.load(str(served["local"])).shards("train")[0].url)
    data = first.read_bytes()
    (tmp / "www" / "cut" / names[0]).write_bytes(data[: len(data) // 2])
    cases = [
        ("missing", f"{server.url}/shards/nothing-here.tar", MissingShardError, "HTTP 404"),
        ("denied", f"{server.url}/denied/{names[0]}", UnreachableShardError, "HTTP 403"),
        ("busy", f"{server.url}/busy/{names[0]}", UnreachableShardError, "HTTP 503; gave up after"),
        ("cut", f"{server.url}/cut/{names[0]}", ShardError, "truncated|shorter than listed"),
    ]
    for what, url, error, message in cases:
        manifest = _write_manifest(src, tmp / f"fault-{what}", [url], 0, 1)
        loader = TokenBatchLoader(str(manifest), micro_batch_size=4, loop=False)
        t0 = time.monotonic()
        with pytest.raises(error, match=message) as info:
            next(iter(loader))
        elapsed = time.monotonic() - t0
        assert url in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert elapsed < (5 if what == "busy" else 0.9), (what, elapsed)  # retried ~1 s only when worth it


def test_s3_epoch_reads_its_bytes_once_and_the_local_samples(served, moto_s3, tmp_path):
    count = 8  # moto answers a few hundred requests a second: fewer shards than for nginx
    names, src = served["names"][:count], Path(served["local"]).parent
    local = _write_manifest(src, tmp_path / "local", [str(Path(served["src"]) / n) for n in names], 0, count)
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="grt-shards")
    for name in names:
        client.upload_file(str(Path(served["src"]) / name), "grt-shards", f"corpus/{name}")
    manifest = _write_manifest(src, tmp_path / "s3", [f"s3://grt-shards/corpus/{n}" for n in names], 0, count)
    moto_s3.clear_log()
    assert _step_digests(manifest, world=2, workers=2) == _step_digests(local, world=2, workers=2)
    ratio = moto_s3.bytes_served("GET") / _shard_bytes(manifest)
    print(f"s3: {ratio:.3f} x the shards' bytes")
    assert 0.9 < ratio <= 1.1


def test_s3_server_restarted_mid_epoch_loses_or_repeats_nothing(served, monkeypatch, tmp_path):
    """moto keeps its objects in memory: the restarted server is seeded with the same shards
    before it listens. The retries are bounded: no step waits much longer than the outage."""
    count = 8
    names, src = served["names"][:count], Path(served["local"]).parent
    files = [Path(served["src"]) / n for n in names]
    local = _write_manifest(src, tmp_path / "local", [str(f) for f in files], 0, count)
    reference = _step_digests(local, world=2, workers=2)
    s3 = MotoS3(tmp_path, seed=("grt-shards", "corpus", files))
    try:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("GRT_SHARD_RETRY_S", "60")
        manifest = _write_manifest(src, tmp_path / "s3", [f"s3://grt-shards/corpus/{n}" for n in names], 0, count)
        t0 = time.monotonic()
        digests, longest_wait = _restarted_epoch(manifest, s3.stop, s3.start, len(reference), outage_s=1.5)
        ratio = s3.bytes_served("GET") / _shard_bytes(manifest)
        print(f"s3 restart: longest step {longest_wait:.2f} s, epoch {time.monotonic() - t0:.1f} s, {ratio:.3f} x")
        assert digests == reference
        assert longest_wait > 0.5, "the loader never waited for the server: the outage was not hit"
        assert longest_wait < 15, "retried far longer than the outage (backoff is capped at 5 s)"
        assert ratio <= 1.2  # the requests cut by the stop are asked again, nothing else
    finally:
        s3.stop()


def test_mixture_with_a_url_source_resumed_on_another_world_size(served):
    """One local and one http source, 2 ranks x 2 workers for 6 steps, then resumed on 1 rank:
    every step's samples are those of the same mixture read from local files without a break."""

    def mixture(b: str) -> DataMixture:
        text = f"a=0.6:{served['a']},b=0.4:{served[b]}"
        return DataMixture.load(text, parse_sources(text) or [])

    def run(data: DataMixture, world: int, steps: int, state=None) -> tuple[list[int], list[MixtureLoader]]:
        loaders = []
        for r in range(world):
            loader = MixtureLoader(
                data, micro_batch_size=8 // world, rank=r, world_size=world, num_workers=2, global_batch=8,
                shuffle_buffer=64, seed=3,
            )  # fmt: skip
            if state is not None:
                loader.load_state_dict(state)
            loaders.append(loader)
        its = [iter(loader) for loader in loaders]
        out = [sum(sample_digest(next(it)["input_ids"]) for it in its) % DIGEST_MOD for _ in range(steps)]
        return out, loaders

    reference, _ = run(mixture("b_local"), world=1, steps=14)
    first, loaders = run(mixture("b_http"), world=2, steps=6)
    rest, _ = run(mixture("b_http"), world=1, steps=8, state=loaders[0].state_dict())
    assert first + rest == reference


def test_mixture_reads_its_url_source_once_and_the_local_samples(served):
    """One local and one http source, each read once (max_repeats 1), on 2 ranks: nginx serves
    the http source's shards' bytes about once, and every step's samples are those of the same
    mixture read from local files, with two loader workers each (they read ahead to the
    sources' cap)."""

    def epoch(b: str) -> tuple[list[int], dict[str, int]]:
        text = f"a=0.6:{served['a']},b=0.4:{served[b]}"
        data = DataMixture.load(text, parse_sources(text) or [])
        loaders = [
            MixtureLoader(
                data,
                micro_batch_size=4,
                rank=r,
                world_size=2,
                num_workers=2,
                global_batch=8,
                shuffle_buffer=64,
                seed=3,
                max_repeats=1.0,
            )  # fmt: skip
            for r in range(2)
        ]
        steps = sum(data.source_sequences("train").values()) // 8  # the global batches the sources fill
        its = [iter(loader) for loader in loaders]
        out = [sum(sample_digest(next(it)["input_ids"]) for it in its) % DIGEST_MOD for _ in range(steps)]
        return out, dict(zip(data.names, loaders[0].cursors.tolist(), strict=True))

    server = served["server"]
    reference, _ = epoch("b_local")
    server.clear_log()
    digests, drawn = epoch("b_http")
    assert digests == reference
    sequences = sum(s.sequences for s in Manifest.load(str(served["b_http"])).shards("train"))
    assert drawn["b"] == sequences  # its epoch is complete: every sample of it was drawn once
    ratio = server.bytes_served("/shards/") / _shard_bytes(served["b_http"])
    print(f"mixture: {len(digests)} steps, b's {sequences} samples, {ratio:.3f} x its shards' bytes")
    assert 0.9 < ratio <= 1.1
    _assert_each_byte_once(server.ranges("/shards/"), served["b_http"])


def _self_signed(work: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the HTTPS server")
    cert, key = work / "cert.pem", work / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={HOST}",
         "-addext", f"subjectAltName=IP:{HOST}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_https_with_a_trusted_self_signed_certificate(served, local_digests, monkeypatch, tmp_path):
    """nginx over TLS: the certificate is trusted through SSL_CERT_FILE (what urllib3 reads, by
    OpenSSL's default paths; REQUESTS_CA_BUNDLE is requests' own and does not apply), the epoch
    reads the local samples and each byte about once; untrusted, the read stops at once, in one
    line naming the URL."""
    cert, key = _self_signed(tmp_path)
    server = Nginx(served["tmp"] / "www", tmp_path / "nginx", tls=(cert, key))
    try:
        names, src = served["names"], Path(served["local"]).parent
        manifest = _write_manifest(src, tmp_path / "https", [f"{server.url}/shards/{n}" for n in names], 0, SHARDS)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        assert _step_digests(manifest, world=2, workers=2) == local_digests
        ratio = server.bytes_served("/shards/") / _shard_bytes(manifest)
        print(f"https: {ratio:.3f} x the shards' bytes")
        assert 0.9 < ratio <= 1.1
        _assert_each_byte_once(server.ranges("/shards/"), manifest)

        monkeypatch.delenv("SSL_CERT_FILE")  # the system's CAs only: ours is unknown
        monkeypatch.setenv("GRT_SHARD_RETRY_S", "30")
        url = f"{server.url}/shards/{names[0]}"
        loader = TokenBatchLoader(str(_write_manifest(src, tmp_path / "untrusted", [url], 0, 1)), micro_batch_size=4)
        t0 = time.monotonic()
        with pytest.raises(UnreachableShardError, match="TLS certificate is not trusted.*SSL_CERT_FILE") as info:
            next(iter(loader))
        assert url in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert time.monotonic() - t0 < 5, "a certificate that fails verification was retried"
        print(info.value)
    finally:
        server.stop()


def test_a_body_cut_short_is_retried_and_blamed_on_the_transfer_not_the_shard(served, monkeypatch):
    """Before: "bytes A-B requested, N received: shorter than listed", at once, for a shard whose
    every byte is there."""
    src, names = Path(served["src"]), served["names"][:1]
    server = RangeServer(src, cuts=2)
    try:
        manifest = _write_manifest(src, served["tmp"] / "cut-body", [f"{server.url}/{names[0]}"], 0, 1)
        local = _write_manifest(src, served["tmp"] / "cut-body-local", [str(src / names[0])], 0, 1)
        monkeypatch.setenv("GRT_SHARD_RETRY_S", "5")
        assert _step_digests(manifest, 1, 0) == _step_digests(local, 1, 0)  # retried, then whole
        server.cuts = 10**6
        monkeypatch.setenv("GRT_SHARD_RETRY_S", "0.5")
        with pytest.raises(UnreachableShardError, match="cut short.*gave up after") as info:
            next(iter(TokenBatchLoader(str(manifest), micro_batch_size=4, loop=False)))
        assert "shorter than listed" not in str(info.value), str(info.value)
    finally:
        server.stop()
