"""Every collective of the project (docs/gpu.md): on tensors made on `comm_device()`, through
`all_reduce` and what is built on it (`all_agree`, `ranks_with`, `check_ranks`: every rank
stops when one failed, `gather_text`, `gather_floats`), `barrier`, and `bus_bandwidth` (the pre-flight's
measure of a group's all-reduce). `Dist` is a sharded
evaluation's place in the group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")


def comm_device() -> torch.device:
    """The device whose tensors the process group's backend takes: the rank's GPU under
    NCCL, the CPU under gloo (and with no process group). Control tensors (flags, loss sums,
    counts) are created on it, so that one process group with one backend serves every
    collective (docs/gpu.md says why)."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `t` over all ranks and return the result on the communication device (a copy
    when `t` lives elsewhere; `t` itself otherwise). Without a process group: `t`.
    Callers create `t` on comm_device(): tests/comm_guard.py fails a run that does not."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return t
    x = t.to(comm_device())
    dist.all_reduce(x, op=getattr(dist.ReduceOp, _OPS[op]))
    return x


def all_agree(ok: bool) -> bool:
    """True on every rank iff `ok` on every rank (one collective)."""
    import torch

    flag = torch.tensor([0.0 if ok else 1.0], device=comm_device())
    return bool(all_reduce(flag, op="max").item() == 0)


def ranks_with(flag: bool) -> int:
    """How many ranks have `flag` (one collective)."""
    import torch

    return int(all_reduce(torch.tensor([float(flag)], device=comm_device())).item())


class RankFailed(RuntimeError):
    """Raised on every rank by `check_ranks` when one or more ranks failed: names each failing
    rank with its own error; `code` is the exit code the command ends with."""

    def __init__(self, errors: dict[int, str], code: int = 1) -> None:
        by_text: dict[str, list[int]] = {}
        for rank in sorted(errors):
            by_text.setdefault(errors[rank], []).append(rank)
        super().__init__("; ".join(f"{ranks_text(ranks)} failed: {text}" for text, ranks in by_text.items()))
        self.errors, self.code = errors, code


def ranks_text(ranks: list[int]) -> str:
    """[1] -> 'rank 1'; [0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


# Bytes of each failing rank's error (UTF-8) that reach the other ranks.
ERROR_BYTES = 1000


def check_ranks(error: str | None = None, code: int = 1) -> None:
    """A point that every rank of a job reaches in the same order (a collective), passing its
    own error (one line) and exit code, or None: returns when no rank passed an error, and
    otherwise raises RankFailed on every rank, naming each failing rank with its error and
    carrying the highest exit code. So a rank that fails stops the others at their next check
    instead of leaving them waiting in a collective it will never join. One all_reduce of a
    code per rank; a second one, only when a rank failed, carries the errors. Needs the
    process group (a sharded evaluation's, `join_launch`)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor(
        [float(code if r == rank and error is not None else 0) for r in range(world)], device=comm_device()
    )
    codes = [int(c) for c in all_reduce(mine, op="max").cpu().tolist()]
    if not any(codes):
        return
    texts = gather_text(error or "", ERROR_BYTES)
    raise RankFailed({r: texts[r] for r in range(world) if codes[r]}, max(codes))


def gather_text(text: str, max_bytes: int) -> list[str]:
    """Every rank's `text` (its first max_bytes of UTF-8), in rank order: one all_reduce of a
    row per rank. Without a process group: [text]."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [text]
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.zeros(world, max_bytes, dtype=torch.uint8)
    data = text.encode("utf-8")[:max_bytes]
    if data:
        rows[rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = all_reduce(rows.to(comm_device()), op="max").cpu()
    return [bytes(rows[r].tolist()).rstrip(b"\0").decode("utf-8", errors="ignore") for r in range(world)]


def gather_floats(value: float) -> list[float]:
    """Every rank's `value`, in rank order: one all_reduce of a vector on the communication device
    (the caller's host value placed in its own slot). Without a process group: [value]."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([value if r == rank else 0.0 for r in range(world)], dtype=torch.float64, device=comm_device())
    return [float(v) for v in all_reduce(mine).cpu().tolist()]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = comm_device()
        # NCCL's barrier otherwise guesses the GPU from the rank and warns that it may hang
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def bus_bandwidth(numel: int, dtype: torch.dtype, group: object, size: int, calls: int) -> float | None:
    """All-reduce bus bandwidth in `group` of `size` ranks (GB/s, nccl-tests' definition): `calls`
    timed all-reduces of `numel` elements after one warm-up, the same count on every rank of the
    group (launcher/preflight.py). None for a group of one."""
    import time

    import torch
    import torch.distributed as dist

    if size < 2:
        return None
    buf = torch.ones(numel, dtype=dtype, device=comm_device())
    sync = torch.cuda.synchronize if buf.is_cuda else (lambda: None)
    dist.all_reduce(buf, group=group)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(buf, group=group)
    sync()
    took = time.perf_counter() - t0
    return buf.numel() * buf.element_size() * 2 * (size - 1) / size / (took / calls) / 1e9


@dataclass
class Dist:
    """Where this process stands in a sharded evaluation: rank `rank` of `world` takes every
    world-th item (`shard`); the sums are then combined with `all_reduce`."""

    rank: int = 0
    world: int = 1

    def shard(self, items: list[_T]) -> list[_T]:
        return items[self.rank :: self.world]
