"""Depth extrapolation: does loss hold past the trained R, and does a short phase of
log-uniform depth sampling (train.depth_sampling=loguniform, train.max_train_depth=D) keep it?

A micro GRT (1+1x3+1, d 32, R = 3) is trained in plain PyTorch on the demo shards with the
trainer's recipe (uniform depth 1..R), then continued for the same number of extra steps
twice: once with uniform 1..R (the control) and once with depth ~ log-uniform 1..D. Each
model's held-out loss is measured at depths 0..4R with `grt eval --allow-beyond-trained`.

    python docs/extrapolation/run.py --out docs/extrapolation      # ~10 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from trained_models import data, torch_trained_grt, write_export  # noqa: E402

from data_pipeline.loader import TokenBatchLoader  # noqa: E402
from pretrain.training.depth import sample_depth  # noqa: E402


def continue_training(model, manifest, steps: int, mode: str, max_depth: int, seed: int = 1):
    model = __import__("copy").deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    loader = TokenBatchLoader(str(manifest), split="train", micro_batch_size=16, seed=seed)
    for step, batch in enumerate(loader):
        if step >= steps:
            break
        r = sample_depth(mode, max_depth, seed, step)
        loss = model(batch["input_ids"], batch["targets"], n_loops=r).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def eval_curve(model, manifest, tok, out: Path, name: str, depths: str) -> dict:
    export = write_export(model, out / "models" / name, tokenizer=tok)
    js = out / f"{name}.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.cli",
            "eval",
            str(export),
            "--tasks",
            "val",
            "--data",
            str(manifest),
            "--depths",
            depths,
            "--allow-beyond-trained",
            "--max-batches",
            "16",
            "--json-out",
            str(js),
            "--quiet",
        ],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    return {int(r): v["loss"] for r, v in json.loads(js.read_text())["val"].items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/extrapolation")
    p.add_argument("--base-steps", type=int, default=400)
    p.add_argument("--extra-steps", type=int, default=200)
    p.add_argument("--max-depth", type=int, default=32, help="log-uniform phase: depths 1..D")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    base, manifest = torch_trained_grt(steps=args.base_steps)
    tok = Path(data()).parents[1] / "tok.model"
    R = base.cfg.max_loops
    depths = f"0-{4 * R}"
    curves = {
        "base": eval_curve(base, manifest, tok, out, "base", depths),
        "uniform": eval_curve(
            continue_training(base, manifest, args.extra_steps, "uniform", R), manifest, tok, out, "uniform", depths
        ),
        "loguniform": eval_curve(
            continue_training(base, manifest, args.extra_steps, "loguniform", args.max_depth),
            manifest,
            tok,
            out,
            "loguniform",
            depths,
        ),
    }
    (out / "curves.json").write_text(
        json.dumps(
            {
                "R": R,
                "base_steps": args.base_steps,
                "extra_steps": args.extra_steps,
                "max_depth": args.max_depth,
                "curves": curves,
            },
            indent=2,
        )
        + "\n"
    )
    names = list(curves)
    print("depth  " + "".join(f"{n:>12}" for n in names) + f"   (R = {R}; * beyond it)")
    for r in range(4 * R + 1):
        print(f"{r:>4}{'*' if r > R else ' '}  " + "".join(f"{curves[n][r]:>12.4f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
