"""The on-disk shard format: plain WebDataset ``.tar`` files of fixed-length token samples.

One shard = one POSIX tar. Member ``i`` (in order) is ``{stem}_{i:07d}.{ext}`` where
``stem`` is the shard's file name without ``.tar`` (``train-000003``) and ``ext`` names
the dtype: ``u16`` = little-endian uint16, ``u32`` = little-endian uint32. Its payload is
exactly ``seq_len + 1`` tokens, nothing else (no header), so a sample is
``numpy.frombuffer(data, "<u2")``. WebDataset sees key ``{stem}_{i:07d}`` and field
``u16``. Tar metadata is fixed (mtime 0, uid/gid 0, no user/group names, mode 0644) so
the same tokens give the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from collections.abc import Callable, Generator
from typing import IO, Any

import numpy as np

DTYPES: dict[str, np.dtype[np.unsignedinteger[Any]]] = {"u16": np.dtype("<u2"), "u32": np.dtype("<u4")}


class ShardError(RuntimeError):
    """A shard is corrupt, truncated or does not match the manifest."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"corrupt or truncated shard {url!r}: {reason}")
        self.url, self.reason = url, reason


class MissingShardError(ShardError, FileNotFoundError):
    """A shard listed in the manifest cannot be opened."""

    def __init__(self, url: str, reason: str) -> None:
        RuntimeError.__init__(self, f"missing shard {url!r} (listed in the manifest): {reason}")
        self.url, self.reason = url, reason


class ForeignShardError(ShardError):
    """A shard whose size or first member is not what the manifest lists: rewritten since, or made
    with another tokenizer (data_pipeline/shard_reader.py checks it once per shard and reader)."""

    def __init__(self, url: str, reason: str) -> None:
        RuntimeError.__init__(self, f"shard {url!r} is not the one the manifest lists: {reason}")
        self.url, self.reason = url, reason


class UnreachableShardError(ShardError):
    """A shard behind a URL that could not be fetched: access denied, or still failing when the
    retries' time ran out."""

    def __init__(self, url: str, reason: str) -> None:
        RuntimeError.__init__(self, f"cannot read shard {url!r}: {reason}")
        self.url, self.reason = url, reason


def ext_for_vocab(vocab_size: int) -> str:
    return "u16" if vocab_size <= 1 << 16 else "u32"


def member_size(sample_tokens: int, ext: str) -> int:
    """Bytes one sample occupies in the tar (header + payload padded to 512)."""
    payload = sample_tokens * DTYPES[ext].itemsize
    return 512 + (payload + 511) // 512 * 512


def build_shard(stem: str, samples: np.ndarray, ext: str) -> bytes:
    """Tar bytes of a shard holding the rows of ``samples`` ([n, seq_len + 1])."""
    dtype = DTYPES[ext]
    samples = np.ascontiguousarray(samples, dtype=dtype)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(samples.shape[0]):
            data = samples[i].tobytes()
            info = tarfile.TarInfo(f"{stem}_{i:07d}.{ext}")
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_shard_atomic(path: str, data: bytes, before_replace: Callable[[], None] | None = None) -> str:
    """Write ``data`` to ``path`` through ``path + '.tmp'`` and a rename; returns its sha256.

    A partially written shard only ever exists under the ``.tmp`` name, which the loader
    never reads and ``prepare`` deletes after its next complete run. ``before_replace`` runs
    once the temporary is complete, before the rename (``prepare`` sets an old shard aside there).
    """
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        _write_chunks(fh, data)
        fh.flush()
        os.fsync(fh.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def _write_chunks(fh: IO[bytes], data: bytes, chunk: int = 1 << 22) -> None:
    view = memoryview(data)
    for off in range(0, len(view), chunk):
        fh.write(view[off : off + chunk])


MEMBER_NAME = re.compile(r"^(?:.*/)?(?P<stem>[^/]+)_(?P<idx>\d{7})\.(?P<ext>u16|u32)$")


def open_stream(url: str) -> IO[bytes]:
    """Open a shard with webdataset's gopen (local path, file:, pipe:, http(s):, ...)."""
    import webdataset as wds

    if "://" not in url and not url.startswith("pipe:") and not os.path.exists(url):
        raise MissingShardError(url, "no such file")
    try:
        return wds.gopen(url, "rb", bufsize=1 << 20)
    except FileNotFoundError as exc:
        raise MissingShardError(url, str(exc)) from exc
    except OSError as exc:
        raise MissingShardError(url, str(exc)) from exc


def iter_shard(
    url: str, sequences: int, sample_tokens: int, ext: str, start: int = 0, vocab_size: int | None = None
) -> Generator[tuple[int, bytes], None, None]:
    """Yield ``(index, payload)`` for samples ``start .. sequences-1`` of one shard.

    Streams through ``webdataset.tariterators.tar_file_iterator`` and checks every member
    against the manifest (name, order, payload size, token range) and the sample count;
    any mismatch, a truncated tar or an unreadable stream raises :class:`ShardError`
    naming the shard. Samples before ``start`` are read but not returned.
    """
    from webdataset.tariterators import tar_file_iterator

    nbytes = sample_tokens * DTYPES[ext].itemsize
    dtype = DTYPES[ext]
    expected = 0
    stream = open_stream(url)
    try:
        try:
            for item in tar_file_iterator(stream):
                m = MEMBER_NAME.match(item["fname"])
                if m is None or m.group("ext") != ext or int(m.group("idx")) != expected:
                    raise ShardError(
                        url,
                        f"unexpected member {item['fname']!r} at position {expected} "
                        f"(want index {expected:07d}, extension .{ext})",
                    )
                data = item["data"]
                if len(data) != nbytes:
                    raise ShardError(url, f"member {item['fname']!r} has {len(data)} bytes, want {nbytes}")
                if vocab_size is not None and int(np.frombuffer(data, dtype).max()) >= vocab_size:
                    raise ShardError(url, f"member {item['fname']!r} holds a token id >= vocab size {vocab_size}")
                if expected >= start:
                    yield expected, data
                expected += 1
                if expected > sequences:
                    raise ShardError(url, f"holds more than the {sequences} samples the manifest lists")
        except ShardError:
            raise
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise MissingShardError(url, str(exc)) from exc
            raise ShardError(url, f"{type(exc).__name__}: {exc}") from exc
        if expected != sequences:
            raise ShardError(url, f"ends after {expected} samples, the manifest lists {sequences}")
    finally:
        try:
            stream.close()
        except Exception:  # a failed pipe: reports its exit status on close
            pass
