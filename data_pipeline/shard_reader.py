"""Reading one shard's samples by their index: seeking in a local file of fixed-size members,
ranged requests to a shard behind a URL (data_pipeline/remote.py), else streaming through
webdataset; every member is checked as `iter_shard` checks it.

A shard is checked against the manifest's identity of it (`Identity`: its size and the sha256 of
its first member) once per shard and reader (a loader worker): a local file when first opened (a
stat and one member read), a shard behind a URL by the size its server reports and its first
member's hash (fetched with the reader's first request of the shard: one member more, when that
request does not hold it already). A manifest of before `head_sha256` has its sizes
checked only. `check_shard` does the same for one shard on its own (`grt train --dry-run`)."""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Generator, Sequence
from typing import IO, TYPE_CHECKING

import numpy as np

from .remote import RandomAccess, RangedReader, is_ranged
from .shards import (
    DTYPES,
    MASK_EXT,
    MEMBER_NAME,
    ForeignShardError,
    MissingShardError,
    ShardError,
    check_mask_size,
    iter_shard,
    member_size,
    sample_stride,
    unexpected_member,
)

if TYPE_CHECKING:
    from .manifest import Manifest, ShardEntry

Identity = tuple[int, str]  # a shard's bytes and head_sha256 in the manifest (0, "": not recorded)


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith(("pipe:", "file:"))


class ShardReader:
    """One worker's reads: samples of a shard by their index, seeking in a local file with the
    fixed-size member layout, else streaming forward through webdataset (one open stream,
    reused while the indices grow). Every member is checked as `iter_shard` checks it. `masked`: the
    data has loss masks (a mask member after each sample's tokens), and a sample's payload is its
    tokens' bytes, then its mask's."""

    def __init__(
        self,
        sequences: Sequence[int],
        sample_tokens: int,
        ext: str,
        vocab_size: int | None,
        max_open: int = 1,
        identities: Sequence[Identity] = (),
        masked: bool = False,
    ) -> None:
        self.masked = masked
        self.identities = identities  # per shard, as `sequences` (empty: none checked)
        self.checked: set[int] = set()  # shards whose identity this reader has checked
        self.sequences, self.sample_tokens, self.ext, self.vocab_size = sequences, sample_tokens, ext, vocab_size
        self.nbytes = sample_tokens * DTYPES[ext].itemsize
        self.stride = sample_stride(sample_tokens, ext, masked)  # a sample's members
        self.seekable: dict[int, bool] = {}  # shard -> read by seeking (a local file of fixed-size members)
        # the local shards open now, least recently used first: a worker moves through the stream in
        # order, so it needs one at a time (a mixture's reader jumps between a few); never all of an
        # epoch's, which may be thousands
        self.files: dict[int, IO[bytes]] = {}
        self.max_open = max_open
        self.stream: tuple[int, Generator[tuple[int, bytes], None, None], int] | None = None  # shard, samples, next
        self.ranged = RangedReader()  # http(s)://, s3://, gs:// shards

    def read(self, shard: int, url: str, indices: list[int]) -> list[bytes]:
        """The payloads of samples `indices` (increasing) of shard number `shard`; ShardError."""
        if is_ranged(url):  # behind a URL: only these members, by ranged requests
            check = bool(self.identities) and shard not in self.checked
            # the first member too, once per shard and reader, for its hash
            wanted = [0, *indices] if check and self.identities[shard][1] and indices[0] != 0 else indices
            fetched = self.ranged.fetch(url, self.sequences[shard] * self.stride + 1024, self.stride, wanted)
            if check:
                self._check_fetched(shard, url, fetched)
            return [self._member(fetched, url, i) for i in indices]
        fh = self._local(shard, url)
        if fh is None:
            return self._streamed(shard, url, indices)
        return [self._member(fh, url, i) for i in indices]

    def _check_fetched(self, shard: int, url: str, fetched: RandomAccess) -> None:
        """A shard behind a URL: its size as its server reports it and its first member's hash (the
        fetch holds member 0 when the manifest has the hash)."""
        size, head = self.identities[shard]
        first = None
        if head:
            fetched.seek(0)
            first = fetched.read(self.stride)
        check_identity(url, self.ranged.sizes.get(url), first, size, head)
        self.checked.add(shard)

    def _local(self, shard: int, url: str) -> IO[bytes] | None:
        """The open file of shard `shard` when it is read by seeking, None when it is streamed;
        its size and first member are checked when it is first opened."""
        if shard in self.files:
            self.files[shard] = self.files.pop(shard)  # now the most recently used
            return self.files[shard]
        if not self.seekable.get(shard, _is_local(url)):
            return None
        while len(self.files) >= self.max_open:
            self.files.pop(next(iter(self.files))).close()
        first_open = shard not in self.seekable
        if first_open:
            if not os.path.exists(url):
                raise MissingShardError(url, "no such file")
            need = self.sequences[shard] * self.stride + 1024  # the members, then tar's two end blocks
            size = os.path.getsize(url)
            if size < need:
                what = f"the {self.sequences[shard]} samples need {need}"
                if self.masked:  # a shard written without masks under a manifest that declares them, say
                    what = f"the {self.sequences[shard]} samples with the loss masks the manifest declares need {need}"
                raise ShardError(url, f"truncated: {size} bytes, {what}")
        try:
            fh = open(url, "rb")  # noqa: SIM115 (kept open while the worker reads this shard, closed by _close_file)
        except OSError as exc:  # gone since it was first opened, or unreadable
            raise MissingShardError(url, f"{type(exc).__name__}: {exc}") from None
        if first_open and self.identities and shard not in self.checked:
            size, head = self.identities[shard]
            check_identity(url, os.path.getsize(url), fh.read(self.stride) if head else None, size, head)
            fh.seek(0)
            self.checked.add(shard)
        if first_open:
            self.seekable[shard] = self._fixed_layout(fh)
            if not self.seekable[shard]:  # written by another tar writer (e.g. extended headers): streamed instead
                fh.close()
                return None
        self.files[shard] = fh
        return fh

    def _fixed_layout(self, fh: IO[bytes]) -> bool:
        try:
            info = tarfile.TarInfo.frombuf(fh.read(512), "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return False
        m = MEMBER_NAME.match(info.name)
        return info.size == self.nbytes and m is not None and int(m.group("idx")) == 0 and info.type == tarfile.REGTYPE

    def _member(self, fh: RandomAccess, url: str, index: int) -> bytes:
        fh.seek(index * self.stride)
        header = fh.read(512)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise ShardError(url, f"member {index} has a bad tar header ({type(exc).__name__}: {exc})") from None
        m = MEMBER_NAME.match(info.name)
        if m is None or m.group("ext") != self.ext or int(m.group("idx")) != index:
            raise ShardError(url, f"unexpected member {info.name!r} at position {index} (want index {index:07d})")
        if info.size != self.nbytes:
            raise ShardError(url, f"member {info.name!r} has {info.size} bytes, want {self.nbytes}")
        data = fh.read(self.nbytes)
        if len(data) != self.nbytes:
            raise ShardError(url, f"member {info.name!r} is cut off after {len(data)} of {self.nbytes} bytes")
        dtype = DTYPES[self.ext]
        if self.vocab_size is not None and int(np.frombuffer(data, dtype).max()) >= self.vocab_size:
            raise ShardError(url, f"member {info.name!r} holds a token id >= vocab size {self.vocab_size}")
        return data + self._mask(fh, url, index) if self.masked else data

    def _mask(self, fh: RandomAccess, url: str, index: int) -> bytes:
        """Sample `index`'s loss mask: the member after its tokens."""
        fh.seek(index * self.stride + member_size(self.sample_tokens, self.ext))
        header = fh.read(512)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            found = f"a bad tar header ({type(exc).__name__}: {exc})"
            raise ShardError(url, unexpected_member(found, index, MASK_EXT)) from None
        m = MEMBER_NAME.match(info.name)
        if m is None or m.group("ext") != MASK_EXT or int(m.group("idx")) != index:
            raise ShardError(url, unexpected_member(info.name, index, MASK_EXT))
        check_mask_size(url, info.name, info.size, self.sample_tokens)
        data = fh.read(info.size)
        if len(data) != info.size:
            raise ShardError(url, f"loss mask member {info.name!r} is cut off after {len(data)} bytes")
        return data

    def _streamed(self, shard: int, url: str, indices: list[int]) -> list[bytes]:
        if self.stream is None or self.stream[0] != shard or self.stream[2] > indices[0]:
            self._close_stream()
            samples = iter_shard(
                url,
                self.sequences[shard],
                self.sample_tokens,
                self.ext,
                start=indices[0],
                vocab_size=self.vocab_size,
                masked=self.masked,
            )
            self.stream = (shard, samples, indices[0])
        _, samples, _ = self.stream
        wanted, out = set(indices), []
        try:
            for i, data in samples:
                if i in wanted:
                    out.append(data)
                if i >= indices[-1]:
                    self.stream = (shard, samples, i + 1)
                    return out
        except ShardError:
            self._close_stream()
            raise
        self._close_stream()
        raise ShardError(url, f"ended before sample {indices[-1]}")

    def _close_stream(self) -> None:
        if self.stream is not None:
            self.stream[1].close()
            self.stream = None

    def _close_file(self) -> None:
        for fh in self.files.values():
            fh.close()
        self.files.clear()

    def close(self) -> None:
        self._close_stream()
        self._close_file()
        self.ranged.close()


def check_identity(url: str, size: int | None, first: bytes | None, listed_size: int, listed_head: str) -> None:
    """ForeignShardError when the shard's `size` or the sha256 of its `first` member (None: not
    read) is not what the manifest lists (0 and "": not listed)."""
    if listed_size and size is not None and size != listed_size:
        raise ForeignShardError(
            url, f"{size} bytes, the manifest lists {listed_size} (rewritten since, or another prepare's)"
        )
    if listed_head and first is not None:
        got = hashlib.sha256(first).hexdigest()
        if got != listed_head:
            raise ForeignShardError(
                url,
                f"its first sample has sha256 {got[:16]}..., the manifest lists {listed_head[:16]}... (rewritten "
                "since, or made with another tokenizer): prepare the data again, or use the manifest written with it",
            )


def check_shard(
    url: str, sequences: int, sample_tokens: int, ext: str, identity: Identity, masked: bool = False
) -> None:
    """One shard exists (a local file) or answers (a URL: one ranged request of its first member),
    and is the one the manifest lists (`check_identity`); a `pipe:` or `file:` shard is taken as it is."""
    stride = sample_stride(sample_tokens, ext, masked)
    size, head = identity
    if is_ranged(url):
        ranged = RangedReader()
        try:
            first = ranged.fetch(url, sequences * stride + 1024, stride, [0])
            first.seek(0)
            check_identity(url, ranged.sizes.get(url), first.read(stride), size, head)
        finally:
            ranged.close()
    elif _is_local(url):
        if not os.path.isfile(url):
            raise MissingShardError(url, "no such file")
        with open(url, "rb") as fh:
            check_identity(url, os.path.getsize(url), fh.read(stride), size, head)


def check_manifest_shards(manifest: Manifest, splits: Sequence[str], threads: int = 16) -> int:
    """Every shard of `splits` in `manifest` exists or answers and is the one listed (`check_shard`,
    a few at a time: URLs answer in parallel). Returns how many were checked; ShardError for the first
    bad one, in manifest order."""
    from concurrent.futures import ThreadPoolExecutor

    entries = [e for split in splits if split in manifest.splits for e in manifest.splits[split]]

    def check(e: ShardEntry) -> ShardError | None:
        try:
            check_shard(
                e.url, e.sequences, manifest.sample_tokens, manifest.ext, (e.bytes, e.head_sha256), manifest.masked
            )
        except ShardError as err:
            return err
        return None

    with ThreadPoolExecutor(max(1, min(threads, len(entries)))) as pool:
        for problem in pool.map(check, entries):
            if problem is not None:
                raise problem
    return len(entries)
