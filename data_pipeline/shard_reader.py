"""Reading one shard's samples by their index: seeking in a local file of fixed-size members,
ranged requests to a shard behind a URL (data_pipeline/remote.py), else streaming through
webdataset; every member is checked as `iter_shard` checks it."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Generator, Sequence
from typing import IO

import numpy as np

from .remote import RandomAccess, RangedReader, is_ranged
from .shards import DTYPES, MEMBER_NAME, MissingShardError, ShardError, iter_shard, member_size


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith(("pipe:", "file:"))


class ShardReader:
    """One worker's reads: samples of a shard by their index, seeking in a local file with the
    fixed-size member layout, else streaming forward through webdataset (one open stream,
    reused while the indices grow). Every member is checked as `iter_shard` checks it."""

    def __init__(
        self, sequences: Sequence[int], sample_tokens: int, ext: str, vocab_size: int | None, max_open: int = 1
    ) -> None:
        self.sequences, self.sample_tokens, self.ext, self.vocab_size = sequences, sample_tokens, ext, vocab_size
        self.nbytes = sample_tokens * DTYPES[ext].itemsize
        self.stride = member_size(sample_tokens, ext)
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
            fetched = self.ranged.fetch(url, self.sequences[shard] * self.stride + 1024, self.stride, indices)
            return [self._member(fetched, url, i) for i in indices]
        fh = self._local(shard, url)
        if fh is None:
            return self._streamed(shard, url, indices)
        return [self._member(fh, url, i) for i in indices]

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
                raise ShardError(url, f"truncated: {size} bytes, the {self.sequences[shard]} samples need {need}")
        try:
            fh = open(url, "rb")  # noqa: SIM115 (kept open while the worker reads this shard, closed by _close_file)
        except OSError as exc:  # gone since it was first opened, or unreadable
            raise MissingShardError(url, f"{type(exc).__name__}: {exc}") from None
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
        return data

    def _streamed(self, shard: int, url: str, indices: list[int]) -> list[bytes]:
        if self.stream is None or self.stream[0] != shard or self.stream[2] > indices[0]:
            self._close_stream()
            samples = iter_shard(
                url, self.sequences[shard], self.sample_tokens, self.ext, start=indices[0], vocab_size=self.vocab_size
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
