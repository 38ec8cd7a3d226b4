"""TensorBoard scalars, a per-step JSON-lines record, throughput and MFU, norms, memory."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from grt_common.files import atomic_write_bytes, atomic_write_text
from pretrain.distributed import all_reduce, comm_device
from pretrain.model.flops import flops_per_token
from pretrain.training.callbacks import Callback
from pretrain.training.engine.deepspeed_internals import local_shares

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from pretrain.model_config import ModelConfig
    from pretrain.training.run_context import RunContext

# bf16 dense peak FLOP/s by device name (substring match)
GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12, "V100": 125e12}


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> tuple[float, str]:
    if override_tflops > 0:
        return override_tflops * 1e12, f"{override_tflops} TFLOP/s (train.peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak, f"{peak / 1e12:.0f} TFLOP/s bf16 dense ({name})"
        return 312e12, f"unknown GPU {name!r}: assuming 312 TFLOP/s; set train.peak_tflops"
    cores = len(os.sched_getaffinity(0))
    peak = cores * 2.5e9 * 32  # fp32 AVX2: 2 FMA units x 8 lanes x 2 FLOPs per cycle at ~2.5 GHz
    return (
        peak,
        f"CPU estimate {peak / 1e9:.0f} GFLOP/s ({cores} cores x 2.5 GHz x 32 FLOP/cycle); set train.peak_tflops",
    )


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS on CPU


def memory_scalars(device: torch.device) -> dict[str, int]:
    """Peak memory, and on CUDA the caching allocator's allocated and reserved bytes now (no sync)."""
    values = {"memory/peak_bytes": peak_memory_bytes(device)}
    if device.type == "cuda":
        values.update(
            {
                "memory/allocated_bytes": int(torch.cuda.memory_allocated(device)),
                "memory/reserved_bytes": int(torch.cuda.memory_reserved(device)),
            }
        )
    return values


class Throughput(Callback):
    """Tokens, executed FLOPs and wall time of the steps since the last read. MFU is the
    executed FLOPs summed over the window's steps, each at its own sampled depth and by the
    model variant's own formula (`flops_per_token`), over the window's time. As a callback: each
    step trained adds `tokens_per_step`, each logging step reads, and the time that is not
    training's (the start, evaluation, a rollback) starts a new window."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        seq_len: int,
        peak_flops_all_ranks: float,
        tokens_per_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg, self.seq_len, self.peak, self.clock = model_cfg, seq_len, peak_flops_all_ranks, clock
        self.tokens_per_step = tokens_per_step
        self.flops_per_token: dict[int, int] = {}  # depth -> executed forward FLOPs per token
        self.reset()

    @classmethod
    def build(cls, run: RunContext) -> Throughput:
        peak, _ = peak_flops(run.device, run.cfg.train.peak_tflops)
        return cls(run.cfg.model, run.seq_len, peak * run.world, run.tokens_per_step)

    def on_fit_start(self, step: int) -> None:
        self.reset()

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        self.add(self.tokens_per_step, record["depth"])

    def log_values(self, step: int) -> dict[str, float]:
        return self.read()

    def on_validation(self, step: int) -> None:
        self.reset()

    def on_rollback(self, step: int) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens, self.flops, self.steps = self.clock(), 0, 0, 0

    def add(self, tokens: int, depth: int) -> None:
        if depth not in self.flops_per_token:
            self.flops_per_token[depth] = flops_per_token(self.cfg, self.seq_len, n_loops=depth, executed=True)
        self.tokens += tokens
        self.flops += 3 * tokens * self.flops_per_token[depth]  # forward + backward
        self.steps += 1

    def read(self) -> dict[str, float]:
        """The window's figures; starts the next window."""
        elapsed = max(self.clock() - self.start, 1e-9)
        values = {
            "perf/tokens_per_s": self.tokens / elapsed,
            "perf/samples_per_s": self.tokens / self.seq_len / elapsed,
            "perf/step_time_s": elapsed / max(self.steps, 1),
            "perf/mfu": self.flops / elapsed / self.peak,
        }
        self.reset()
        return values


BLOCKS = ("prelude", "core", "gate", "coda")


def block_of(name: str) -> str:
    """The part of the model a parameter belongs to (embeddings count with the prelude)."""
    if "gate" in name or "router" in name:
        return "gate"
    if name.startswith("loop."):
        return "core"
    if name.startswith(("coda.", "exit_norm", "ln_f", "lm_head")):
        return "coda"
    return "prelude"


def norms(model: torch.nn.Module, world: int) -> dict[str, float]:
    """The parameter norm and each block's gradient norm, from every rank's local share
    (`local_shares`: a ZeRO-3 partition is never gathered): one all-reduce of a few numbers.
    For logging steps, between the last backward and `engine.step()`."""
    param_squares: list[torch.Tensor] = []
    grad_squares: list[tuple[int, torch.Tensor]] = []  # (block, gradient squares)
    for name, p in model.named_parameters():
        param, param_split, grad, grad_split = local_shares(p)
        block = BLOCKS.index(block_of(name))
        param_squares.append(param.float().pow(2).sum() / (1 if param_split else world))
        if grad is not None:
            grad_squares.append((block, grad.float().pow(2).sum() / (1 if grad_split else world)))
    device = param_squares[0].device
    totals = torch.zeros(1 + len(BLOCKS), dtype=torch.float64, device=device)
    totals[0] = torch.stack(param_squares).sum()
    for block, value in grad_squares:
        totals[1 + block] += value.to(device)
    values = all_reduce(totals.to(comm_device())).tolist()
    return {
        "train/param_norm": math.sqrt(values[0]),
        **{f"grad_norm/{b}": math.sqrt(v) for b, v in zip(BLOCKS, values[1:])},
    }


class MetricsWriter:
    """Rank 0 writes TensorBoard events under <out>/tb; every rank writes one JSON line per
    step (metrics.jsonl on rank 0, metrics.rank<r>.jsonl elsewhere) so ranks can be compared.

    One rule for every sink: each `scalars(step, values)` goes to TensorBoard (rank 0), to every
    sink (rank 0: W&B), and into the step's JSON line (every rank: `step_record` adds the scalars
    written for its step under the same names); given the step's tokens seen, to TensorBoard's
    by_tokens/ series too, every one of them. A `rewind` (a rollback) reaches the sinks as well.

    A run continues the files of the runs before it in --out, and first drops what they wrote
    after the step it starts from, so that across any number of restarts (a resume, an
    elastic restart of the worker group, a requeue) every step is in the records and the
    curves once: the JSON-lines file is rewritten atomically with its records of the steps
    before (`trim_records`), and rank 0's TensorBoard event files lose their events of later
    steps (`trim_events`).

    `resume_step`: the step the run starts from (the checkpoint's, 0 for a fresh start); the
    files are trimmed here, on rank 0 also those of ranks `world` and above (a run resumed
    on fewer ranks: no rank of it owns them). None: the first step this run writes tells (its step - 1; a
    record's for the JSON lines, a step-axis scalar's for TensorBoard), and the files are
    trimmed then (TensorBoard's writer opens then; `text` before it waits).

    `SummaryWriter(purge_step=)` is not used: TensorBoard applies that purge to every series,
    also the by_tokens/ ones whose x-axis is tokens, which would lose nearly every point."""

    def __init__(self, out: Path, rank: int, *, resume_step: int | None = None, world: int | None = None) -> None:
        self.out, self.rank = out, rank
        self.tb: SummaryWriter | None = None
        self.records: TextIO | None = None
        self._tb_opened = False  # whether TensorBoard's writer was opened (rank 0) or would have been
        self._closed = False
        self._texts: list[tuple[str, str]] = []  # text() before the TensorBoard writer opened
        self._sinks: list[Callable[[int, Mapping[str, float]], None]] = []  # add_sink (rank 0)
        self._rewinds: list[Callable[[int], None]] = []  # add_sink's on_rewind (rank 0)
        self._pending: dict[int, dict[str, float]] = {}  # step -> the scalars its record has not taken yet
        out.mkdir(parents=True, exist_ok=True)
        self.records_path = out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
        if resume_step is not None:
            self._open_records(resume_step)
            self._open_tb(resume_step)
            if rank == 0 and world is not None:  # a run resumed on fewer ranks: files no rank owns now
                for path in out.glob("metrics.rank*.jsonl"):
                    m = re.fullmatch(r"metrics\.rank(\d+)\.jsonl", path.name)
                    if m and int(m.group(1)) >= world:
                        trim_records(path, resume_step)

    def _open_records(self, keep_through: int) -> None:
        trim_records(self.records_path, keep_through)
        self.records = open(self.records_path, "a")

    def _open_tb(self, keep_through: int | None) -> None:
        """Rank 0: trim the event files to the steps <= keep_through (None: keep them), then open
        TensorBoard's writer (a new event file) and write the texts that waited."""
        self._tb_opened = True
        if self.rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        if keep_through is not None:
            trim_events(self.out / "tb", keep_through)
        self.tb = SummaryWriter(log_dir=str(self.out / "tb"))
        for tag, text in self._texts:
            self.tb.add_text(tag, text, 0)
        self._texts.clear()

    def add_sink(
        self, sink: Callable[[int, Mapping[str, float]], None], on_rewind: Callable[[int], None] | None = None
    ) -> None:
        """Also send every `scalars(step, values)` to `sink(step, values)` (e.g. W&B's run), and
        every `rewind(step)` to `on_rewind(step)`, on the rank that writes TensorBoard (rank 0;
        elsewhere neither is called)."""
        self._sinks.append(sink)
        if on_rewind is not None:
            self._rewinds.append(on_rewind)

    def scalars(self, step: int, values: Mapping[str, float], tokens: int | None = None) -> None:
        """`values` at `step`, in every sink; `tokens` (the tokens seen by then): also each one
        against tokens (by_tokens/)."""
        if not self._tb_opened and not self._closed:
            self._open_tb(step - 1)
        self._add(step, values)
        if tokens is not None:
            self.scalars_by_tokens(tokens, values)
        if self._closed:
            return
        self._pending.setdefault(step, {}).update(values)
        if self.rank == 0:
            for sink in self._sinks:
                sink(step, values)

    def _add(self, x: int, values: Mapping[str, float]) -> None:
        if self.tb:
            for key, value in values.items():
                self.tb.add_scalar(key, value, x)

    def scalars_by_tokens(self, tokens: int, values: Mapping[str, float]) -> None:
        """The same curves against tokens seen, a second x-axis (series under by_tokens/).
        Called right after `scalars` of the step they belong to: `trim_events` finds a
        by_tokens/ event's step from the step-axis event written before it."""
        if not self._tb_opened and not self._closed:
            self._open_tb(None)  # tokens do not tell the step
        self._add(tokens, {f"{BY_TOKENS}{key}": value for key, value in values.items()})

    def text(self, tag: str, text: str) -> None:
        block = f"```\n{text}\n```"
        if self.tb:
            self.tb.add_text(tag, block, 0)
        elif self.rank == 0 and not self._tb_opened and not self._closed:
            self._texts.append((tag, block))

    def step_record(self, step: int, values: Mapping[str, Any]) -> None:
        """Step `step`'s JSON line: `values`, then every scalar written at the step (`scalars`)."""
        if self.records is None and not self._closed:
            self._open_records(step - 1)
        scalars = self._pending.pop(step, {})
        self._pending = {s: v for s, v in self._pending.items() if s > step}  # a later record cannot take them
        if self.records:
            self.records.write(json.dumps({"step": step, **values, **scalars}) + "\n")
            self.records.flush()

    def rewind(self, step: int) -> None:
        """Go back to `step` (a rollback to its checkpoint): what was written after it is dropped, as
        a resume from it would, and the records go on from there; each sink's `on_rewind` follows."""
        self.close()
        self._closed = False
        self._pending.clear()
        self._open_records(step)
        self._open_tb(step)
        if self.rank == 0:
            for on_rewind in self._rewinds:
                on_rewind(step)

    def close(self) -> None:
        if self._texts and not self._tb_opened:  # no step written: the texts, nothing trimmed
            self._open_tb(None)
        self._closed = True
        if self.tb:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.records:
            self.records.close()
            self.records = None


BY_TOKENS = "by_tokens/"  # the prefix of the series whose x-axis is tokens seen, not steps


def trim_records(path: Path, keep_through: int) -> bool:
    """Rewrite the JSON-lines file `path` (atomically) with one record per step for the steps
    <= `keep_through`, in step order, the last one written of each (an earlier resume that did
    not trim may have left two); lines that do not parse (cut off by a kill) are dropped.
    Returns whether the file changed (an absent file: False)."""
    if not path.is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = list(f)
    by_step: dict[int, str] = {}
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step <= keep_through:
            by_step[step] = line if line.endswith("\n") else line + "\n"
    kept = [by_step[s] for s in sorted(by_step)]
    if kept == lines:
        return False
    atomic_write_text(path, "".join(kept))
    return True


def _records(data: bytes) -> tuple[list[tuple[int, int]], bool]:
    """The (start, end) byte spans of the complete TFRecords in an event file's `data`, and
    whether anything follows the last one (a record the kill cut off)."""
    spans, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + 12 + length + 4
        if end > len(data):
            break
        spans.append((pos, end))
        pos = end
    return spans, pos != len(data)


def trim_events(tb_dir: Path, keep_through: int) -> list[Path]:
    """Drop from every TensorBoard event file in `tb_dir` the summaries of steps after
    `keep_through`, and a record cut off at the end; each changed file is rewritten in place,
    atomically, its kept records copied byte for byte (name and order unchanged). A
    by_tokens/ event belongs to the step of the step-axis event written before it in its file.
    Events without a summary (the file version) and summaries before any step are kept.
    Returns the files rewritten."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto import event_pb2

    changed = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.is_dir() else []:
        data = path.read_bytes()
        spans, cut_off = _records(data)
        kept: list[bytes] = []
        step: int | None = None  # of the last step-axis event
        for start, end in spans:
            record = data[start:end]
            try:
                event = event_pb2.Event.FromString(record[12:-4])
            except DecodeError:  # not an event: the rest of the file is not read either
                cut_off = True
                break
            if event.HasField("summary") and event.summary.value:
                if not all(v.tag.startswith(BY_TOKENS) for v in event.summary.value):
                    step = event.step
                if step is not None and step > keep_through:
                    continue
            kept.append(record)
        if cut_off or len(kept) != len(spans):  # a record cut off, or one dropped
            atomic_write_bytes(path, b"".join(kept))
            changed.append(path)
    return changed


def rss_mb() -> float:
    """This process's resident memory now (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
