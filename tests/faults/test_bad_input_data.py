"""Nothing lost, nothing silently wrong in `grt data` (issue 27; docs/reliability.md, "Bad input
data").

1. A refused `grt data prepare` or `grt data tokenizer` leaves the file system as it found it:
   every case runs against an existing output (a complete shard folder, a trained tokenizer)
   and against a new path, and the tree is hashed, file by file, before and after.
   A successful prepare over an old folder ends with the new run's files only.
2. A manifest whose `vocab_size` disagrees with its tokenizer, or whose tokenizer does not
   exist, is refused when it is loaded, in one line naming the file and both values.
3. Readers say what they could not read: a truncated `.zst`/`.gz` input is read up to the damage
   and counted (`truncated_files`, a warning naming it); a UTF-8 byte-order mark is not text.

Real `grt data` processes on small inputs; `-s` prints the counts per class at the end.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import zstandard
from commands import error_lines
from multiproc import grt

TRIED: Counter = Counter()  # inputs tried per class, printed at the end (-s) for docs/reliability.md
HANDLED: Counter = Counter()


def tree(root: Path) -> dict[str, str]:
    """Every file (hidden ones too) under root with its sha256, and every folder."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


def zst_frames(data: bytes, frame_bytes: int) -> bytes:
    """data as consecutive zstd frames of frame_bytes each (as a streaming writer that flushes frames would)."""
    c = zstandard.ZstdCompressor()
    return b"".join(c.compress(data[i : i + frame_bytes]) for i in range(0, len(data), frame_bytes))


def paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, demo_text, shards) -> dict[str, Path]:
    """Small good and bad inputs, made once."""
    d = tmp_path_factory.mktemp("bad_data_inputs")
    text = demo_text.read_text(encoding="utf-8")[:40_000]
    jsonl = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs(text)).encode()
    files = {
        "good": ("good.txt", text.encode()),
        "empty": ("empty.txt", b""),
        "no_field": ("no_field.jsonl", b'{"body": "text under another field"}\n' * 20),
        "not_gzip": ("not_gzip.txt.gz", b"plain text, not gzip data"),
        "not_zstd": ("not_zstd.jsonl.zst", b"plain text, not zstd data"),
        "csv": ("table.csv", b"a,b\n1,2\n"),
        # one zstd block cut in half: nothing decodes (zstandard's reader said "0 documents, nothing skipped")
        "cut_zst_only": ("cut_only.jsonl.zst", zstandard.ZstdCompressor().compress(jsonl)[:-200]),
        "not_a_model": ("words.model", b"these are words, not a SentencePiece model\n"),
        "empty_model": ("empty.model", b""),
    }
    paths = {}
    for key, (name, data) in files.items():
        paths[key] = d / name
        paths[key].write_bytes(data)
    paths["tok"] = shards.parent.parent / "tok.model"
    paths["root"] = d
    return paths


def fill(args: list[str], paths: dict[str, Path]) -> list[str]:
    """args with @name replaced by a built input and @root/NAME by a path in the inputs' folder."""
    out = []
    for a in args:
        if a.startswith("@root/"):
            out.append(str(paths["root"] / a.removeprefix("@root/")))
        else:
            out.append(str(paths[a[1:]]) if a.startswith("@") else a)
    return out


def check_refused(kind: str, proc, want: str) -> None:
    TRIED[kind] += 1
    lines = error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, f"rc {proc.returncode}: {proc.stderr}"
    assert len(lines) == 1, proc.stderr
    assert want in lines[0], lines[0]
    HANDLED[kind] += 1


# ------------------------------------------------------------------ 1. refusals change nothing
PREPARE_REFUSALS = [
    # (class, args after `grt data prepare` with @name for a built input, text the one line must contain)
    ("unreadable input", ["-i", "@not_gzip"], "cannot be read: Not a gzipped file"),
    ("unreadable input", ["-i", "@not_zstd"], "cannot be read"),
    ("unreadable input", ["-i", "@good", "-i", "@not_gzip"], "not_gzip.txt.gz' cannot be read"),
    ("unreadable input", ["-i", "@csv"], "unsupported file type"),
    ("unreadable input", ["-i", "@root/nothing-here-*.txt"], "matches no"),
    ("empty input", ["-i", "@empty"], "no usable documents"),
    ("empty input", ["-i", "@no_field"], "'skipped_missing_field': 20"),
    ("empty input", ["-i", "@cut_zst_only"], "'truncated_files': 1"),
    ("empty input", ["-i", "@good", "--seq-len", "100000"], "no complete sequence of 100001 tokens"),
    ("bad option", ["-i", "@good", "--seq-len", "0"], "seq_len must be >= 1, got 0"),
    ("bad option", ["-i", "@good", "--val-fraction", "1.5"], "val_fraction must be in [0, 1)"),
    ("bad option", ["-i", "@good", "--shard-size-mb", "0"], "shard_size_mb must be > 0"),
    ("bad option", ["-i", "@good", "--workers", "0"], "workers must be >= 1"),
    ("bad option", ["-i", "@good", "--max-mb", "-1"], "max_mb must be > 0"),
    ("bad option", ["-i", "@good", "--txt-mode", "page"], "invalid choice: 'page'"),
    ("bad tokenizer", ["-i", "@good", "-t", "@not_a_model"], "is not a SentencePiece model"),
    ("bad tokenizer", ["-i", "@good", "-t", "@empty_model"], "is not a SentencePiece model"),
    ("bad tokenizer", ["-i", "@good", "-t", "@root/no-such.model"], "not found"),
]


def prepare_argv(args: list[str], out: Path, paths: dict[str, Path]) -> list[str]:
    """`grt data prepare` of small settings with args (the shards' tokenizer unless args give one) into out."""
    argv = ["data", "prepare", "--txt-mode", "paragraph", "--seq-len", "64", "--workers", "1", "-q", "-o", str(out)]
    return argv + ([] if "-t" in args else ["-t", str(paths["tok"])]) + fill(args, paths)


@pytest.mark.parametrize(
    "kind,args,want", PREPARE_REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(PREPARE_REFUSALS)]
)
def test_refused_prepare_leaves_the_file_system_as_it_was(inputs, shards, tmp_path, kind, args, want):
    """Into a complete shard folder and into a new path: one line, exit 2, every file as it was
    (before: the manifest deleted and the tokenizer replaced; a new folder left behind)."""
    existing = tmp_path / "existing"
    shutil.copytree(shards.parent, existing / "shards")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for root, out in ((existing, existing / "shards"), (fresh, fresh / "a" / "b" / "shards")):
        before = tree(root)
        overwrite = ["--overwrite"] if root == existing else []  # even where replacing it is allowed
        check_refused(f"prepare: {kind}", grt(*prepare_argv(args, out, inputs), *overwrite), want)
        assert tree(root) == before, f"{out} changed"


TOKENIZER_REFUSALS = [
    ("unreadable input", ["-i", "@not_gzip"], "cannot be read: Not a gzipped file"),
    ("unreadable input", ["-i", "@good", "-i", "@not_zstd"], "not_zstd.jsonl.zst' cannot be read"),
    ("unreadable input", ["-i", "@root/nothing-here-*.txt"], "matches no"),
    ("empty input", ["-i", "@empty"], "no usable documents"),
    ("empty input", ["-i", "@cut_zst_only"], "'truncated_files': 1"),
    ("bad option", ["-i", "@good", "--vocab-size", "100"], "vocab_size must be in [258, 50257]"),
    ("bad option", ["-i", "@good", "--vocab-size", "258"], "SentencePiece training failed"),
    ("bad option", ["-i", "@good", "--character-coverage", "2"], "character_coverage must be in (0, 1]"),
    ("bad option", ["-i", "@good", "--max-chars", "0"], "max_chars must be >= 1"),
    ("bad option", ["-i", "@good", "--sep-piece="], "sep_piece must not be empty"),
    ("bad option", ["-i", "@good", "--workers", "-1"], "workers must be >= 1"),
]


@pytest.mark.parametrize(
    "kind,args,want", TOKENIZER_REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(TOKENIZER_REFUSALS)]
)
def test_refused_tokenizer_leaves_the_file_system_as_it_was(inputs, tmp_path, kind, args, want):
    """Over an existing model and into a new path (before: the folder made before the input was read)."""
    existing = tmp_path / "existing"
    existing.mkdir()
    shutil.copyfile(inputs["tok"], existing / "tok.model")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for root, out in ((existing, existing / "tok"), (fresh, fresh / "a" / "b" / "tok")):
        before = tree(root)
        argv = ["data", "tokenizer", "--txt-mode", "paragraph", "--vocab-size", "400", "-q", "-o", str(out)]
        check_refused(f"tokenizer: {kind}", grt(*argv, *fill(args, inputs)), want)
        assert tree(root) == before, f"{out} changed"


def test_prepare_refused_after_writing_shards_puts_the_old_folder_back(inputs, shards, tmp_path, monkeypatch):
    """A failure after every new shard replaced an old one (a full disk at the manifest): the old
    shards, tokenizer and manifest are back, byte for byte, and nothing of the new run is left."""
    from data_pipeline import prepare as prepare_mod

    out = tmp_path / "shards"
    shutil.copytree(shards.parent, out)
    before = tree(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare_mod, "_write_manifest", full_disk)
    other_tok = tmp_path.parent / "other.model"  # another tokenizer file, so tokenizer.model is replaced too
    shutil.copyfile(inputs["tok"], other_tok)
    TRIED["prepare: refused after writing"] += 1
    with pytest.raises(OSError, match="No space left"):
        prepare_mod.prepare(
            [str(inputs["good"])],
            str(other_tok),
            str(out),
            seq_len=32,
            shard_size_mb=0.05,
            workers=1,
            progress=False,
            overwrite=True,  # another prepare's output: replaced by design
        )
    assert tree(tmp_path) == before
    HANDLED["prepare: refused after writing"] += 1


def test_prepare_killed_before_replacing_a_file_leaves_the_old_run_usable(inputs, shards, tmp_path, monkeypatch):
    """An interruption (not undone) while the first new shard is still a temporary: the old
    manifest stays, and it and every file it describes are as they were."""
    from data_pipeline import prepare as prepare_mod
    from data_pipeline import shards as shards_mod

    out = tmp_path / "shards"
    shutil.copytree(shards.parent, out)
    before = tree(out)

    def killed(fh, data, chunk=1 << 22):
        fh.write(data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_mod, "_write_chunks", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_mod.prepare(
            [str(inputs["good"])], str(inputs["tok"]), str(out), seq_len=32, workers=1, progress=False, overwrite=True
        )
    after = tree(out)
    assert set(after) - set(before) == {"train-000000.tar.tmp"}
    assert all(after[name] == sha for name, sha in before.items())
    r = grt("data", "inspect", str(out), "--verify")
    assert r.returncode == 0 and "0 bad shard" in r.stdout, r.stdout + r.stderr


def test_prepare_over_an_old_folder_ends_with_the_new_run_only(inputs, shards, tmp_path):
    """Old shards the new run does not make, a partial shard of an interrupted run: gone after the
    new manifest is in place; the result equals a run into a new folder; other files are kept."""
    out = tmp_path / "shards"
    shutil.copytree(shards.parent, out)
    (out / "train-000099.tar.tmp").write_bytes(b"half a shard")
    (out / "notes.txt").write_text("not ours: kept")
    old = {e["name"] for entries in json.loads((out / "manifest.json").read_text())["splits"].values() for e in entries}
    args = ["-i", str(inputs["good"]), "--shard-size-mb", "0.05", "--val-fraction", "0.05"]
    for o in (out, tmp_path / "fresh"):
        r = grt(*prepare_argv([], o, inputs), *args, "--overwrite")  # another prepare's output: replaced
        assert r.returncode == 0, r.stderr
    fresh = tree(tmp_path / "fresh")
    assert tree(out) == {**fresh, "notes.txt": hashlib.sha256(b"not ours: kept").hexdigest()}
    manifest = json.loads((out / "manifest.json").read_text())
    names = {e["name"] for entries in manifest["splits"].values() for e in entries}
    assert set(fresh) == names | {"manifest.json", "tokenizer.model"} and old - names  # stale shards were there
    r = grt("data", "inspect", str(out), "--verify")
    assert r.returncode == 0 and "0 bad shard" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------ 2. manifest values at the door
def edited(shards: Path, dest: Path, edit) -> Path:
    """A copy of the shard folder whose manifest went through edit(raw)."""
    shutil.copytree(shards.parent, dest)
    raw = json.loads((dest / "manifest.json").read_text())
    edit(raw)
    (dest / "manifest.json").write_text(json.dumps(raw))
    return dest / "manifest.json"


def test_manifest_with_another_vocab_or_no_tokenizer_is_refused_at_load(shards, tmp_path):
    from data_pipeline.manifest import Manifest

    vocab = json.loads(shards.read_text())["vocab_size"]
    cases = [
        (lambda raw: raw.update(vocab_size=vocab + 88), [f"vocab_size {vocab + 88}", f"has {vocab} pieces"]),
        (lambda raw: raw["tokenizer"].update(path="gone/tokenizer.model"), ["gone/tokenizer.model", "does not exist"]),
        (lambda raw: raw.update(sep_id=vocab), [f"sep_id {vocab}", f"vocab_size {vocab}"]),
    ]
    for i, (edit, wants) in enumerate(cases):
        path = edited(shards, tmp_path / str(i), edit)
        TRIED["manifest values"] += 1
        with pytest.raises(ValueError) as err:
            Manifest.load(str(path))
        assert str(path) in str(err.value) and all(w in str(err.value) for w in wants), err.value
        r = grt("data", "inspect", str(path))
        check_refused("manifest values (grt data inspect)", r, wants[0])
        assert str(path) in r.stderr and all(w in r.stderr for w in wants)
        HANDLED["manifest values"] += 1
    assert Manifest.load(str(shards)).vocab_size == vocab  # the untouched one loads


# ------------------------------------------------------------------ 3. readers say what they could not read
def test_truncated_compressed_inputs_are_read_to_the_damage_and_counted(inputs, demo_text, tmp_path):
    text = demo_text.read_text(encoding="utf-8")[:200_000]
    lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs(text)).encode()
    whole = zst_frames(lines, 20_000)
    d = tmp_path / "in"
    d.mkdir()
    (d / "a-whole.jsonl.zst").write_bytes(whole)
    (d / "b-cut.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    gz = gzip.compress(lines)
    (d / "c-cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    r = grt(*prepare_argv([], tmp_path / "out", inputs), "-i", str(d), "--val-fraction", "0.1")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in error_lines(r.stderr) if "warning" in line]
    assert len(warnings) == 2 and "b-cut.jsonl.zst" in warnings[0] and "c-cut.jsonl.gz" in warnings[1], r.stderr
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["stats"]["truncated_files"] == 2 and m["stats"]["skipped_bad_json"] == 0
    docs = {Path(s["path"]).name: s for s in m["sources"]}
    full = docs["a-whole.jsonl.zst"]["documents"]
    for cut in ("b-cut.jsonl.zst", "c-cut.jsonl.gz"):
        TRIED["truncated input"] += 1
        assert docs[cut]["truncated_files"] == 1 and 0 < docs[cut]["documents"] < full, docs[cut]
        HANDLED["truncated input"] += 1
    assert docs["a-whole.jsonl.zst"]["truncated_files"] == 0


TEXT_FORMATS = ["a.txt", "b.txt.gz", "c.txt.zst", "d.jsonl", "e.jsonl.gz", "f.jsonl.zst", "g.json", "h.ndjson"]


def write_format(path: Path, docs: list[str], bom: bool) -> None:
    if ".txt" in path.name:
        raw = "\n\n".join(docs).encode()
    else:
        raw = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in docs).encode()
    raw = (b"\xef\xbb\xbf" if bom else b"") + raw
    if path.name.endswith(".gz"):
        raw = gzip.compress(raw)
    elif path.name.endswith(".zst"):
        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)


def test_a_byte_order_mark_is_not_text_in_any_format(inputs, demo_text, tmp_path):
    """Each format with and without a UTF-8 BOM reads the same documents (in every txt mode), and
    `grt data prepare` of both trees gives the same shards (before: bad JSON, or U+FEFF in the text)."""
    from data_pipeline.sources import SourceStats, iter_file_documents

    docs = paragraphs(demo_text.read_text(encoding="utf-8")[:30_000])
    for bom in (False, True):
        (tmp_path / str(bom)).mkdir()
        for name in TEXT_FORMATS:
            write_format(tmp_path / str(bom) / name, docs, bom)
    for name in TEXT_FORMATS:
        TRIED["byte-order mark"] += 1
        for mode in ("file", "paragraph", "line") if ".txt" in name else ("file",):
            got = {}
            for bom in (False, True):
                stats = SourceStats()
                got[bom] = list(iter_file_documents(str(tmp_path / str(bom) / name), txt_mode=mode, stats=stats))
                assert stats.skipped_bad_json == 0 and stats.skipped_non_utf8 == 0, (name, mode, stats)
            assert got[True] == got[False] and not got[True][0].startswith("\ufeff"), (name, mode)
        HANDLED["byte-order mark"] += 1
    shas = {}
    for bom in (False, True):
        r = grt(*prepare_argv([], tmp_path / f"out-{bom}", inputs), "-i", str(tmp_path / str(bom)))
        assert r.returncode == 0, r.stderr
        m = json.loads((tmp_path / f"out-{bom}" / "manifest.json").read_text())
        assert m["stats"]["skipped_bad_json"] == 0
        shas[bom] = [e["sha256"] for e in m["splits"]["train"]]
    assert shas[True] == shas[False]


def test_zz_report_counts():
    """With -s: the inputs tried and handled per class (the table in docs/reliability.md)."""
    out = io.StringIO()
    for kind in sorted(TRIED):
        print(f"BAD-INPUT-DATA {kind}: tried {TRIED[kind]}, handled {HANDLED[kind]}", file=out)
    print(out.getvalue(), end="")
    assert HANDLED == TRIED
