"""Tiny trained models shared by the export/eval/generate/analyze tests.

Each is trained once per test session (a subprocess `grt train`, ZeRO-3, one process,
CPU) in a temporary directory, from a tokenizer and shards built from the demo text.
Import the fixtures into a test module: `from trained_models import grt_run, dense_run`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import data_commands, manifest_of, train_command
from shared_artifacts import made_once

REPO = Path(__file__).resolve().parents[1]
DEMO_TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"
EVAL_BATCHES = 4  # validation batches (of 8) the training run evaluates at its end
# one thread: on a busy 2-core machine two OpenMP threads per process spin against each other
# (measured: 3.6 s vs 0.09 s per micro-grt training step)
ENV = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def grt(*args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"grt {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@functools.cache
def data() -> Path:
    """Tokenizer (vocab 512) and shards (seq 64, 5% validation) from the demo text."""

    def make(root: Path) -> None:
        root.mkdir()
        for args in data_commands(DEMO_TEXT, root, 512, 0.2):
            grt(*args)

    return manifest_of(made_once("eval-data", make))


@functools.cache
def train(preset: str, steps: int, lr: float = 3e-3, eval_batches: int = EVAL_BATCHES) -> Path:
    """`preset` trained `steps` steps on `data()`: made once per test run, shared by its workers (read
    it, do not write into it)."""

    def make(out: Path) -> None:
        # the warmup as the schedule runs it (at most the run: a longer explicit one is refused, settings_rules.py)
        sets = [f"train.warmup_steps={min(10, steps)}", f"train.lr={lr}", f"train.eval_every={steps}"]
        sets += [f"train.eval_batches={eval_batches}", "train.log_every=50"]
        grt(*train_command(preset, data(), out, steps, 8, "ds_configs/zero3.json", sets))
        assert (out / "summary.json").is_file()

    return made_once(f"{preset}-{steps}-lr{lr:g}-eval{eval_batches}", make)


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(autouse=True)
def single_thread():
    """Tests of these modules run torch on one thread (see ENV); the setting is restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def grt_run() -> Path:
    """micro-grt (1+1x3+1, d 32) trained a few steps with DeepSpeed ZeRO-3."""
    return train("micro-grt", 30)


@pytest.fixture(scope="session")
def dense_run() -> Path:
    """micro-dense trained a few steps (enough for a non-trivial checkpoint)."""
    return train("micro-dense", 6)


@pytest.fixture(scope="session")
def manifest() -> Path:
    return data()


# -- models without DeepSpeed -------------------------------------------------------------
class CharTokenizer:
    """A stand-in tokenizer for hand-computed tests: one token per character (ord % 61 + 1), separator 0."""

    sep_id = 0
    vocab_size = 64

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % 61 + 1 for ch in text]

    def decode(self, ids) -> str:
        return "".join(chr(i + 64) for i in ids)


def small_model(layout: str = "1+2x3+1", variant: str = "grt", vocab: int = 64, seed: int = 0, **kw):
    import torch

    from pretrain.model import build_model
    from pretrain.model_config import ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(
        name="test",
        variant=variant,
        layout=layout,
        d_model=32,
        n_heads=2,
        vocab_size=vocab,
        max_seq_len=64,
        pad_vocab_multiple=8,
        **kw,
    )
    model = build_model(cfg).eval()
    with torch.no_grad():  # a non-trivial gate (the init bias of 4 makes the loop almost a no-op)
        if model.loop is not None and model.loop.has_gate:
            gate_out = model.loop.gate_out
            assert isinstance(gate_out, torch.nn.Linear)
            gate_out.bias.normal_(0.0, 1.0)
    return model


def write_export(model, out: Path, tokenizer: Path | None = None, run_config: dict | None = None) -> Path:
    """An export directory (as `grt export` writes it) for a model built in the test."""
    from safetensors.torch import save_file

    from pretrain.infer.load import WEIGHTS
    from pretrain.model.weights import state_for_saving

    out.mkdir(parents=True, exist_ok=True)
    model.cfg.save(out / "config.json")
    save_file(state_for_saving(model), str(out / WEIGHTS))
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.model")
    if run_config is not None:
        (out / "run_config.json").write_text(json.dumps(run_config))
    return out


@functools.cache
def torch_trained_grt(steps: int = 250, seed: int = 0):
    """micro-grt trained in plain PyTorch on the demo shards (pretrain/tools/loop_start.py's
    `train_briefly`: AdamW, warm-up then cosine, uniform depth sampling as the trainer does); fast
    enough for the analysis tests, and long enough that the loop lowers the loss visibly.
    Returns (model, manifest path)."""
    import torch

    from data_pipeline.manifest import Manifest
    from pretrain.model import build_model
    from pretrain.presets import get_preset
    from pretrain.tools.loop_start import loader, train_briefly

    manifest = data()
    m = Manifest.load(str(manifest))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = get_preset("micro-grt").replace(vocab_size=m.vocab_size, max_seq_len=m.seq_len)
    model = build_model(cfg)
    train_briefly(model, loader(str(manifest), "train", 16, seed), steps, lr=3e-3, warmup=25, seed=seed)
    torch.set_num_threads(threads)
    return model.eval(), manifest


def assert_extreme_thresholds_are_fixed_depths(model, idx, criterion: str, depth: int) -> None:
    """Adaptive exit at threshold 0 never exits early (every token runs `depth` steps, the fixed
    depth's logits); at infinity every token exits after one step (depth 1's logits)."""
    import torch

    from pretrain.infer.adaptive import adaptive_forward

    never, steps = adaptive_forward(model, idx, 0.0, criterion)
    assert torch.equal(steps, torch.full_like(steps, depth))
    torch.testing.assert_close(never, model(idx, n_loops=depth).logits, rtol=0, atol=1e-5)
    first, steps = adaptive_forward(model, idx, float("inf"), criterion)
    assert torch.equal(steps, torch.ones_like(steps))
    torch.testing.assert_close(first, model(idx, n_loops=1).logits, rtol=0, atol=1e-5)
