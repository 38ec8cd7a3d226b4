"""`grt bench save`: the stall per checkpoint save, synchronous against train.async_save.

A real DeepSpeed engine (one rank, the given ZeRO stage and preset) trains a few steps; then, per
mode, it saves `--saves` times through store.py as the trainer does (every file, the COMPLETE
marker), timing what each save costs the training thread: the whole write (sync), or the host
copies before training goes on (async), and for async the steps trained while the files are
written, against steps without a save, and the time until the checkpoint is complete.

    grt bench save --preset grt-small --stage 2 --saves 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pretrain.tools.bench.support import whole_number


def _engine(preset: str, stage: int, seq_len: int, batch: int) -> tuple[Any, Any]:
    from pretrain.presets import get_preset
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.engine.build import build_engine

    cfg = RunConfig(data="unused", ds_config=f"ds_configs/zero{stage}.json")
    cfg.model = get_preset(preset).replace(max_seq_len=seq_len)
    cfg.train.micro_batch_size, cfg.train.activation_checkpointing = batch, "off"
    engine, _ = build_engine(cfg, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"), seq_len)
    return engine, cfg


def _step(engine: Any, cfg: Any, batch: int, seq_len: int) -> float:
    t0 = time.perf_counter()
    idx = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), device=engine.device)
    engine.backward(engine(idx[:, :-1], idx[:, 1:], return_logits=False).loss)
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_save(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pretrain.distributed import init_distributed
    from pretrain.training.checkpoint import store

    init_distributed(timeout_s=600)
    engine, cfg = _engine(args.preset, args.stage, args.seq_len, args.batch)
    for _ in range(2):  # the optimizer state exists, the first steps' costs are out
        _step(engine, cfg, args.batch, args.seq_len)
    plain = statistics.median(_step(engine, cfg, args.batch, args.seq_len) for _ in range(args.steps))
    how: dict[str, Any] = {"config_json": "{}", "tokenizer_path": None, "loader_state": {}, "keep": 1, "rank": 0}
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root, step = Path(tmp), 0
        for mode in ("sync", "async"):
            stalls, completes, during = [], [], []
            for _ in range(args.saves):
                step += 1
                t0 = time.perf_counter()
                if mode == "sync":
                    store.save(engine, root, step, **how)
                    stalls.append(time.perf_counter() - t0)
                    continue
                pending = store.start_save(engine, root, step, **how)
                stalls.append(time.perf_counter() - t0)
                while pending.writes is not None and not pending.writes.done():
                    during.append(_step(engine, cfg, args.batch, args.seq_len))
                store.finish_save(pending, root, 0)
                completes.append(time.perf_counter() - t0)
            size = sum(f.stat().st_size for f in (root / store.tag_for(step)).iterdir())
            rows.append(
                {
                    "mode": mode,
                    "preset": args.preset,
                    "zero": args.stage,
                    "checkpoint_MB": size / 2**20,
                    "stall_s": statistics.median(stalls),
                    "complete_after_s": statistics.median(completes) if completes else statistics.median(stalls),
                    "step_s": plain,
                    "step_s_while_writing": statistics.median(during) if during else float("nan"),
                    "steps_while_writing": len(during) / args.saves,
                }
            )
    engine.destroy()
    return rows


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="grt bench save", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="grt-small")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--saves", type=whole_number(1), default=3)
    p.add_argument("--steps", type=whole_number(1), default=3, help="steps timed without a save")
    p.add_argument("--seq-len", type=whole_number(1), default=128)
    p.add_argument("--batch", type=whole_number(1), default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (a temporary folder in it; default: /tmp)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    args = p.parse_args(argv)
    rows = bench_save(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"# reproduce: grt bench save {' '.join(argv)}")
    print(" | ".join(rows[0]))
    for row in rows:
        print(" | ".join(f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    return 0
