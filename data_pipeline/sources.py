"""Reading raw documents from text dumps.

Inputs are files, directories (searched recursively) or glob patterns. Supported formats,
chosen by file name:

* ``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst`` (also ``.json.gz``/``.ndjson`` variants):
  one JSON object per line, the document is the string in ``text_field``.
* ``*.txt`` (also ``.txt.gz``/``.txt.zst``): by default the whole file is one document
  (``txt_mode="file"``); ``txt_mode="paragraph"`` splits on blank lines and
  ``txt_mode="line"`` makes every non-empty line a document.
* ``*.parquet`` (FineWeb and its kind): the document is the string column ``text_field``,
  read one row group at a time (only that column), so a file never has to fit in memory.
  Needs pyarrow (``pip install grt-pretrain[parquet]``).

Documents are produced in a deterministic order (inputs sorted by path, lines in file
order) so that everything downstream is reproducible. Bad documents never stop a run:
empty ones, ones that are not valid UTF-8, malformed JSON lines and lines without the
text field are skipped and counted in :class:`SourceStats`.

Every text format may start with a UTF-8 byte-order mark (it is not part of the text).
A compressed file whose data ends early or is damaged part-way is read up to its last
complete line and counted in ``truncated_files``; a file that cannot be read at all (not
in its format, no permission) is refused with a ``ValueError`` naming it.
"""

from __future__ import annotations

import glob
import gzip
import io
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
TXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = ".txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet"
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
TXT_MODES = ("file", "paragraph", "line")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark, which some editors write first
_READ_BYTES = 1 << 16  # compressed bytes fed to the zstd decoder at a time


@dataclass
class SourceStats:
    documents: int = 0
    chars: int = 0
    bytes: int = 0  # UTF-8 bytes of the accepted documents
    skipped_empty: int = 0
    skipped_non_utf8: int = 0
    skipped_bad_json: int = 0
    skipped_missing_field: int = 0
    truncated_files: int = 0  # compressed files that end early or are damaged: read up to the damage

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: SourceStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def _strip_compression(name: str) -> str:
    for s in COMPRESSION_SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def file_kind(path: str) -> str | None:
    """'jsonl', 'txt', 'parquet' or None (unsupported) for a file name."""
    name = os.path.basename(path).lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"  # compressed inside, by column chunk
    base = _strip_compression(name)
    if base.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if base.endswith(TXT_SUFFIXES):
        return "txt"
    return None


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files named by ``inputs`` (files, directories, globs), sorted and de-duplicated.

    Raises FileNotFoundError when an input matches nothing, ValueError for an explicitly
    named file of an unsupported type.
    """
    found: set[str] = set()
    for spec in inputs:
        spec = os.path.expanduser(spec)
        if os.path.isdir(spec):
            matches = [
                os.path.join(root, f) for root, _, files in os.walk(spec) for f in files if file_kind(f) is not None
            ]
            if not matches:
                raise FileNotFoundError(f"input directory {spec!r} holds no {SUPPORTED} files")
        elif os.path.isfile(spec):
            if file_kind(spec) is None:
                raise ValueError(f"input {spec!r}: unsupported file type (want {SUPPORTED})")
            matches = [spec]
        else:
            matches = [m for m in glob.glob(spec, recursive=True) if os.path.isfile(m) and file_kind(m) is not None]
            if not matches:
                raise FileNotFoundError(f"input {spec!r} matches no {SUPPORTED} file")
        found.update(os.path.normpath(m) for m in matches)
    return sorted(found)


def _unreadable(path: str, err: BaseException) -> ValueError:
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err) or type(err).__name__
    return ValueError(f"input {path!r} cannot be read: {reason}")


class _ZstdFrames:
    """The decompressed bytes of consecutive zstd frames, by ``read(n)``.

    Raises ``EOFError`` where the file ends inside a frame: zstandard's stream reader ends
    quietly there, so a truncated file used to look like a complete (often empty) one.
    """

    def __init__(self, fh: IO[bytes]) -> None:
        import zstandard

        self._fh = fh
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False  # bytes of the current frame were fed, its end not seen yet
        self._out = b""

    def read(self, n: int) -> bytes:
        while not self._out:
            data = self._fh.read(_READ_BYTES)
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd data ends inside a frame")
                return b""
            self._feed(data)
        out, self._out = self._out[:n], self._out[n:]
        return out

    def _feed(self, data: bytes) -> None:
        while data:
            self._in_frame = True
            self._out += self._frame.decompress(data)
            if not self._frame.eof:
                return
            data = self._frame.unused_data  # the next frame starts here
            self._frame = self._decompressor.decompressobj()
            self._in_frame = False

    def close(self) -> None:
        self._fh.close()


class _CheckedStream(io.RawIOBase):
    """Decompressed bytes that end, instead of raising, where the compressed data ends early
    or is damaged after the first bytes: ``damage`` then says why. Damage before the first
    byte means the file is not in its format: refused with one line naming it."""

    def __init__(self, path: str, read: Callable[[int], bytes], close: Callable[[], None]) -> None:
        super().__init__()
        self.path = path
        self._read, self._close = read, close
        self.produced = 0
        self.damage: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        if self.damage is not None:
            return 0
        view = memoryview(buffer).cast("B")
        try:
            data = self._read(len(view))
        except EOFError as err:  # the compressed data stops early (a cut-off download or copy)
            self.damage = str(err) or "the compressed data ends early"
            return 0
        except Exception as err:  # noqa: BLE001 - gzip, zlib and zstd report bad data with several types
            if self.produced == 0:
                raise _unreadable(self.path, err) from None
            self.damage = str(err) or type(err).__name__
            return 0
        view[: len(data)] = data
        self.produced += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._close()
        super().close()


def open_binary(path: str) -> io.BufferedIOBase:
    """A binary stream of the (decompressed) file; `stream_damage` tells whether its
    compressed data ended early or was damaged. A file that cannot be opened, or is not in
    the format its name says, raises ``ValueError`` naming it."""
    lower = path.lower()
    try:
        if lower.endswith(".gz"):
            gz = gzip.open(path, "rb")
            # read1: one decompression step a call, so the bytes decoded before the damage are kept
            return io.BufferedReader(_CheckedStream(path, gz.read1, gz.close), buffer_size=1 << 20)
        if lower.endswith((".zst", ".zstd")):
            frames = _ZstdFrames(open(path, "rb"))
            return io.BufferedReader(_CheckedStream(path, frames.read, frames.close), buffer_size=1 << 20)
        return open(path, "rb")
    except OSError as err:
        raise _unreadable(path, err) from None


def stream_damage(fh: io.BufferedIOBase | IO[bytes]) -> str | None:
    """Why the compressed data of a stream from `open_binary` stopped early, or None."""
    raw = getattr(fh, "raw", None)
    return raw.damage if isinstance(raw, _CheckedStream) else None


def _lines(fh: io.BufferedIOBase) -> Iterator[bytes]:
    """The lines of a stream, without a byte-order mark at the start (no Python frame per line)."""
    first = fh.readline().removeprefix(_BOM)
    return itertools.chain([first] if first else [], fh)


def _cut_off(raw: bytes, fh: io.BufferedIOBase) -> bool:
    """The partial last line of a stream whose compressed data was cut off (dropped, not counted)."""
    return not raw.endswith(b"\n") and stream_damage(fh) is not None


def _read_all(fh: io.BufferedIOBase) -> bytes:
    """The whole stream, without a byte-order mark, up to its last complete line where the
    compressed data was cut off."""
    data = fh.read().removeprefix(_BOM)
    if stream_damage(fh) is not None:
        data = data[: data.rfind(b"\n") + 1]
    return data


def check_readable(path: str, text_field: str = "text") -> None:
    """Refuse (``ValueError``, naming the file) an input that cannot be read at all: no
    permission, not in the format its name says, a Parquet file without ``text_field``."""
    if file_kind(path) == "parquet":
        _parquet_file(path, text_field)
        return
    with open_binary(path) as fh:
        fh.read(1)


def _decode_accept(raw: bytes, stats: SourceStats, strip: str | None = None) -> str | None:
    """UTF-8 decode (a non-UTF-8 document is skipped and counted), then `_accept`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.skipped_non_utf8 += 1
        return None
    return _accept(text.strip(strip) if strip is not None else text, stats)


def _accept(text: object, stats: SourceStats) -> str | None:
    """Return the document text if it is usable, else None (and count why)."""
    if not isinstance(text, str):
        stats.skipped_missing_field += 1
        return None
    if not text.strip():
        stats.skipped_empty += 1
        return None
    try:
        nbytes = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates from \ud800-style JSON escapes
        stats.skipped_non_utf8 += 1
        return None
    stats.documents += 1
    stats.chars += len(text)
    stats.bytes += nbytes
    return text


def _parquet_file(path: str, text_field: str) -> Any:
    """The opened Parquet file, refused with one line when it cannot be read or lacks the column."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"input {path!r} is Parquet, which needs pyarrow: pip install 'grt-pretrain[parquet]'"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ValueError(f"input {path!r} is not a readable Parquet file: {err}") from None
    if text_field not in pf.schema_arrow.names:
        raise ValueError(
            f"input {path!r} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
            f"choose one with --text-field"
        )
    return pf


def _iter_parquet(path: str, text_field: str, stats: SourceStats) -> Iterator[str]:
    """The ``text_field`` strings of a Parquet file, one row group in memory at a time."""
    pf = _parquet_file(path, text_field)
    for group in range(pf.num_row_groups):
        column = pf.read_row_group(group, columns=[text_field]).column(0)
        for text in column.to_pylist():
            text = _accept(text, stats)
            if text is not None:
                yield text


def iter_file_documents(
    path: str, text_field: str = "text", txt_mode: str = "file", stats: SourceStats | None = None
) -> Iterator[str]:
    """Yield the usable documents of one file, counting skipped ones in ``stats``."""
    if stats is None:
        stats = SourceStats()
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {txt_mode!r}")
    kind = file_kind(path)
    if kind == "jsonl":
        with open_binary(path) as fh:
            for raw in _lines(fh):
                if not raw.strip():
                    continue  # blank line between records, not a document
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats.skipped_non_utf8 += 0 if _cut_off(raw, fh) else 1
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:  # a record cut off by damage is no valid JSON either: counted once, as damage
                    stats.skipped_bad_json += 0 if _cut_off(raw, fh) else 1
                    continue
                text = obj.get(text_field) if isinstance(obj, dict) else None
                text = _accept(text, stats)
                if text is not None:
                    yield text
            damaged = stream_damage(fh) is not None
    elif kind == "txt":
        with open_binary(path) as fh:
            if txt_mode == "line":
                for raw in _lines(fh):
                    if _cut_off(raw, fh):
                        continue
                    try:
                        line = raw.decode("utf-8").rstrip("\r\n")
                    except UnicodeDecodeError:
                        stats.skipped_non_utf8 += 1
                        continue
                    if not line.strip():
                        continue  # blank separator line, not a document
                    text = _accept(line, stats)
                    if text is not None:
                        yield text
                data = b""
            else:
                data = _read_all(fh)
            damaged = stream_damage(fh) is not None
        if txt_mode == "file":
            if data or not damaged:
                text = _decode_accept(data, stats)
                if text is not None:
                    yield text
        elif txt_mode == "paragraph":  # decoded per paragraph so that one bad byte loses one paragraph
            for para in re.split(rb"\n[ \t\r]*\n", data):
                if not para.strip():
                    continue
                text = _decode_accept(para, stats, strip="\r\n")
                if text is not None:
                    yield text
    elif kind == "parquet":
        yield from _iter_parquet(path, text_field, stats)
        damaged = False
    else:
        raise ValueError(f"unsupported input file {path!r}")
    if damaged:
        stats.truncated_files += 1


def iter_documents(
    files: Sequence[str], text_field: str = "text", txt_mode: str = "file", stats: SourceStats | None = None
) -> Iterator[str]:
    for path in files:
        yield from iter_file_documents(path, text_field=text_field, txt_mode=txt_mode, stats=stats)
