"""`grt bench`: benchmarks that print their figures (and the command that reproduces them).

    grt bench data        data pipeline: prepare MB/s, loader tokens/s (data_pipeline.bench)
    grt bench train-step  GRT vs the dense model of equal FLOPs: tokens/s, peak memory, ratio
    grt bench memory      peak memory against R, per-loop-step checkpointing on and off
    grt bench zero        `grt train` tokens/s, MFU and peak memory per ZeRO stage x compile x
                          checkpointing x preset (x ZeRO-3 persistence), as ratios to the bare
                          model step of train-step (real DeepSpeed)
    grt bench decode      decode latency and memory per KV-cache strategy (pretrain.tools.bench_decode)
    grt bench precision   the loop state under bf16, and bf16 training's losses (pretrain.tools.bench_numerics)
    grt bench loss        time and peak memory of the training loss at GPT-2's vocabulary: the plain
                          loss, the chunked loss before and after padding, compiled (pretrain.tools.bench_numerics)

On CPU the absolute figures are this machine's; the ratios are what carry over.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pretrain import PROJECT_ROOT
from pretrain.config import ConfigError, ModelConfig
from pretrain.model import GPT, build_model
from pretrain.model.flops import flops_per_token
from pretrain.runs.run_config import AUTO, CHECKPOINT_MODES
from pretrain.tools.bench_support import (
    GPT2_VOCAB,
    make_bench_data,
    peak_bytes,
    positive_number,
    whole_number,
)
from pretrain.training.metrics import peak_flops
from pretrain.training.parallelize import (
    apply_activation_checkpointing,
    checkpoint_and_compile,
    modes_for_stage,
)


def equal_flops_pair(
    d_model: int, n_heads: int, layout: str, seq_len: int, vocab: int
) -> tuple[ModelConfig, ModelConfig]:
    """A GRT and the dense model of the same width and effective depth (equal FLOPs up to
    the loop's small projection and gate)."""
    common: dict[str, Any] = dict(d_model=d_model, n_heads=n_heads, vocab_size=vocab, max_seq_len=seq_len, bias=False)
    grt = ModelConfig(name="grt", variant="grt", layout=layout, **common)
    dense = ModelConfig(name="dense", variant="dense", layout=str(grt.parsed_layout.effective_depth()), **common)
    return grt, dense


def _step_fn(
    model: GPT, n_loops: int | None, compiled: bool, dtype: torch.dtype, checkpointing: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One optimizer step computed as `grt train` computes it: the weights in the training dtype
    (DeepSpeed's bf16 mode casts the model; the GRT's loop state stays fp32, ModelConfig.state_dtype),
    checkpointing and compilation as the trainer applies them (`checkpoint_and_compile`), the loss
    without logits.
    DeepSpeed's optimizer also keeps fp32 master weights; this AdamW steps the weights as they are."""
    checkpoint_and_compile(model.to(dtype), checkpointing, compiled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available() or None)

    def step(idx: torch.Tensor) -> torch.Tensor:
        loss = model(idx, idx, n_loops=n_loops, return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def bench_train_step(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grt_cfg, dense_cfg = equal_flops_pair(args.d_model, args.n_heads, args.layout, args.seq_len, args.vocab)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    peak, peak_note = peak_flops(device, args.peak_tflops)
    results: dict[str, Any] = {"peak_flops_note": peak_note}
    for compiled in [False, True] if args.compile else [False]:
        steps: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        for name, cfg in (("grt", grt_cfg), ("dense", dense_cfg)):
            torch.manual_seed(0)
            model = build_model(cfg).to(device).train()
            steps[name] = _step_fn(
                model, cfg.max_loops if cfg.parsed_layout.looped else None, compiled, dtype, args.checkpointing
            )
            for _ in range(args.warmup):
                steps[name](idx)
        times = {name: 0.0 for name in steps}
        for _ in range(args.steps):  # interleaved, so machine noise hits both alike
            for name, step in steps.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(idx)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name] += time.perf_counter() - t0
        tag = "compiled" if compiled else "eager"
        tokens = args.steps * idx.numel()
        for name, cfg in (("grt", grt_cfg), ("dense", dense_cfg)):
            fpt = flops_per_token(cfg, args.seq_len, executed=True)
            results[f"{name}_{tag}_tokens_per_s"] = tokens / times[name]
            results[f"{name}_{tag}_mfu"] = 3 * fpt * tokens / times[name] / peak
            results[f"{name}_flops_per_token"] = fpt
        # at equal FLOPs per token: the dense model's tokens/s rescaled to the GRT's FLOPs
        results[f"ratio_{tag}"] = results[f"grt_{tag}_mfu"] / results[f"dense_{tag}_mfu"]
        results[f"raw_tokens_ratio_{tag}"] = results[f"grt_{tag}_tokens_per_s"] / results[f"dense_{tag}_tokens_per_s"]
    results["grt_tokens_per_s"] = results["grt_eager_tokens_per_s"]
    results["dense_tokens_per_s"] = results["dense_eager_tokens_per_s"]
    results["ratio"] = results["ratio_eager"]
    results["peak_bytes"] = peak_bytes(device)
    results.update(
        layout=args.layout,
        dense_layout=dense_cfg.layout,
        d_model=args.d_model,
        seq_len=args.seq_len,
        batch=args.batch,
        device=str(device),
        checkpointing=args.checkpointing,
    )
    return results


def memory_probe(argv: list[str]) -> None:
    """One training step in a fresh process; prints the peak memory above the baseline."""
    d_model, seq_len, batch, loops, mode = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(layout=f"1+2x{loops}+1", d_model=d_model, n_heads=4, vocab_size=512, max_seq_len=seq_len)
    model = apply_activation_checkpointing(build_model(cfg).to(device).train(), mode)
    idx = torch.randint(0, 512, (batch, seq_len), device=device)
    base = peak_bytes(device)
    model(idx, idx).loss.backward()
    print(json.dumps({"peak_bytes": peak_bytes(device) - base}))


def bench_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for loops in args.loops:
        for mode in ("off", "loop_step"):
            # On CPU the peak is the process's peak RSS. glibc keeps freed chunks mapped and
            # fragments, which inflates RSS with every alloc/free cycle; serving large tensors
            # from mmap (returned to the OS on free) makes RSS follow the live tensors.
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pretrain.tools.bench",
                    "_memory_probe",
                    str(args.d_model),
                    str(args.seq_len),
                    str(args.batch),
                    str(loops),
                    mode,
                ],
                capture_output=True,
                text=True,
                check=True,
                cwd=PROJECT_ROOT,
                env=env,
            )
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
            rows.append({"R": loops, "checkpointing": mode != "off", "peak_bytes": peak})
    return rows


def _bare_tokens_per_s(cfg: ModelConfig, args: argparse.Namespace, compiled: bool, checkpointing: str) -> float:
    """`train-step`'s measurement for one model: forward, backward and AdamW, no DeepSpeed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as `grt train` picks it
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    step = _step_fn(model, cfg.max_loops if cfg.parsed_layout.looped else None, compiled, dtype, checkpointing)
    idx = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq_len), device=device)
    for _ in range(2):
        step(idx)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(idx)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return args.steps * idx.numel() / (time.perf_counter() - t0)


def bench_zero(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Short real `grt train` runs, one row per ranks x preset x ZeRO stage x compile x
    checkpointing (x core pinning and persistence threshold under ZeRO-3), each with its ratio
    to the bare model step (`_bare_tokens_per_s`: the same model, micro-batch, depth, compile
    and checkpointing, without DeepSpeed or the loader).
    Depth sampling is `fixed` by default so that both do the same work per step."""
    from itertools import product

    from pretrain.presets import get_preset

    for preset in args.presets:  # at the door: an unknown preset or a size it refuses, before any data is made
        get_preset(preset).replace(max_seq_len=args.seq_len, vocab_size=args.vocab)
    rows: list[dict[str, Any]] = []
    bare: dict[tuple[str, bool, str], float] = {}  # (preset, compiled, checkpointing) -> tokens/s
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        manifest = make_bench_data(tmp, args.seq_len, args.vocab)
        for ranks, preset, stage, compiled, ckpt, pin, persist in product(
            args.ranks,
            args.presets,
            args.stages,
            args.compile,
            args.checkpointing,
            args.pin_core,
            args.persistence_threshold,
        ):
            if stage != 3 and (pin, persist) != (args.pin_core[0], args.persistence_threshold[0]):
                continue  # pinning and persistence only exist under ZeRO-3
            if ckpt != AUTO and ckpt not in modes_for_stage(stage):
                continue  # refused by `grt train` (selective under ZeRO-3)
            cfg = get_preset(preset).replace(max_seq_len=args.seq_len, vocab_size=args.vocab)
            ds = tmp / f"zero{stage}-{persist}.json"
            base = json.loads((PROJECT_ROOT / "ds_configs" / f"zero{max(stage, 1)}.json").read_text())
            if stage == 0:
                base["zero_optimization"] = {"stage": 0}
            if stage == 3 and persist != "trainer":
                base["zero_optimization"]["stage3_param_persistence_threshold"] = int(persist)
            ds.write_text(json.dumps(base))
            out = tmp / f"run-{ranks}-{preset}-{stage}-{compiled}-{ckpt}-{pin}-{persist}"
            cmd = [
                *(
                    ["deepspeed", "--num_gpus", str(ranks), "--no_local_rank", "--module"]
                    if ranks > 1
                    else [sys.executable, "-m"]
                ),
                "pretrain.cli",
                "train",
                "--preset",
                preset,
                "--data",
                str(manifest),
                "--out",
                str(out),
                "--steps",
                str(args.steps),
                "--micro-batch-size",
                str(args.micro_batch_size),
                "--ds-config",
                str(ds),
                "--set",
                f"model.max_seq_len={args.seq_len}",
                "--set",
                f"train.log_every={args.steps // 2}",
                "--set",
                "train.eval_every=0",
                "--set",
                f"train.save_every={10 * args.steps}",
                "--set",
                f"train.compile={str(compiled).lower()}",
                "--set",
                f"train.activation_checkpointing={ckpt}",
                "--set",
                f"train.depth_sampling={args.depth_sampling}",
                "--set",
                f"train.zero3_pin_core={pin}",
            ]
            proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            tokens_per_s = _last_scalar(out / "tb", "perf/tokens_per_s") / ranks  # per rank, as the bare step
            if ckpt == AUTO:  # the mode `grt train` chose, for the bare step to match
                chosen = re.search(r"activation checkpointing auto -> (\w+)", (out / "train.log").read_text())
                assert chosen is not None, f"{out / 'train.log'} does not name the mode auto chose"
                ckpt = AUTO + ":" + chosen.group(1)
            mode = ckpt.rpartition(":")[2]
            if (preset, compiled, mode) not in bare:
                bare[(preset, compiled, mode)] = _bare_tokens_per_s(cfg, args, compiled, mode)
                if torch.cuda.is_available():  # the next `grt train` (its `auto`) must see the memory free
                    torch.cuda.empty_cache()
            rows.append(
                {
                    "ranks": ranks,
                    "preset": preset,
                    "zero_stage": stage,
                    "compile": compiled,
                    "checkpointing": ckpt,
                    "core_pinned": pin if stage == 3 else None,
                    "persistence": persist if stage == 3 else None,
                    "tokens_per_s_per_rank": tokens_per_s,
                    "bare_tokens_per_s": bare[(preset, compiled, mode)],
                    "ratio_to_bare": tokens_per_s / bare[(preset, compiled, mode)],
                    "mfu": _last_scalar(out / "tb", "perf/mfu"),
                    "peak_mb": _last_scalar(out / "tb", "memory/peak_bytes") / 2**20,
                    "param_gathers_per_step": _last_scalar(out / "tb", "zero3/param_gathers") / args.steps
                    if stage == 3
                    else 0.0,
                    "trace_invalidations": _last_scalar(out / "tb", "zero3/trace_invalidations"),
                }
            )
    return rows


def _last_scalar(tb_dir: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return events.Scalars(tag)[-1].value


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
    "decode": ("pretrain.tools.bench_decode", "decode latency and memory per KV-cache strategy"),
    "precision": ("pretrain.tools.bench_numerics", "the loop state under bf16, and bf16 training's losses"),
    "loss": ("pretrain.tools.bench_numerics", "time and peak memory of the training loss, per implementation"),
}
SUBCOMMANDS = ("data", "train-step", "memory", "zero", "decode", "precision", "loss")


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "_memory_probe":
        memory_probe(argv[1:])
        return 0
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv if module.__name__ == "pretrain.tools.bench_numerics" else argv[1:]))
    p = argparse.ArgumentParser(
        prog="grt bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="what", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (_, what) in DELEGATED.items():  # parsed by their own modules (dispatched above): listed here
        sub.add_parser(name, help=what, add_help=False)
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
    mem = sub.add_parser("memory", help="peak memory against R")
    mem.add_argument("--loops", type=whole_number(1), nargs="+", default=[1, 4, 8])
    mem.add_argument("--d-model", type=whole_number(4), default=256, help="a multiple of its 4 heads")
    mem.add_argument("--seq-len", type=whole_number(1), default=512)
    mem.add_argument("--batch", type=whole_number(1), default=8)
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
    for sp in (ts, mem, zr):
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    args = p.parse_args(argv)
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


def _cell(key: str, value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.3f}" if key.startswith(("ratio", "mfu")) else f"{value:,.1f}"


if __name__ == "__main__":
    sys.exit(main())
