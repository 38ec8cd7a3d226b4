"""The on-disk shard format: plain WebDataset ``.tar`` files of fixed-length token samples.

One shard = one POSIX tar. Member ``i`` (in order) is ``{stem}_{i:07d}.{ext}`` where
``stem`` is the shard's file name without ``.tar`` (``train-000003``) and ``ext`` names
the dtype: ``u16`` = little-endian uint16, ``u32`` = little-endian uint32. Its payload is
exactly ``seq_len + 1`` tokens, nothing else (no header), so a sample is
``numpy.frombuffer(data, "<u2")``. WebDataset sees key ``{stem}_{i:07d}`` and field
``u16``. Tar metadata is fixed (mtime 0, uid/gid 0, no user/group names, mode 0644) so
the same tokens give the same bytes.

A data set whose manifest declares ``"loss_mask": "bits"`` (`grt data chains --loss-on answers`)
has a second member after each sample's tokens: ``{stem}_{i:07d}.mask``, the sample's
``seq_len + 1`` positions as packed bits (``numpy.packbits``, little bit order), bit j set where
token j is a training target (bit 0, the first token, is never one). The loader turns the other
targets into the loss's ignore index (data_pipeline/epoch_plan.py `collate`). A data set without
the field has no mask members and reads as before.
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
MASK_EXT = "mask"  # a sample's loss mask member (a manifest with "loss_mask": "bits")


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


def mask_bytes(sample_tokens: int) -> int:
    """Bytes of one sample's packed loss mask."""
    return (sample_tokens + 7) // 8


def sample_stride(sample_tokens: int, ext: str, masked: bool = False) -> int:
    """Bytes one sample occupies in the tar: its token member, and its mask member where the data
    has loss masks. Sample i starts at byte ``i * sample_stride``."""
    return member_size(sample_tokens, ext) + (512 + (mask_bytes(sample_tokens) + 511) // 512 * 512 if masked else 0)


def pack_mask(mask: np.ndarray) -> bytes:
    """One sample's mask (bool [seq_len + 1]) as its member's payload."""
    return np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()


def unpack_masks(packed: np.ndarray, sample_tokens: int) -> np.ndarray:
    """Masks (bool [n, sample_tokens]) from packed rows (uint8 [n, mask_bytes])."""
    return np.unpackbits(packed, axis=1, count=sample_tokens, bitorder="little").astype(bool)


def build_shard(stem: str, samples: np.ndarray, ext: str, masks: np.ndarray | None = None) -> bytes:
    """Tar bytes of a shard holding the rows of ``samples`` ([n, seq_len + 1]), each followed by
    its loss mask's member where ``masks`` (bool, the same shape) is given."""
    dtype = DTYPES[ext]
    samples = np.ascontiguousarray(samples, dtype=dtype)
    if masks is not None and masks.shape != samples.shape:
        raise ValueError(f"masks of shape {masks.shape} for samples of shape {samples.shape}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(samples.shape[0]):
            _add_member(tf, f"{stem}_{i:07d}.{ext}", samples[i].tobytes())
            if masks is not None:
                _add_member(tf, f"{stem}_{i:07d}.{MASK_EXT}", pack_mask(masks[i]))
    return buf.getvalue()


def _add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tf.addfile(info, io.BytesIO(data))


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


MEMBER_NAME = re.compile(r"^(?:.*/)?(?P<stem>[^/]+)_(?P<idx>\d{7})\.(?P<ext>u16|u32|mask)$")


def unexpected_member(found: str, index: int, ext: str) -> str:
    """Why a shard is refused where member ``{index:07d}.{ext}`` was due and ``found`` came."""
    what = "its loss mask (the manifest declares loss masks)" if ext == MASK_EXT else "its tokens"
    return f"unexpected member {found!r} at position {index}: want sample {index:07d}'s .{ext} member, {what}"


def check_mask_size(url: str, name: str, size: int, sample_tokens: int) -> None:
    if size != mask_bytes(sample_tokens):
        raise ShardError(url, f"loss mask member {name!r} has {size} bytes, want {mask_bytes(sample_tokens)}")


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
    url: str,
    sequences: int,
    sample_tokens: int,
    ext: str,
    start: int = 0,
    vocab_size: int | None = None,
    masked: bool = False,
) -> Generator[tuple[int, bytes], None, None]:
    """Yield ``(index, payload)`` for samples ``start .. sequences-1`` of one shard.

    Streams through ``webdataset.tariterators.tar_file_iterator`` and checks every member
    against the manifest (name, order, payload size, token range) and the sample count;
    any mismatch, a truncated tar or an unreadable stream raises :class:`ShardError`
    naming the shard. Samples before ``start`` are read but not returned. ``masked``: each
    sample's mask member follows its tokens, and the payload is the tokens' bytes, then the mask's.
    """
    from webdataset.tariterators import tar_file_iterator

    nbytes = sample_tokens * DTYPES[ext].itemsize
    dtype = DTYPES[ext]
    expected = 0
    tokens: bytes | None = None  # a masked sample's tokens, waiting for its mask member
    stream = open_stream(url)
    try:
        try:
            for item in tar_file_iterator(stream):
                m = MEMBER_NAME.match(item["fname"])
                want = MASK_EXT if tokens is not None else ext
                if m is None or m.group("ext") != want or int(m.group("idx")) != expected:
                    raise ShardError(url, unexpected_member(item["fname"], expected, want))
                data = item["data"]
                if tokens is not None:  # the mask of sample `expected`
                    check_mask_size(url, item["fname"], len(data), sample_tokens)
                    data, tokens = tokens + data, None
                else:
                    if len(data) != nbytes:
                        raise ShardError(url, f"member {item['fname']!r} has {len(data)} bytes, want {nbytes}")
                    if vocab_size is not None and int(np.frombuffer(data, dtype).max()) >= vocab_size:
                        raise ShardError(url, f"member {item['fname']!r} holds a token id >= vocab size {vocab_size}")
                    if masked:
                        tokens = data
                        continue
                if expected >= start:
                    yield expected, data
                expected += 1
                if expected > sequences:
                    raise ShardError(url, f"holds more than the {sequences} samples the manifest lists")
            if tokens is not None:
                raise ShardError(url, unexpected_member("the end of the tar", expected, MASK_EXT))
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
