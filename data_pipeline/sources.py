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
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
TXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = ".txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet"
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
TXT_MODES = ("file", "paragraph", "line")


@dataclass
class SourceStats:
    documents: int = 0
    chars: int = 0
    bytes: int = 0  # UTF-8 bytes of the accepted documents
    skipped_empty: int = 0
    skipped_non_utf8: int = 0
    skipped_bad_json: int = 0
    skipped_missing_field: int = 0

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


def open_binary(path: str) -> io.BufferedIOBase:
    """A binary stream of the (decompressed) file."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")
    if lower.endswith((".zst", ".zstd")):
        import zstandard

        fh = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb")


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


def _iter_parquet(path: str, text_field: str, stats: SourceStats) -> Iterator[str]:
    """The ``text_field`` strings of a Parquet file, one row group in memory at a time."""
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
            for raw in fh:
                if not raw.strip():
                    continue  # blank line between records, not a document
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats.skipped_non_utf8 += 1
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    stats.skipped_bad_json += 1
                    continue
                text = obj.get(text_field) if isinstance(obj, dict) else None
                text = _accept(text, stats)
                if text is not None:
                    yield text
    elif kind == "txt":
        with open_binary(path) as fh:
            if txt_mode == "line":
                for raw in fh:
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
                return
            data = fh.read()
        if txt_mode == "file":
            text = _decode_accept(data, stats)
            if text is not None:
                yield text
        else:  # paragraph: decode per paragraph so that one bad byte loses one paragraph
            for para in re.split(rb"\n[ \t\r]*\n", data):
                if not para.strip():
                    continue
                text = _decode_accept(para, stats, strip="\r\n")
                if text is not None:
                    yield text
    elif kind == "parquet":
        yield from _iter_parquet(path, text_field, stats)
    else:
        raise ValueError(f"unsupported input file {path!r}")


def iter_documents(
    files: Sequence[str], text_field: str = "text", txt_mode: str = "file", stats: SourceStats | None = None
) -> Iterator[str]:
    for path in files:
        yield from iter_file_documents(path, text_field=text_field, txt_mode=txt_mode, stats=stats)
