"""Ranged reads of shards behind a URL: HTTP(S) ``Range`` requests, ``s3://`` and ``gs://``
through fsspec (s3fs / gcsfs, which read their credentials from the environment).

A shard written by ``grt data prepare`` puts member i at byte ``i * member_size``, so a loader
worker fetches exactly the members it needs: one request per run of neighbouring members, over
a bounded number of connections. A dropped connection, a timeout or a 5xx is retried with
backoff for a bounded time; a 404 is a missing shard, and a 401/403 or a TLS certificate that
fails verification (trusted through ``SSL_CERT_FILE``, which urllib3 reads) stops at once. Settings
(environment, so that they reach every loader worker process):

* ``GRT_SHARD_CONNECTIONS`` (default 4): concurrent requests per loader worker;
* ``GRT_SHARD_TIMEOUT_S`` (default 30): connect / read timeout of one request;
* ``GRT_SHARD_RETRY_S`` (default 300): how long one request is retried before the run stops.
"""

from __future__ import annotations

import bisect
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from grt_common.errors import one_line

from .shards import MissingShardError, ShardError, UnreachableShardError

RANGED_SCHEMES = ("http://", "https://", "s3://", "gs://")
_MAX_REQUEST = 8 << 20  # a longer run of members is cut into requests of this size, spread over the connections
_FSSPEC_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}


def is_ranged(url: str) -> bool:
    """A shard read by ranged requests (``pipe:`` and ``file:`` URLs stream, local paths seek)."""
    return url.startswith(RANGED_SCHEMES)


def _env_number(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value >= minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum:g}")
    return value


def ranged_settings() -> tuple[float, float, float]:
    """The environment's settings of ranged reads (connections, timeout, retry time): ValueError, one
    line naming the variable, for a value that is not one. Checked at the door (the start plan, the
    loader's construction), not first inside a loader worker."""
    return (
        _env_number("GRT_SHARD_CONNECTIONS", 4, 1),
        _env_number("GRT_SHARD_TIMEOUT_S", 30.0, 0.01),
        _env_number("GRT_SHARD_RETRY_S", 300.0, 0.0),
    )


_CONTENT_RANGE = re.compile(r"bytes (?P<first>\d+)-(?P<last>\d+)/(?P<total>\d+|\*)")


class _Retry(Exception):
    """A failure worth another attempt (connection dropped or refused, timeout, 5xx, short body)."""


class RandomAccess(Protocol):
    """What member reads need of a shard: a local file, or the ranges fetched from a URL."""

    def seek(self, pos: int, whence: int = 0, /) -> int: ...

    def read(self, n: int = -1, /) -> bytes: ...


class FetchedRanges:
    """The byte ranges of one shard fetched for one read, read like the file (seek, read)."""

    def __init__(self, starts: list[int], chunks: list[bytes]) -> None:
        self.starts, self.chunks, self.pos = starts, chunks, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos
        return pos

    def read(self, n: int = -1) -> bytes:
        i = bisect.bisect_right(self.starts, self.pos) - 1
        if i < 0:
            return b""
        off = self.pos - self.starts[i]
        out = self.chunks[i][off : off + n if n >= 0 else None]
        self.pos += len(out)
        return out


class RangedReader:
    """One loader worker's ranged reads (made lazily: its connections and threads appear on first use)."""

    def __init__(self) -> None:
        connections, self.timeout, self.retry_s = ranged_settings()
        self.connections = int(connections)
        self.pool: ThreadPoolExecutor | None = None
        self.http: Any = None  # urllib3.PoolManager
        self.filesystems: dict[str, Any] = {}  # fsspec protocol -> filesystem
        self.sizes: dict[str, int] = {}  # url -> total bytes, checked against the manifest once

    def fetch(self, url: str, need: int, stride: int, indices: Sequence[int]) -> FetchedRanges:
        """Members `indices` (increasing) of the shard at `url`, each `stride` bytes at `index * stride`;
        `need` is the least size the manifest's sample count allows. ShardError (or a subclass)."""
        runs: list[tuple[int, int]] = []
        for i in indices:
            if runs and runs[-1][1] == i * stride and runs[-1][1] - runs[-1][0] < _MAX_REQUEST:
                runs[-1] = (runs[-1][0], (i + 1) * stride)
            elif not runs or runs[-1][1] <= i * stride:
                runs.append((i * stride, (i + 1) * stride))
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.connections, thread_name_prefix="grt-shard")
        chunks = list(self.pool.map(lambda run: self._get(url, run[0], run[1]), runs))
        size = self.sizes.get(url)
        if size is not None and size < need:
            raise ShardError(url, f"truncated: {size} bytes, the manifest's samples need {need}")
        return FetchedRanges([a for a, _ in runs], chunks)

    def _get(self, url: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `url`, retried with backoff for `retry_s` seconds."""
        get = self._http_get if url.startswith(("http://", "https://")) else self._fsspec_get
        deadline, delay, attempts = time.monotonic() + self.retry_s, 0.1, 0
        while True:
            attempts += 1
            try:
                data = get(url, start, end)
            except _Retry as exc:
                if time.monotonic() + delay > deadline:
                    raise UnreachableShardError(
                        url, f"{exc}; gave up after {attempts} attempts in {self.retry_s:g}s (GRT_SHARD_RETRY_S)"
                    ) from None
                time.sleep(delay * random.uniform(0.5, 1.0))  # jitter: workers that failed together retry apart
                delay = min(2 * delay, 5.0)
                continue
            if len(data) != end - start:  # past the end of the object: fewer bytes than the manifest says
                raise ShardError(url, f"bytes {start}-{end - 1} requested, {len(data)} received: shorter than listed")
            return data

    def _http_get(self, url: str, start: int, end: int) -> bytes:
        import urllib3

        if self.http is None:
            self.http = urllib3.PoolManager(maxsize=self.connections, block=True, retries=False)
        try:
            resp = self.http.request(
                "GET",
                url,
                headers={"Range": f"bytes={start}-{end - 1}"},
                timeout=urllib3.Timeout(connect=self.timeout, read=self.timeout),
            )
        except urllib3.exceptions.HTTPError as exc:  # refused, reset, timed out, body cut short
            if _is_untrusted_certificate(exc):  # another attempt cannot help
                raise UnreachableShardError(
                    url,
                    f"its TLS certificate is not trusted ({one_line(exc)}): put the CA's certificate in a "
                    "bundle file named by SSL_CERT_FILE",
                ) from None
            raise _Retry(one_line(exc)) from None
        status = resp.status
        if status == 206:
            data = bytes(resp.data)
            sent = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
            if sent is None:
                return data  # no range said: _get checks the length against the request
            first, last, total = int(sent["first"]), int(sent["last"]), sent["total"]
            if total.isdigit():
                self.sizes[url] = int(total)
                if int(total) < end:  # the object itself is shorter: the shard's fault
                    return data
            if len(data) < last - first + 1:  # the body ended before the range it announced: the transfer's
                raise _Retry(f"the body was cut short: {len(data)} of the {last - first + 1} bytes announced")
            return data
        if status == 404:
            raise MissingShardError(url, "HTTP 404 Not Found")
        if status in (401, 403):
            raise UnreachableShardError(url, f"HTTP {status}: access denied (check the URL's credentials)")
        if status == 416:
            raise ShardError(url, f"bytes {start}-{end - 1} are past its end (HTTP 416): shorter than listed")
        if status >= 500 or status == 429:
            raise _Retry(f"HTTP {status}")
        if 300 <= status < 400 and resp.headers.get("Location"):  # not the shard's fault: where it is
            raise UnreachableShardError(
                url,
                f"HTTP {status}: the server redirects it to {resp.headers['Location']}; list that URL in the "
                "manifest (ranged reads do not follow redirects: each would cost a round trip per read)",
            )
        if status == 200:
            raise UnreachableShardError(url, "the server ignored the Range header (HTTP 200): it cannot serve ranges")
        raise UnreachableShardError(url, f"HTTP {status}")

    def _fsspec_get(self, url: str, start: int, end: int) -> bytes:
        protocol, _, path = url.partition("://")
        fs = self._filesystem(protocol)
        try:
            if url not in self.sizes:
                self.sizes[url] = int(fs.size(path))
            return bytes(fs.cat_file(path, start=start, end=end))
        except FileNotFoundError as exc:
            raise MissingShardError(url, one_line(exc)) from None
        except PermissionError as exc:
            raise UnreachableShardError(url, f"access denied ({exc}); check the credentials") from None
        except Exception as exc:  # the clients' connection, timeout and 5xx errors have no common base
            if is_credentials_error(exc):
                raise UnreachableShardError(url, one_line(exc)) from None
            raise _Retry(one_line(exc)) from None

    def _filesystem(self, protocol: str) -> Any:
        if protocol not in self.filesystems:
            try:
                self.filesystems[protocol] = object_filesystem(protocol, self.timeout)
            except ImportError as err:
                raise UnreachableShardError(f"{protocol}://", f"reading {err}") from None
        return self.filesystems[protocol]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if self.http is not None:
            self.http.clear()
            self.http = None
        self.filesystems.clear()


def object_filesystem(protocol: str, timeout: float) -> Any:
    """An fsspec filesystem of `protocol` ("s3", "gs") of the caller's own (no instance cache: its
    timeouts), one attempt per call (the caller retries, bounded in time), its credentials and
    endpoint from the environment only (boto3's chain: AWS_*, AWS_ENDPOINT_URL_S3; gcsfs's). Used by
    the shard reads here and by a run's checkpoint mirror (pretrain/runs/checkpoint_mirror.py).
    ImportError, one line naming the package, where its client is not installed."""
    import fsspec

    try:
        make: Callable[..., Any] = fsspec.get_filesystem_class(protocol)
    except ImportError:
        package = _FSSPEC_PACKAGES.get(protocol, protocol)
        raise ImportError(f"{protocol}:// needs {package} (pip install {package})") from None
    kwargs: dict[str, Any] = {"skip_instance_cache": True}
    if protocol == "s3":
        kwargs["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout, "retries": {"max_attempts": 1}}
    return make(**kwargs)


def is_credentials_error(exc: BaseException) -> bool:
    """No or rejected credentials: another attempt cannot help."""
    name = type(exc).__name__
    return name in ("NoCredentialsError", "PartialCredentialsError") or "InvalidAccessKeyId" in str(exc)


def _is_untrusted_certificate(exc: BaseException) -> bool:
    """A server certificate that fails verification (unknown CA, self-signed, expired, another host)."""
    import ssl

    seen: BaseException | None = exc
    for _ in range(4):  # urllib3 wraps the ssl error: SSLError(SSLCertVerificationError) or inside MaxRetryError
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        nested = [a for a in getattr(seen, "args", ()) if isinstance(a, BaseException)]
        seen = getattr(seen, "reason", None) or (nested[0] if nested else None) or seen.__cause__ or seen.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(exc)
