"""`grt bench`: benchmarks that print their figures (and the command that reproduces them).

    grt bench data        data pipeline: prepare MB/s, loader tokens/s (data_pipeline.bench)
    grt bench train-step  GRT vs the dense model of equal FLOPs: tokens/s, peak memory, ratio
    grt bench memory      peak memory against R, per-loop-step checkpointing on and off
                          (these two: pretrain.tools.bench.train_step)
    grt bench zero        `grt train` tokens/s, MFU and peak memory per ZeRO stage x compile x
                          checkpointing x preset (x ZeRO-3 persistence), as ratios to the bare
                          model step of train-step (real DeepSpeed; pretrain.tools.bench.zero)
    grt bench decode      decode latency and memory per KV-cache strategy (pretrain.tools.bench.decode)
    grt bench precision   the loop state under bf16, and bf16 training's losses (pretrain.tools.bench.numerics)
    grt bench loss        time and peak memory of the training loss at GPT-2's vocabulary: the plain
                          loss, the chunked loss before and after padding, compiled (pretrain.tools.bench.numerics)
    grt bench budget      a step's time on one GPU by part, predicted from the model's FLOPs and bytes,
                          before and after issue 47 (pretrain.tools.bench.budget)
    grt bench save        the stall per checkpoint save, synchronous against train.async_save
                          (pretrain.tools.bench.save)

On CPU the absolute figures are this machine's; the ratios are what carry over.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from grt_common.errors import ConfigError
from pretrain.runs.train_config import AUTO, CHECKPOINT_MODES
from pretrain.tools.bench.support import GPT2_VOCAB, positive_number, whole_number
from pretrain.tools.bench.train_step import bench_memory, bench_train_step, memory_probe
from pretrain.tools.bench.zero import bench_zero


def _threshold(text: str) -> str:
    if text != "trainer" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of elements or `trainer`")
    return text


def _on_off(text: str) -> bool:
    if text not in ("off", "on"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected off or on")
    return text == "on"


def main(argv: Sequence[str] | None = None) -> int:
    """Every `grt bench` command: one that cannot run (an unknown preset, a size the model or the
    tokenizer refuses, a data step that fails) ends in one line naming why, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except ConfigError as err:
        print(f"grt bench: error: {err}", file=sys.stderr)
    except subprocess.CalledProcessError as err:  # a step the benchmark runs (its data, a probe): its last line
        output = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr or ""
        why = output.strip().splitlines()[-1:] or [f"{shlex.join(map(str, err.cmd))} exited {err.returncode}"]
        print(f"grt bench: error: {why[0]}", file=sys.stderr)
    return 2


# the subcommands other modules parse: name -> (module, what it measures)
DELEGATED = {
    "data": ("data_pipeline.bench", "data pipeline: prepare MB/s, loader tokens/s"),
    "decode": ("pretrain.tools.bench.decode", "decode latency and memory per KV-cache strategy"),
    "precision": ("pretrain.tools.bench.numerics", "the loop state under bf16, and bf16 training's losses"),
    "loss": ("pretrain.tools.bench.numerics", "time and peak memory of the training loss, per implementation"),
    "budget": ("pretrain.tools.bench.budget", "a step's time on one GPU by part, predicted, before and after"),
    "save": ("pretrain.tools.bench.save", "the stall per checkpoint save, synchronous against train.async_save"),
}
SUBCOMMANDS = ("data", "train-step", "memory", "zero", "decode", "precision", "loss", "save", "budget")


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "_memory_probe":
        memory_probe(argv[1:])
        return 0
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv if module.__name__ == "pretrain.tools.bench.numerics" else argv[1:]))
    args = build_parser().parse_args(argv)
    benches: dict[str, Callable[[argparse.Namespace], dict[str, Any] | list[dict[str, Any]]]] = {
        "train-step": bench_train_step,
        "memory": bench_memory,
        "zero": bench_zero,
    }
    result = benches[args.what](args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"# reproduce: grt bench {' '.join(argv)}")
    if isinstance(result, dict):
        for key, value in result.items():
            print(f"{key:<32} {value:,.3f}" if isinstance(value, float) else f"{key:<32} {value}")
    else:
        keys = list(result[0])
        print(" | ".join(keys))
        for row in result:
            print(" | ".join(_cell(k, row[k]) for k in keys))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`grt bench`'s own subcommands (train-step, memory, zero); the others listed, parsed by their modules."""
    p = argparse.ArgumentParser(
        prog="grt bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="what", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (_, what) in DELEGATED.items():  # parsed by their own modules (dispatched above): listed here
        sub.add_parser(name, help=what, add_help=False)
    for add in (_train_step_flags, _memory_flags, _zero_flags):
        add(sub).add_argument("--json", action="store_true", help="print machine-readable JSON only")
    return p


def _train_step_flags(sub: Any) -> argparse.ArgumentParser:
    ts = sub.add_parser("train-step", help="GRT vs dense of equal FLOPs")
    ts.add_argument("--layout", default="1+2x4+1")
    ts.add_argument("--d-model", type=whole_number(1), default=256)
    ts.add_argument("--n-heads", type=whole_number(1), default=4)
    ts.add_argument("--seq-len", type=whole_number(1), default=256)
    ts.add_argument("--batch", type=whole_number(1), default=8)
    ts.add_argument("--vocab", type=whole_number(1), default=2048)
    ts.add_argument("--steps", type=whole_number(1), default=8)
    ts.add_argument("--warmup", type=whole_number(0), default=2)
    ts.add_argument("--checkpointing", default="off", choices=CHECKPOINT_MODES)
    ts.add_argument("--compile", action="store_true", help="also time torch.compile'd models")
    ts.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="bf16: the weights cast to bf16 as `grt train` runs them (the loop state stays fp32)",
    )
    ts.add_argument("--peak-tflops", type=positive_number, default=0.0, help="device peak for MFU (default: looked up)")
    return ts


def _memory_flags(sub: Any) -> argparse.ArgumentParser:
    mem = sub.add_parser("memory", help="peak memory against R")
    mem.add_argument("--loops", type=whole_number(1), nargs="+", default=[1, 4, 8])
    mem.add_argument("--d-model", type=whole_number(4), default=256, help="a multiple of its 4 heads")
    mem.add_argument("--seq-len", type=whole_number(1), default=512)
    mem.add_argument("--batch", type=whole_number(1), default=8)
    return mem


def _zero_flags(sub: Any) -> argparse.ArgumentParser:
    zr = sub.add_parser(
        "zero", help="`grt train` per ZeRO stage x compile x checkpointing x preset, against the bare step"
    )
    zr.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[0, 1, 2, 3])
    zr.add_argument("--ranks", type=whole_number(1), nargs="+", default=[1])
    zr.add_argument("--presets", nargs="+", default=["tiny-grt", "tiny-dense"])
    zr.add_argument("--compile", type=_on_off, nargs="+", default=[False, True], metavar="off|on")
    zr.add_argument(
        "--checkpointing",
        nargs="+",
        default=["off", "loop_step"],
        choices=[AUTO, *CHECKPOINT_MODES],
        help="auto: the row shows the mode `grt train` chose (auto:MODE)",
    )
    zr.add_argument("--depth-sampling", default="fixed", choices=["fixed", "uniform", "poisson"])
    zr.add_argument(
        "--pin-core",
        type=_on_off,
        nargs="+",
        default=[True],
        metavar="off|on",
        help="ZeRO-3: keep the looped core gathered (train.zero3_pin_core); `on off` compares both",
    )
    zr.add_argument("--steps", type=whole_number(2), default=20, help="at least 2: a log at half of them")
    zr.add_argument("--seq-len", type=whole_number(1), default=128)
    zr.add_argument("--micro-batch-size", type=whole_number(1), default=8)
    zr.add_argument(
        "--vocab",
        type=whole_number(1),
        default=GPT2_VOCAB,
        help="the tokenizer's vocabulary: 50257 (default) tokenizes with the shipped GPT-2-sized one, "
        "any other size trains one on the bundled text",
    )
    zr.add_argument(
        "--persistence-threshold",
        nargs="+",
        default=["1000"],
        type=_threshold,
        help="ZeRO-3 stage3_param_persistence_threshold, one row each: a number, or `trainer` for "
        "the shipped zero3.json's (every parameter on one rank, DeepSpeed's 1e5 otherwise); "
        "`trainer 100000` A/Bs it. The default 1000 makes a tiny model's matrices sharded, as "
        "a GPT-2-sized model's are",
    )
    return zr


def _cell(key: str, value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.3f}" if key.startswith(("ratio", "mfu")) else f"{value:,.1f}"


if __name__ == "__main__":
    sys.exit(main())
