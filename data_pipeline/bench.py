"""`grt bench data`: throughput of `prepare` (MB/s of text) and of the loader (tokens/s).

Runs on the shared Gutenberg corpus by default (``$GRT_DATA_CORPUS``, else
``../shared/data/corpus`` next to the repository), bounded by ``--max-mb`` so it takes a
couple of minutes on 2 cores: trains a small tokenizer on a sample, prepares shards with
``--workers`` processes, then iterates the loader in one process (num_workers=0) from the
local shards.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from grt_common.files import output_path

if TYPE_CHECKING:
    from .loader import TokenBatchLoader
    from .manifest import Manifest

MIXTURE_ROUNDS = 5  # --mixture: windows of the single manifest and the mixture taking turns
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_corpus() -> str:
    return os.environ.get("GRT_DATA_CORPUS") or os.path.normpath(
        os.path.join(REPO_ROOT, "..", "shared", "data", "corpus")
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grt bench data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--corpus",
        default=None,
        help="directory of train-*.jsonl.gz (default $GRT_DATA_CORPUS or ../shared/data/corpus)",
    )
    p.add_argument(
        "--input",
        action="append",
        default=None,
        help="explicit inputs instead of <corpus>/train-*.jsonl.gz (repeatable)",
    )
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-mb", type=float, default=24.0, help="MB of text to prepare (default 24)")
    p.add_argument("--tokenizer", default=None, help="use this .model instead of training one")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained tokenizer (default 8192)")
    p.add_argument(
        "--tokenizer-chars", type=int, default=3_000_000, help="characters the tokenizer trains on (default 3M)"
    )
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--shard-size-mb", type=float, default=16.0)
    p.add_argument("--workers", type=int, default=2, help="prepare worker processes (default 2)")
    p.add_argument("--batch-size", type=int, default=8, help="loader micro batch size (default 8)")
    p.add_argument("--loader-seconds", type=float, default=5.0, help="minimum loader measuring time (default 5)")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader workers for the loader run (default 0)")
    p.add_argument(
        "--mixture",
        type=int,
        default=0,
        metavar="N",
        help="also time a mixture of N sources (the train shards dealt into N manifests, weights N:N-1:...:1) "
        "against the single manifest, alternating, in the same run (default 0: off)",
    )
    p.add_argument(
        "--parquet",
        action="store_true",
        help="also time prepare from the same text as Parquet (row groups of 64 documents; needs pyarrow)",
    )
    p.add_argument(
        "--out",
        default=None,
        type=output_path(is_dir=True),
        help="keep the shards in this directory (default: a temp dir, removed)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the results")
    return p


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, checked before any work (one line), or None."""
    import math

    from .tokenizer import MAX_VOCAB_SIZE

    checks = (
        ("--max-mb", args.max_mb, math.isfinite(args.max_mb) and args.max_mb > 0, "> 0"),
        ("--vocab-size", args.vocab_size, 258 <= args.vocab_size <= MAX_VOCAB_SIZE, f"in [258, {MAX_VOCAB_SIZE}]"),
        ("--tokenizer-chars", args.tokenizer_chars, args.tokenizer_chars >= 1, ">= 1"),
        ("--seq-len", args.seq_len, args.seq_len >= 1, ">= 1"),
        ("--shard-size-mb", args.shard_size_mb, math.isfinite(args.shard_size_mb) and args.shard_size_mb > 0, "> 0"),
        ("--workers", args.workers, args.workers >= 1, ">= 1"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
        (
            "--loader-seconds",
            args.loader_seconds,
            math.isfinite(args.loader_seconds) and args.loader_seconds > 0,
            "> 0",
        ),
        ("--loader-workers", args.loader_workers, args.loader_workers >= 0, ">= 0"),
        ("--mixture", args.mixture, args.mixture >= 0, ">= 0 (0: off)"),
    )
    for flag, value, ok, want in checks:
        if not ok:
            return f"{flag} must be {want}, got {value}"
    if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
        return f"--tokenizer {args.tokenizer!r} is not a file"
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out!r} is a file, not a directory"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    refused = _refusal(args)
    if refused:
        print(f"grt bench data: error: {refused}", file=sys.stderr)
        return 2
    from .sources import expand_inputs

    corpus = args.corpus or default_corpus()
    inputs = args.input or [os.path.join(corpus, "train-*.jsonl.gz")]
    try:
        files = expand_inputs(inputs)
    except (FileNotFoundError, ValueError) as exc:
        print(
            f"grt bench data: error: {exc} (point --corpus or $GRT_DATA_CORPUS at a directory of train-*.jsonl.gz, "
            "or pass --input)",
            file=sys.stderr,
        )
        return 2
    work = args.out or tempfile.mkdtemp(prefix="grt-bench-data-")
    os.makedirs(work, exist_ok=True)
    result = {
        "corpus_files": [os.path.basename(f) for f in files],
        "max_mb": args.max_mb,
        "seq_len": args.seq_len,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
    }
    try:
        m = _bench_prepare(files, work, args, result)
        error = _bench_loading(m, args, result)
        if error:
            print(f"grt bench data: error: {error}", file=sys.stderr)
            return 2
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    repro = "grt bench data " + " ".join(shlex.quote(a) for a in argv)
    result["command"] = repro.strip()
    if args.json:
        print(json.dumps(result))
    else:
        _print_result(result, args)
    return 0


def _bench_prepare(files: list[str], work: str, args: argparse.Namespace, result: dict[str, Any]) -> Manifest:
    """The tokenizer (trained unless --tokenizer), `grt data prepare` timed against its limits (and
    from Parquet with --parquet), into `result`; the prepared manifest."""
    from .tokenizer import train_tokenizer

    if args.tokenizer:
        tok_path = args.tokenizer
    else:
        t0 = time.time()
        tok_path = os.path.join(work, "bench-tokenizer.model")
        train_tokenizer(
            files,
            tok_path,
            vocab_size=args.vocab_size,
            text_field=args.text_field,
            max_chars=args.tokenizer_chars,
            progress=not args.json,
        )
        result["tokenizer_train_s"] = round(time.time() - t0, 2)
        result["vocab_size"] = args.vocab_size
    m, dt = _timed_prepare(files, tok_path, os.path.join(work, "shards"), args)
    text_mb = m.stats["bytes"] / 1e6
    stream_tokens = sum(m.stats["stream_tokens_per_split"].values())
    result.update(
        prepare_s=round(dt, 2),
        prepare_text_mb=round(text_mb, 2),
        prepare_mb_per_s=round(text_mb / dt, 3),
        prepare_tokens_per_s=round(stream_tokens / dt),
        shards=len(m.shards("train")),
        sequences=m.sequences("train"),
        prepare_mb_per_s_per_core=round(text_mb / dt / args.workers, 3),
    )
    result.update(_limits(files, tok_path, work, args, m))
    result["prepare_vs_limit"] = round(dt / result["encode_limit_s"], 3)  # the same text and processes
    if args.parquet:
        result.update(_bench_parquet(files, tok_path, work, args, m.stats["bytes"]))
    return m


def _timed_prepare(files: list[str], tok_path: str, out: str, args: argparse.Namespace) -> tuple[Manifest, float]:
    """`grt data prepare` of `files` into `out` with the benchmark's settings, and its seconds."""
    from .prepare import prepare

    t0 = time.time()
    m = prepare(
        files,
        tok_path,
        out,
        seq_len=args.seq_len,
        shard_size_mb=args.shard_size_mb,
        workers=args.workers,
        text_field=args.text_field,
        max_mb=args.max_mb,
        progress=not args.json,
    )
    return m, time.time() - t0


def _bench_loading(m: Manifest, args: argparse.Namespace, result: dict[str, Any]) -> str | None:
    """The loader's tokens per second on the prepared shards (and a mixture's against it with
    --mixture), into `result`; the refusal when the shards cannot make that mixture."""
    from .loader import TokenBatchLoader

    def single() -> TokenBatchLoader:
        return TokenBatchLoader(
            m.path, micro_batch_size=args.batch_size, num_workers=args.loader_workers, seed=0, loop=True
        )

    tokens, batches, dt = _time_loader(single(), args.loader_seconds, single().batches_per_epoch)
    result.update(
        loader_tokens_per_s=round(tokens / dt),
        loader_batches=batches,
        loader_s=round(dt, 2),
        loader_batch_size=args.batch_size,
        loader_workers=args.loader_workers,
    )
    if args.mixture:
        try:
            result.update(_bench_mixture(m, args, single))
        except ValueError as exc:
            return str(exc)
    return None


def _print_result(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"prepare: {result['prepare_text_mb']:.1f} MB of text in {result['prepare_s']:.1f}s = "
        f"{result['prepare_mb_per_s']:.2f} MB/s ({result['prepare_tokens_per_s'] / 1e6:.2f}M tokens/s, "
        f"{args.workers} workers, {os.cpu_count()} CPUs)"
    )
    print(
        f"  per process: prepare {result['prepare_mb_per_s_per_core']:.2f} MB/s, SentencePiece encode of the same "
        f"text on {args.workers} processes {result['encode_limit_mb_per_s_per_core']:.2f} MB/s (the limit): "
        f"{result['prepare_vs_limit']:.2f}x its time (whole documents: "
        f"{result['encode_whole_docs_mb_per_s_per_core']:.2f} MB/s); reading the text {result['read_s']:.2f}s "
        f"and writing the shards {result['shard_write_s']:.2f}s ({result['shard_write_mb_per_s']:.0f} MB/s) "
        "in the main process"
    )
    if "parquet_prepare_mb_per_s" in result:
        print(
            f"prepare from Parquet: {result['parquet_prepare_text_mb']:.1f} MB of text in "
            f"{result['parquet_prepare_s']:.1f}s = {result['parquet_prepare_mb_per_s']:.2f} MB/s"
        )
    if "tokenizer_train_s" in result:
        print(f"tokenizer: vocab {args.vocab_size} trained in {result['tokenizer_train_s']:.1f}s")
    print(
        f"loader: {result['loader_tokens_per_s'] / 1e6:.2f}M tokens/s ({result['loader_batches']} batches of "
        f"{args.batch_size}x{args.seq_len}, {args.loader_workers} DataLoader workers, one process)"
    )
    if "mixture_vs_single" in result:
        print(
            f"mixture of {result['mixture_sources']} sources: {result['mixture_tokens_per_s'] / 1e6:.2f}M tokens/s "
            f"against {result['mixture_single_tokens_per_s'] / 1e6:.2f}M for the single manifest of the same "
            f"shards: {result['mixture_vs_single']:.3f}x (turns of 32 batches; over {MIXTURE_ROUNDS} windows "
            f"{result['mixture_vs_single_range'][0]:.3f}-{result['mixture_vs_single_range'][1]:.3f})"
        )
    print(f"reproduce: {result['command']}")


def _limits(files: list[str], tok_path: str, work: str, args: argparse.Namespace, m: Manifest) -> dict[str, Any]:
    """Prepare's bounds on the same text: SentencePiece's encode (data_pipeline/bench_limits.py),
    reading the documents and writing the shards, each timed alone."""
    from .bench_limits import encode_limit, read_documents, shard_write

    docs, read_s = read_documents(files, args.text_field, m.stats["bytes"])
    return {**encode_limit(docs, tok_path, args.workers), "read_s": round(read_s, 2), **shard_write(m, work)}


def _time_loader(loader: Iterable[dict[str, Any]], seconds: float, min_batches: int) -> tuple[int, int, float]:
    """(tokens, batches, seconds) of iterating `loader` for at least `seconds` and `min_batches`."""
    tokens = batches = 0
    t0 = time.time()
    for batch in loader:
        tokens += batch["input_ids"].numel()
        batches += 1
        if batches % 64 == 0 and time.time() - t0 >= seconds and batches >= min_batches:
            break
    return tokens, batches, time.time() - t0


def _bench_mixture(m: Manifest, args: argparse.Namespace, single: Callable[[], TokenBatchLoader]) -> dict[str, Any]:
    """The loader's throughput on a mixture of `args.mixture` sources made of the same shards
    (dealt round-robin into one manifest each, next to the original so that its relative shard
    names resolve) against the single manifest, the two taking turns (below)."""
    from .mixture import DataMixture, SourceSpec
    from .mixture_loader import MixtureLoader

    n = args.mixture
    if len(m.shards("train")) < n:
        raise ValueError(
            f"--mixture {n}: the prepared train split has {len(m.shards('train'))} shard(s), fewer than the sources: "
            "pass a smaller --shard-size-mb or a larger --max-mb"
        )
    with open(m.path, encoding="utf-8") as fh:
        raw = json.load(fh)
    specs = []
    for i in range(n):
        part = dict(raw, splits={**raw["splits"], "train": raw["splits"]["train"][i::n]})
        path = os.path.join(os.path.dirname(m.path), f"source-{i}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(part, fh)
        specs.append(SourceSpec(f"s{i}", float(n - i), path))
    mix = DataMixture.load(",".join(f"{s.name}={s.weight:g}:{s.path}" for s in specs), specs)

    def mixed() -> MixtureLoader:
        return MixtureLoader(mix, micro_batch_size=args.batch_size, num_workers=args.loader_workers, seed=0)

    # Both loaders live at once and take turns, 32 batches each: this machine's speed drifts by
    # tens of percent over seconds, which a turn of either sees alike. Each of MIXTURE_ROUNDS
    # windows of --loader-seconds x 2 gives a ratio; the whole run's is the result.
    loaders = {"single": iter(single()), "mixture": iter(mixed())}
    for it in loaders.values():
        next(it)  # the first read of each (a shuffle block, a chunk) is start-up, not throughput
    totals = {name: [0, 0.0] for name in loaders}  # tokens, seconds
    ratios = []
    for _ in range(MIXTURE_ROUNDS):
        window = {name: [0, 0.0] for name in loaders}
        end = time.perf_counter() + 2 * args.loader_seconds
        while time.perf_counter() < end:
            for name, it in loaders.items():
                t0 = time.perf_counter()
                tokens = sum(next(it)["input_ids"].numel() for _ in range(32))
                window[name][0] += tokens
                window[name][1] += time.perf_counter() - t0
        for name in loaders:
            totals[name][0] += window[name][0]
            totals[name][1] += window[name][1]
        ratios.append((window["mixture"][0] / window["mixture"][1]) / (window["single"][0] / window["single"][1]))
    single_rate, mixture_rate = (totals[name][0] / totals[name][1] for name in ("single", "mixture"))
    return {
        "mixture_sources": n,
        "mixture_weights": [s.weight / sum(x.weight for x in specs) for s in specs],
        "mixture_single_tokens_per_s": round(single_rate),
        "mixture_tokens_per_s": round(mixture_rate),
        "mixture_vs_single": round(mixture_rate / single_rate, 3),
        "mixture_vs_single_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def _bench_parquet(
    files: list[str], tok_path: str, work: str, args: argparse.Namespace, text_bytes: int
) -> dict[str, float]:
    """Write the documents `prepare` just read (its first `text_bytes`) as one Parquet file,
    then time `prepare` on it: the same text and settings, another container."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .sources import iter_documents

    docs, size = [], 0
    for text in iter_documents(files, text_field=args.text_field):
        if size >= text_bytes:
            break
        docs.append(text)
        size += len(text.encode("utf-8"))
    path = os.path.join(work, "parquet", "corpus.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({args.text_field: docs}), path, row_group_size=64)
    m, dt = _timed_prepare([path], tok_path, os.path.join(work, "shards-parquet"), args)
    mb = m.stats["bytes"] / 1e6
    return {
        "parquet_prepare_s": round(dt, 2),
        "parquet_prepare_text_mb": round(mb, 2),
        "parquet_prepare_mb_per_s": round(mb / dt, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
