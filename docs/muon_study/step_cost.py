"""The step-time cost of Muon's orthogonalisation at the study's scale (docs/performance.md): one
process, the real DeepSpeed engine (ZeRO-2, fp32 on CPU) of tiny-grt and of the dense model of equal
FLOPs (11 layers) at d 64, micro-batch 8 x 128 tokens, AdamW and Muon built side by side and
stepped in turn, so that both see the same machine load; the median of each part of the step.

    python docs/muon_study/step_cost.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pretrain.distributed import exit_process, init_distributed
from pretrain.presets import get_preset
from pretrain.runs.run_config import RunConfig
from pretrain.training.engine.build import build_engine

SEQ, BATCH = 128, 8


def engine_for(preset: str, optimizer: str, layers: int | None) -> tuple:
    cfg = RunConfig(data="unused", ds_config="ds_configs/zero2.json")
    model = get_preset(preset).replace(max_seq_len=SEQ, d_model=64, n_heads=2, vocab_size=2048)
    cfg.model = model.replace(layout=str(layers)) if layers else model
    cfg.train.micro_batch_size, cfg.train.activation_checkpointing = BATCH, "off"
    cfg.train.optimizer, cfg.train.grad_clip = optimizer, 0.0 if optimizer == "muon" else 1.0
    engine, _ = build_engine(cfg, 1, torch.device("cpu"), SEQ)
    return engine, cfg


def timed_step(engine, cfg) -> tuple[float, float]:
    """(forward + backward, optimizer step) seconds."""
    idx = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1))
    t0 = time.perf_counter()
    engine.backward(engine(idx[:, :-1], idx[:, 1:], return_logits=False).loss)
    t1 = time.perf_counter()
    engine.step()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    init_distributed(timeout_s=600)
    print("| model | optimizer | fwd+bwd s | optimizer step s | step s | Muon's extra per step |")
    print("|---|---|---|---|---|---|")
    for preset, layers in (("tiny-grt", None), ("tiny-dense", 11)):
        engines = {opt: engine_for(preset, opt, layers) for opt in ("adamw", "muon")}
        times: dict[str, list[tuple[float, float]]] = {opt: [] for opt in engines}
        for i in range(args.steps + 3):
            for opt, (engine, cfg) in engines.items():
                t = timed_step(engine, cfg)
                if i >= 3:  # the first steps (optimizer state, Muon's compile) are out
                    times[opt].append(t)
        med = {
            opt: (statistics.median(a for a, _ in ts), statistics.median(b for _, b in ts)) for opt, ts in times.items()
        }
        for opt, (fb, st) in med.items():
            extra = (sum(med["muon"]) / sum(med["adamw"]) - 1) * 100
            print(
                f"| {preset} | {opt} | {fb:.4f} | {st:.4f} | {fb + st:.4f} | "
                f"{f'{extra:+.0f}%' if opt == 'muon' else '-'} |"
            )
        for engine, _ in engines.values():
            engine.destroy()


if __name__ == "__main__":
    main()
    exit_process(0)
