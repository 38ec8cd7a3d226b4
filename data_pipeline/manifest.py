"""The manifest: the JSON file that describes a directory of token shards.

Written last by ``grt data prepare`` (atomically), so a manifest exists only for a
complete set of shards. See docs/data.md for the fields.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "grt-token-shards"
VERSION = 1
LOSS_MASKS = ("bits",)  # the "loss_mask" values this code reads (absent: no masks; data_pipeline/shards.py)


# What a shard's name in a manifest may be: a path, or a URL of a scheme this project reads by ranges
# (data_pipeline/remote.py). Any other scheme is refused, webdataset's `pipe:` (a shell command) first
# of all: a file's words never run. There is no switch that lets a manifest run a command.
SHARD_SCHEMES = ("http://", "https://", "s3://", "gs://")
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


class RefusedEntry(ValueError):
    """A path or URL in a file that this project does not follow: one line naming the file and the entry."""


def is_url(name: str) -> bool:
    return _SCHEME_RE.match(name) is not None


def inside(base: str, name: str, what: str) -> str:
    """`name` (a path from a file in folder `base`) resolved against `base`: an absolute one as it is
    (the file's author chose it), a relative one only where it stays inside `base` (lexically: `..`
    that climbs out is refused). ValueError naming `what` (the file and the entry) otherwise."""
    if os.path.isabs(name):
        return name
    resolved = os.path.normpath(os.path.join(base, name))
    if os.path.commonpath([resolved, os.path.normpath(base)]) != os.path.normpath(base):
        raise RefusedEntry(
            f"{what} {name!r} leaves the folder {base!r}: a relative path in it stays inside its folder "
            "(write an absolute path to name a file elsewhere)"
        )
    return resolved


def shard_location(base: str, name: Any, what: str) -> str:
    """What the loader opens for shard `name` of a manifest in folder `base` (`inside`, or a URL of
    SHARD_SCHEMES); ValueError naming `what` (the manifest and the entry) for anything else."""
    if not isinstance(name, str) or not name:
        raise RefusedEntry(f"{what} has name {name!r}: expected a path or URL")
    if is_url(name):
        if not name.startswith(SHARD_SCHEMES):
            scheme = name.split(":", 1)[0]
            raise RefusedEntry(
                f"{what} {name!r} names a {scheme}: shard; a shard is a path or a {', '.join(SHARD_SCHEMES)} "
                "URL, and a command in a file is never run"
            )
        return name
    return inside(base, name, what)


@dataclass
class ShardEntry:
    name: str  # as written in the manifest (relative path, absolute path or URL)
    url: str  # what the loader opens: name resolved against the manifest's directory
    sequences: int  # samples in the shard (each seq_len + 1 tokens)
    tokens: int  # training tokens = sequences * seq_len
    bytes: int = 0
    sha256: str = ""
    head_sha256: str = ""  # of the first member (its header and sample 0): the shard's identity, checked when read

    def to_dict(self) -> dict[str, Any]:
        head = {"head_sha256": self.head_sha256} if self.head_sha256 else {}
        return {
            "name": self.name,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "sha256": self.sha256,
            **head,
        }


@dataclass
class Manifest:
    path: str
    seq_len: int
    vocab_size: int
    sep_id: int
    ext: str
    tokenizer_sha256: str
    tokenizer_path: str  # absolute path of the tokenizer model next to the shards
    splits: dict[str, list[ShardEntry]]
    sep_piece: str = ""
    sources: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    loss_mask: str = ""  # "bits": each sample has a loss mask member (data_pipeline/shards.py); "": none
    raw: dict = field(default_factory=dict, repr=False)
    tokenizer_verified: bool = field(default=False, repr=False, compare=False)  # hashed once per Manifest

    @property
    def sample_tokens(self) -> int:
        return self.seq_len + 1

    @property
    def masked(self) -> bool:
        """Whether the samples carry loss masks (only their answers trained, say)."""
        return bool(self.loss_mask)

    def sequences(self, split: str) -> int:
        return sum(s.sequences for s in self.shards(split))

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.shards(split))

    def shards(self, split: str) -> list[ShardEntry]:
        if split not in self.splits:
            raise KeyError(f"manifest {self.path!r} has no split {split!r} (it has {sorted(self.splits)})")
        return self.splits[split]

    def fingerprint(self, split: str) -> str:
        """Short hash of a split's shard list (names, counts, checksums) and the sample layout."""
        h = hashlib.sha256()
        h.update(f"{self.seq_len}:{self.ext}:{self.tokenizer_sha256}\n".encode())
        for s in self.shards(split):
            h.update(f"{s.name}:{s.sequences}:{s.sha256}\n".encode())
        return h.hexdigest()[:16]

    def check(self, expected_seq_len: int | None = None, expected_tokenizer_sha256: str | None = None) -> None:
        """Refuse a manifest whose sequence length or tokenizer is not the expected one."""
        if expected_seq_len is not None and int(expected_seq_len) != self.seq_len:
            raise ValueError(
                f"manifest {self.path!r} has seq_len {self.seq_len}, but {int(expected_seq_len)} was expected"
            )
        if expected_tokenizer_sha256 is not None and expected_tokenizer_sha256 != self.tokenizer_sha256:
            raise ValueError(
                f"manifest {self.path!r} was tokenised with tokenizer sha256 {self.tokenizer_sha256}, "
                f"but sha256 {expected_tokenizer_sha256} was expected"
            )

    def verify_tokenizer(self) -> None:
        """Check that the tokenizer file next to the manifest is the one the shards were made with
        (hashed once: every loader built from this Manifest reuses the answer)."""
        from .tokenizer import file_sha256

        if self.tokenizer_verified:
            return
        actual = file_sha256(self.tokenizer_path)
        if actual != self.tokenizer_sha256:
            raise ValueError(
                f"tokenizer {self.tokenizer_path!r} has sha256 {actual}, but manifest {self.path!r} "
                f"records {self.tokenizer_sha256}"
            )
        self.tokenizer_verified = True

    @classmethod
    def load(cls, path: str) -> Manifest:
        """Load ``path`` (a manifest.json, or a directory holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, MANIFEST_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"manifest {path!r} not found (run `grt data prepare` first; the manifest "
                f"is written last, so a missing one can mean an interrupted run)"
            )
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"manifest {path!r} is not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(
                f"{path!r} is not a {FORMAT} manifest (format={raw.get('format') if isinstance(raw, dict) else None!r})"
            )
        version = raw.get("version", 0)
        if not isinstance(version, int) or version > VERSION:
            raise ValueError(f"manifest {path!r} has version {version!r}, this code reads <= {VERSION}")
        try:
            manifest = cls._from_raw(path, raw)
        except RefusedEntry:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field missing or of the wrong type
            raise ValueError(f"manifest {path!r} is malformed ({type(exc).__name__}: {exc})") from None
        manifest._check_values()
        return manifest

    def _check_values(self) -> None:
        """Values checked at the door, each refused in one line naming the file: the sample
        layout, and the tokenizer (it exists, it is the file the manifest records, by its sha256;
        its vocabulary is the manifest's)."""
        if self.seq_len < 1:
            raise ValueError(f"manifest {self.path!r} has seq_len {self.seq_len}; it must be >= 1")
        if self.ext not in _DTYPE_EXTS:
            raise ValueError(f"manifest {self.path!r} has dtype_ext {self.ext!r}; this code reads {_DTYPE_EXTS}")
        if self.loss_mask and self.loss_mask not in LOSS_MASKS:
            raise ValueError(
                f"manifest {self.path!r} has loss_mask {self.loss_mask!r}; this code reads {', '.join(LOSS_MASKS)}"
            )
        if not 0 <= self.sep_id < self.vocab_size:
            raise ValueError(
                f"manifest {self.path!r} has sep_id {self.sep_id} outside its vocab_size {self.vocab_size}"
            )
        if not os.path.isfile(self.tokenizer_path):
            raise ValueError(
                f"manifest {self.path!r} names tokenizer {self.tokenizer_path!r}, which does not exist "
                f"(copy the tokenizer there or edit the manifest's tokenizer.path)"
            )
        self.verify_tokenizer()  # the file itself, read: not the hash it records (a dry run checks what a run does)
        pieces = _tokenizer_pieces(self.tokenizer_path)
        if pieces is not None and pieces != self.vocab_size:
            raise ValueError(
                f"manifest {self.path!r} has vocab_size {self.vocab_size} (tokenizer sha256 "
                f"{self.tokenizer_sha256}), but its tokenizer {self.tokenizer_path!r} has {pieces} pieces"
            )

    @classmethod
    def _from_raw(cls, path: str, raw: dict[str, Any]) -> Manifest:
        base = os.path.dirname(os.path.abspath(path))
        entry = f"manifest {os.path.abspath(path)!r}:"
        seq_len = int(raw["seq_len"])
        splits = {
            split: [
                ShardEntry(
                    name=e["name"],
                    url=shard_location(base, e["name"], f"{entry} {split} shard {i}"),
                    sequences=int(e["sequences"]),
                    tokens=int(e.get("tokens", int(e["sequences"]) * seq_len)),
                    bytes=int(e.get("bytes", 0)),
                    sha256=e.get("sha256", ""),
                    head_sha256=e.get("head_sha256", ""),
                )
                for i, e in enumerate(entries)
            ]
            for split, entries in raw["splits"].items()
        }
        tok = raw["tokenizer"]
        return cls(
            path=os.path.abspath(path),
            seq_len=seq_len,
            vocab_size=int(raw["vocab_size"]),
            sep_id=int(raw["sep_id"]),
            ext=raw["dtype_ext"],
            tokenizer_sha256=tok["sha256"],
            tokenizer_path=_tokenizer_location(base, tok["path"], f"{entry} tokenizer.path"),
            splits=splits,
            sep_piece=raw.get("sep_piece", ""),
            sources=raw.get("sources", []),
            stats=raw.get("stats", {}),
            options=raw.get("options", {}),
            loss_mask=raw.get("loss_mask", ""),
            raw=raw,
        )


_DTYPE_EXTS = ("u16", "u32")


def _tokenizer_location(base: str, name: Any, what: str) -> str:
    """A manifest's tokenizer file: a path (`inside` its folder where relative), never a URL."""
    if not isinstance(name, str) or not name or is_url(name):
        raise RefusedEntry(f"{what} is {name!r}: expected the path of the tokenizer.model file")
    return os.path.abspath(inside(base, name, what))


@functools.lru_cache(maxsize=64)
def _pieces_of(path: str, size: int, mtime_ns: int) -> int | None:
    import sentencepiece as spm

    try:
        return int(spm.SentencePieceProcessor(model_file=path).get_piece_size())
    except (RuntimeError, OSError):  # not a SentencePiece model
        return None


def _tokenizer_pieces(path: str) -> int | None:
    """The vocabulary size of a SentencePiece model file (cached per file version), or None
    when it is not one."""
    st = os.stat(path)
    return _pieces_of(path, st.st_size, st.st_mtime_ns)


def manifest_dict(
    *,
    seq_len: int,
    vocab_size: int,
    sep_id: int,
    sep_piece: str,
    ext: str,
    tokenizer_name: str,
    tokenizer_sha256: str,
    splits: dict[str, list[dict]],
    sources: list,
    stats: dict,
    options: dict,
    loss_mask: str = "",
) -> dict:
    """A manifest's fields (`loss_mask` only where set: data without masks is written as before)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "seq_len": seq_len,
        "sample_tokens": seq_len + 1,
        "dtype_ext": ext,
        "dtype": {"u16": "uint16 little-endian", "u32": "uint32 little-endian"}[ext],
        "vocab_size": vocab_size,
        "sep_id": sep_id,
        "sep_piece": sep_piece,
        "tokenizer": {"path": tokenizer_name, "sha256": tokenizer_sha256},
        "splits": splits,
        "totals": {
            split: {
                "shards": len(v),
                "sequences": sum(e["sequences"] for e in v),
                "tokens": sum(e["tokens"] for e in v),
            }
            for split, v in splits.items()
        },
        "sources": sources,
        "stats": stats,
        "options": options,
        **({"loss_mask": loss_mask} if loss_mask else {}),
    }
