"""`grt data ...`: train a tokenizer, prepare token shards, inspect/verify a manifest."""

from __future__ import annotations

import argparse
import json
import sys


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        "-i",
        action="append",
        required=True,
        metavar="PATH",
        help="input file, directory (recursive) or glob of .txt/.jsonl/.jsonl.gz/.jsonl.zst; repeatable",
    )
    p.add_argument(
        "--text-field", default="text", help="JSON field or Parquet column holding the document text (default: text)"
    )
    p.add_argument(
        "--txt-mode",
        choices=("file", "paragraph", "line"),
        default="file",
        help=".txt files: one document per file (default), per blank-line-separated paragraph, or per non-empty line",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for sampling / the validation split (default 0)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress display")


def _add_chains_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--out", "-o", required=True, help="output directory for the tokenizer, shards and manifest.json")
    c.add_argument("--train-samples", type=int, default=20000, help="training samples (default 20000)")
    c.add_argument("--val-samples", type=int, default=2000, help="validation samples (default 2000)")
    c.add_argument("--min-hops", type=int, default=1, help="fewest lookups a chain needs (default 1)")
    c.add_argument("--max-hops", type=int, default=4, help="most lookups a chain needs (default 4)")
    c.add_argument("--val-max-hops", type=int, default=None, help="validation: most lookups (default --max-hops)")
    c.add_argument("--chains-per-sample", type=int, default=4, help="chains a sample (default 4)")
    c.add_argument("--num-vars", type=int, default=32, help="variable names v0.. (default 32)")
    c.add_argument("--num-values", type=int, default=10, help="values 0.. (default 10)")
    c.add_argument(
        "--queries",
        choices=("last", "all"),
        default="last",
        help="last: one query per chain, its last variable (k lookups; default); all: one per variable (1..k)",
    )
    c.add_argument(
        "--queries-per-sample",
        type=int,
        default=0,
        help="ask only this many queries a sample, drawn at random (default 0: all; 1 leaves no answer "
        "to find by elimination)",
    )
    c.add_argument(
        "--order",
        choices=("shuffled", "by-name"),
        default="shuffled",
        help="shuffled: statements in random order (default); by-name: every variable defined, in name order "
        "(a lookup reads a fixed position; chains still point forward)",
    )
    c.add_argument(
        "--compact",
        action="store_true",
        help="a key just before its value: 'vA 7 ;', 'vB vA ;', queries '? vB 7 ;' (values are letters A..)",
    )
    c.add_argument(
        "--loss-on",
        choices=("all", "answers"),
        default="all",
        help="all: every token is a training target (default); answers: each sample carries a loss mask that "
        "scores its answers only (validation loss too), what the task learns from at CPU scale",
    )
    c.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the longest sample)")
    c.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    c.add_argument("--quiet", "-q", action="store_true", help="no summary line")
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an output of something else in --out (once the new one is complete)",
    )


def _chains(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from .chains import ChainTask
    from .chains_write import write_chains

    task = ChainTask(
        args.num_vars,
        args.num_values,
        args.min_hops,
        args.max_hops,
        args.chains_per_sample,
        args.seed,
        args.queries,
        args.queries_per_sample,
        args.order,
        args.compact,
    )
    val_task = replace(task, max_hops=args.max_hops if args.val_max_hops is None else args.val_max_hops)
    write_chains(
        args.out,
        task,
        args.train_samples,
        args.val_samples,
        args.seq_len,
        val_task,
        progress=not args.quiet,
        loss_on=args.loss_on,
        overwrite=args.overwrite,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grt data", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tokenizer", help="train a SentencePiece BPE tokenizer on a sample of the input")
    _add_input_args(t)
    t.add_argument("--out", "-o", required=True, help="output model file (.model appended if missing)")
    t.add_argument("--vocab-size", type=int, default=32000, help="vocabulary size, at most 50257 (default 32000)")
    t.add_argument(
        "--max-chars", type=int, default=20_000_000, help="characters sampled from the input to train on (default 20M)"
    )
    t.add_argument("--sep-piece", default="<|endoftext|>", help="document separator piece (default <|endoftext|>)")
    t.add_argument("--character-coverage", type=float, default=0.9995)
    t.add_argument("--workers", type=int, default=None, help="training threads (default: CPU count)")

    p = sub.add_parser("prepare", help="tokenise the input into WebDataset shards + manifest.json")
    _add_input_args(p)
    p.add_argument("--tokenizer", "-t", required=True, help="SentencePiece .model (copied next to the shards)")
    p.add_argument("--out", "-o", required=True, help="output directory for shards and manifest.json")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per training sequence (default 1024)")
    p.add_argument("--shard-size-mb", type=float, default=64.0, help="target shard size in MB (default 64)")
    p.add_argument("--workers", type=int, default=None, help="tokeniser processes (default: CPU count)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="fraction of documents (by seeded content hash) for the val split (default 0)",
    )
    p.add_argument(
        "--val-input",
        action="append",
        default=[],
        metavar="PATH",
        help="inputs that go entirely to the val split; repeatable",
    )
    p.add_argument("--max-mb", type=float, default=None, help="stop after this many MB of document text")
    p.add_argument(
        "--part",
        default=None,
        metavar="I/N|slurm",
        help="prepare part I of N of the input files into OUT/part-I-of-N (slurm: this job array task's); "
        "`grt data join OUT` then writes the manifest",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output of another prepare (other inputs or options; refused without it)",
    )

    j = sub.add_parser("join", help="join the parts of a `prepare --part` run into one manifest.json")
    j.add_argument("out", help="the --out folder of the parts")
    j.add_argument("--parts", type=int, default=None, help="how many parts (default: from the part folders)")
    j.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing manifest.json that describes other shards (refused without it)",
    )

    c = sub.add_parser("chains", help="write the chains task (answers need k lookups) as shards + manifest.json")
    _add_chains_args(c)

    s = sub.add_parser("inspect", help="print a manifest's summary; --verify checks every shard")
    s.add_argument("manifest", help="manifest.json or the directory holding it")
    s.add_argument("--verify", action="store_true", help="read every shard and check sha256, counts and tokens")
    s.add_argument("--decode", type=int, default=0, metavar="N", help="print the first N tokens of train sample 0")
    return parser


def _inspect(args: argparse.Namespace) -> int:
    import hashlib

    from .manifest import Manifest
    from .shards import ShardError, iter_shard, open_stream

    m = Manifest.load(args.manifest)
    print(f"manifest {m.path}")
    print(f"  seq_len {m.seq_len}, dtype {m.ext}, vocab {m.vocab_size}, sep id {m.sep_id} ({m.sep_piece!r})")
    print(f"  tokenizer {m.tokenizer_path} sha256 {m.tokenizer_sha256}")
    if m.masked:
        print(f"  loss masks ({m.loss_mask}): each sample's trained targets are its mask's")
    for split, shards in m.splits.items():
        print(
            f"  {split}: {len(shards)} shards, {sum(s.sequences for s in shards):,} sequences, "
            f"{sum(s.tokens for s in shards):,} tokens, fingerprint {m.fingerprint(split)}"
        )
    if m.stats:
        print("  stats " + json.dumps({k: v for k, v in m.stats.items() if not isinstance(v, dict)}))
    bad = 0
    if args.verify:
        for shards in m.splits.values():
            for s in shards:
                try:
                    samples = iter_shard(
                        s.url, s.sequences, m.seq_len + 1, m.ext, vocab_size=m.vocab_size, masked=m.masked
                    )
                    n = sum(1 for _ in samples)
                    if s.sha256:
                        h = hashlib.sha256()
                        with open_stream(s.url) as fh:
                            for block in iter(lambda: fh.read(1 << 20), b""):
                                h.update(block)
                        if h.hexdigest() != s.sha256:
                            raise ShardError(s.url, f"sha256 {h.hexdigest()} != manifest {s.sha256}")
                    print(f"  ok   {s.name} ({n} sequences)")
                except ShardError as exc:
                    bad += 1
                    print(f"  BAD  {exc}")
        print(f"verify: {bad} bad shard(s)")
    if args.decode:
        import numpy as np

        from .shards import DTYPES
        from .tokenizer import Tokenizer

        split = "train" if "train" in m.splits else next(iter(m.splits))
        s = m.splits[split][0]
        _, data = next(iter_shard(s.url, s.sequences, m.seq_len + 1, m.ext))
        ids = np.frombuffer(data, DTYPES[m.ext])[: args.decode].tolist()
        print(repr(Tokenizer(m.tokenizer_path).decode(ids)))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.cmd == "tokenizer":
            from .tokenizer import train_tokenizer

            train_tokenizer(
                args.input,
                args.out,
                vocab_size=args.vocab_size,
                text_field=args.text_field,
                txt_mode=args.txt_mode,
                max_chars=args.max_chars,
                sep_piece=args.sep_piece,
                seed=args.seed,
                num_threads=args.workers,
                character_coverage=args.character_coverage,
                progress=not args.quiet,
            )
            return 0
        if args.cmd == "prepare":
            from .parts import parse_part
            from .prepare import prepare

            prepare(
                args.input,
                args.tokenizer,
                args.out,
                seq_len=args.seq_len,
                shard_size_mb=args.shard_size_mb,
                workers=args.workers,
                val_fraction=args.val_fraction,
                val_inputs=args.val_input,
                seed=args.seed,
                text_field=args.text_field,
                txt_mode=args.txt_mode,
                max_mb=args.max_mb,
                progress=not args.quiet,
                part=None if args.part is None else parse_part(args.part),
                overwrite=args.overwrite,
            )
            return 0
        if args.cmd == "join":
            from .parts import join

            m = join(args.out, args.parts, overwrite=args.overwrite)
            print(f"join: {m.path}: " + ", ".join(f"{s}: {len(v)} shards" for s, v in m.splits.items()))
            return 0
        if args.cmd == "chains":
            _chains(args)
            return 0
        if args.cmd == "inspect":
            return _inspect(args)
    except (OSError, ValueError) as exc:  # OSError: a file that vanished, a full disk, no permission
        from grt_common.errors import file_system_problem  # the one line of every command's boundary

        print(f"grt data {args.cmd}: error: {file_system_problem(exc) or exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
