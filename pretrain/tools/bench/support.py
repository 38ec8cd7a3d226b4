"""What every `grt bench` module shares, below all of them (pretrain.tools.bench.cli dispatches to the
others, so none of them imports it): peak memory, the benchmark data, argument types."""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pretrain import PROJECT_ROOT

# a tokenizer of GPT-2's vocabulary size (examples/tokenizers/README.md), so that benchmark runs pay
# for the embedding, head and loss what GPT-2-sized training pays
GPT2_VOCAB = 50257
GPT2_VOCAB_TOKENIZER = PROJECT_ROOT / "examples" / "tokenizers" / "gutenberg-50257.model"
DEMO_TEXT = PROJECT_ROOT / "examples" / "data" / "tinyshakespeare.txt"


def peak_bytes(device: torch.device) -> int:
    """The peak memory so far: CUDA's allocated bytes, else the process's peak RSS (since
    `reset_peak`, where Linux lets it be reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:  # VmHWM: the peak RSS, which `reset_peak` resets (ru_maxrss cannot be)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_bytes(device: torch.device) -> int:
    """The memory in use now: CUDA's allocated bytes, else the process's RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_bytes(device)


def reset_peak(device: torch.device) -> None:
    """Start the peak over from the memory in use now (a warm-up's or a compile's peak excluded)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak RSS (Linux's proc(5), clear_refs)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn()` takes on `device`: the device's queue drained before and after (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def make_bench_data(out: Path, seq_len: int, vocab: int) -> Path:
    """Shards of the bundled text at `seq_len` with the real `grt data` commands; the tokenizer
    is the shipped GPT-2-sized one at vocab 50257, else one trained here. Returns the manifest."""
    grt = [sys.executable, "-m", "pretrain.cli"]
    tokenizer = GPT2_VOCAB_TOKENIZER
    text = ["-i", str(DEMO_TEXT), "--txt-mode", "paragraph"]
    if vocab != GPT2_VOCAB:
        tokenizer = out / "tok.model"
        train = [*grt, "data", "tokenizer", *text, "--vocab-size", str(vocab), "-o", str(tokenizer), "-q"]
        subprocess.run(train, check=True, cwd=PROJECT_ROOT, capture_output=True)
    prepare = [*grt, "data", "prepare", *text, "-t", str(tokenizer), "-o", str(out / "shards")]
    subprocess.run(
        [*prepare, "--seq-len", str(seq_len), "--shard-size-mb", "0.2", "-q"],
        check=True,
        cwd=PROJECT_ROOT,
        capture_output=True,
    )
    return out / "shards" / "manifest.json"


def train_command(
    preset: str,
    manifest: Path,
    out: Path,
    steps: int,
    micro_batch_size: int,
    ds_config: str | Path,
    settings: Sequence[str],
) -> list[str]:
    """A benchmark's short `grt train` run, as what follows `python -m` (or a launcher's
    `--module`): the preset on the data, `steps` steps of `micro_batch_size` sequences under
    the DeepSpeed file, and each of `settings` (KEY=VALUE) as a `--set`."""
    flags = ["--data", str(manifest), "--out", str(out), "--steps", str(steps)]
    flags += ["--micro-batch-size", str(micro_batch_size), "--ds-config", str(ds_config)]
    return ["pretrain.cli", "train", "--preset", preset, *flags, *(a for s in settings for a in ("--set", s))]


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum (a size, a count of steps or tokens)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= {minimum}")
        return value

    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (a peak in TFLOP/s)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0")
    return value


def whole_numbers(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated whole numbers >= minimum (`1,32`)."""
    one = whole_number(minimum)

    def parse(text: str) -> list[int]:
        parts = [p.strip() for p in text.split(",")]
        try:
            return [one(p) for p in parts]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected comma-separated whole numbers >= {minimum}, e.g. 1,32"
            ) from None

    return parse
