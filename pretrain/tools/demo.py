"""`grt demo`: the main job on the bundled corpus, end to end on CPU.

tokenizer -> WebDataset shards -> tiny GRT trained with DeepSpeed ZeRO-3 (TensorBoard,
checkpoints) -> early-exit evaluation, compared with the data's unigram entropy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from grt_common.errors import ConfigError
from grt_common.files import output_path
from pretrain import PROJECT_ROOT
from pretrain.presets import get_preset
from pretrain.runs.checkpoint_files import check_run_output
from pretrain.runs.run_config import RunConfig

DEFAULT_TEXT = PROJECT_ROOT / "examples" / "data" / "tinyshakespeare.txt"


def unigram_entropy(manifest_path: str) -> float:
    """Entropy (nats/token) of the training tokens' unigram distribution: the loss of the
    best model that ignores context. A trained LM must get well below it."""
    from data_pipeline.loader import TokenBatchLoader

    counts: Counter[int] = Counter()
    for batch in TokenBatchLoader(manifest_path, split="train", micro_batch_size=64, shuffle_buffer=0, loop=False):
        counts.update(batch["targets"].flatten().tolist())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grt demo", description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="training text (default: bundled tinyshakespeare)")
    p.add_argument("--out", default="runs/demo", type=output_path(is_dir=True))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)

    from data_pipeline.cli import main as data_main

    out = Path(args.out)
    data = out / "data"
    if (out / "checkpoints").exists():
        print(f"grt demo: error: {out} already holds a run; remove it or pass --out", file=sys.stderr)
        return 2
    if not Path(args.text).is_file():
        print(f"grt demo: error: --text {args.text!r}: no such file", file=sys.stderr)
        return 2
    try:  # the run's rule for its folder, before minutes of work: its data of an earlier try is its own
        check_run_output(out, [str(data)])
    except ConfigError as err:
        print(f"grt demo: error: {err}", file=sys.stderr)
        return 2
    common = ["-i", args.text, "--txt-mode", "paragraph", "-q"]
    print(f"[1/4] training a SentencePiece BPE tokenizer (vocab {args.vocab_size}) on {args.text}")
    if data_main(["tokenizer", *common, "--vocab-size", str(args.vocab_size), "-o", str(data / "tokenizer")]):
        return 1
    print(f"[2/4] tokenising into WebDataset shards (seq_len {args.seq_len}, 5% of documents held out)")
    if data_main(
        [
            "prepare",
            *common,
            "-t",
            str(data / "tokenizer.model"),
            "-o",
            str(data / "shards"),
            "--seq-len",
            str(args.seq_len),
            "--shard-size-mb",
            "0.5",
            "--val-fraction",
            "0.05",
        ]
    ):
        return 1
    manifest = str(data / "shards" / "manifest.json")

    cfg = RunConfig(
        model=get_preset("tiny-grt").replace(max_seq_len=args.seq_len),
        data=manifest,
        ds_config=str(PROJECT_ROOT / "ds_configs" / "zero3.json"),
        out=str(out),
    )
    t = cfg.train
    t.steps, t.micro_batch_size, t.lr, t.min_lr = args.steps, 16, 2e-3, 2e-4
    t.warmup_steps, t.log_every, t.eval_every, t.eval_batches, t.save_every = 50, 25, 200, 10, 200
    print(
        f"[3/4] training {cfg.model.name} ({cfg.model.layout}, d={cfg.model.d_model}) for {t.steps} steps "
        f"with DeepSpeed ZeRO-3 on CPU; TensorBoard: tensorboard --logdir {out / 'tb'}"
    )
    from pretrain.training.trainer import train

    summary = train(cfg)
    print("[4/4] early-exit evaluation on the held-out documents")
    entropy = unigram_entropy(manifest)
    by_depth = summary["val_loss_by_depth"]
    loop = summary.get("loop") or {}
    gates = loop.get("gate_mean_by_step") or []
    lines = [
        "",
        "=" * 64,
        f"run directory      {out}",
        f"TensorBoard        tensorboard --logdir {out / 'tb'}",
        f"checkpoint         {summary['checkpoint']}",
        f"final train loss   {summary['final_loss']:.3f}",
        f"unigram entropy    {entropy:.3f} nats/token (a model that ignores context)",
        "validation loss by exit depth (0 = prelude straight to coda), mean gate of each loop step",
        "(1 keeps the state, 0 overwrites it with the core's output):",
        *(
            f"   depth {d:>2}: {v:.3f}" + (f"   gate {gates[d - 1]:.3f}" if 0 < d <= len(gates) else "")
            for d, v in by_depth.items()
        ),
        f"loop steps 2..R    {loop.get('gain_after_first') or 0.0:+.3f} nats from depth 1 to {max(by_depth)} "
        "(depth 0 is never trained): they "
        + ("add to the first step" if loop.get("used") else "add nothing (see the warning above)"),
        "=" * 64,
    ]
    print("\n".join(lines))
    (out / "demo_summary.json").write_text(json.dumps({**summary, "unigram_entropy": entropy}, indent=2) + "\n")
    full = by_depth[max(by_depth)]
    if not full < entropy - 0.5:
        print(f"grt demo: the validation loss {full:.3f} did not fall well below the unigram entropy {entropy:.3f}")
        return 1
    return 0
