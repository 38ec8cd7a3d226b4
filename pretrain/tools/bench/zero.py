"""`grt bench zero`: short real `grt train` runs per ZeRO stage x compile x checkpointing x
preset (x ZeRO-3 core pinning and persistence), each as a ratio to the bare model step of
`grt bench train-step` (pretrain/tools/bench/train_step.py)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pretrain import PROJECT_ROOT
from pretrain.model import build_model
from pretrain.model_config import ModelConfig
from pretrain.runs.train_config import AUTO
from pretrain.tools.bench.support import make_bench_data, train_command
from pretrain.tools.bench.train_step import train_step_fn
from pretrain.training.engine.parallelize import modes_for_stage


def _bare_tokens_per_s(cfg: ModelConfig, args: argparse.Namespace, compiled: bool, checkpointing: str) -> float:
    """`train-step`'s measurement for one model: forward, backward and AdamW, no DeepSpeed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as `grt train` picks it
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    step = train_step_fn(model, cfg.max_loops if cfg.parsed_layout.looped else None, compiled, dtype, checkpointing)
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
            launch = ["deepspeed", "--num_gpus", str(ranks), "--no_local_rank", "--module"]
            settings = [f"model.max_seq_len={args.seq_len}", f"train.log_every={args.steps // 2}"]
            settings += ["train.eval_every=0", f"train.save_every={10 * args.steps}"]
            settings += [f"train.compile={str(compiled).lower()}", f"train.activation_checkpointing={ckpt}"]
            settings += [f"train.depth_sampling={args.depth_sampling}", f"train.zero3_pin_core={pin}"]
            cmd = [
                *(launch if ranks > 1 else [sys.executable, "-m"]),
                *train_command(preset, manifest, out, args.steps, args.micro_batch_size, ds, settings),
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
