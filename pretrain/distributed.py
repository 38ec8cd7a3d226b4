"""Rank discovery and process-group start-up for every way `grt` is launched.

(Longer than the project's ~400 lines on purpose: the one module that knows the process
group, from discovery to the collectives to the exit path, so that nothing else needs to.)

`discover()` reads the environment only and tells who this process is, whichever
launcher started it:

* ``torchrun/deepspeed``: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (+ ``MASTER_ADDR``/``MASTER_PORT``),
  as set by ``torchrun`` and by DeepSpeed's per-node ``deepspeed.launcher.launch``;
* ``mpi``: ``OMPI_COMM_WORLD_RANK``/``_LOCAL_RANK``/``_SIZE``/``_LOCAL_SIZE`` (OpenMPI's
  ``mpirun``), or ``PMI_RANK``/``PMI_SIZE`` and ``PMIX_RANK`` (MPICH, Intel MPI, PMIx) in which
  case the missing values are asked from mpi4py;
* ``slurm``: ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS`` of an ``srun`` step, with
  ``MASTER_ADDR`` the first host of ``SLURM_JOB_NODELIST`` (pure-Python nodelist parser,
  ``scontrol show hostnames`` as a fallback);
* ``single``: none of these, one process.

``GRT_DIST_DISCOVERY=mpi4py`` makes every MPI launch ask mpi4py instead of the environment.

`init_distributed()` exports the discovered values as ``MASTER_ADDR``/``MASTER_PORT``/
``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` and starts the process group through
``deepspeed.init_distributed`` (``nccl`` on CUDA, ``gloo`` otherwise).  It is idempotent,
and a lone process with no launcher environment still gets a 1-rank group on a port the
kernel picks, because the DeepSpeed engine needs one.

Before that, the rendezvous store (the TCPStore that torch.distributed's ``env://`` start
uses before NCCL or gloo exist) is checked: rank 0 opens it itself, so a ``MASTER_PORT``
another process holds is one line naming the port; every other rank first reaches it within
the start's timeout (``train.dist_timeout_s``), so a rank 0 that never opened it is one line
naming ``MASTER_ADDR:MASTER_PORT`` instead of a wait without end (`RendezvousError`, exit 2).
Under torchrun's elastic agent each restart of the worker group is a new set of processes, whose
rank and world size come from the agent's environment; with the agent's own store
(``TORCHELASTIC_USE_AGENT_STORE``, which outlives the groups and holds their keys) the ranks only
meet there, and rank 0 serves the group's store itself (`_round_store`).

Every collective of the project goes through this module (`all_reduce`, `all_agree`,
`check_ranks`, `barrier`), on tensors made on `comm_device()`, and every process that
started a group ends through `exit_process` (`run_command` does it for each command).
docs/gpu.md says why.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar, overload

from pretrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_MASTER_PORT = 29500

_T = TypeVar("_T")

__all__ = [
    "DistInfo",
    "discover",
    "init_distributed",
    "RendezvousError",
    "is_main",
    "barrier",
    "comm_device",
    "all_reduce",
    "all_agree",
    "ranks_with",
    "RankFailed",
    "check_ranks",
    "Dist",
    "join_launch",
    "exit_process",
    "run_command",
    "get_info",
    "expand_nodelist",
    "parse_tasks_per_node",
]


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    launcher: str = "single"  # 'single', 'torchrun/deepspeed', 'slurm' or 'mpi'

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(1, self.local_world_size)))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class RendezvousError(ConfigError):
    """The process group cannot start for a reason the user fixes in the launch: rank 0 cannot
    listen on MASTER_PORT, or another rank cannot reach rank 0's store. One line, exit 2."""


# --------------------------------------------------------------------------- Slurm lists


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(host: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", host)
    if not m:
        return [host]
    prefix, suffix = host[: m.start()], host[m.end() :]
    out: list[str] = []
    for item in m.group(1).split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            step = 1 if int(hi) >= int(lo) else -1
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
        else:
            values = [item]
        for v in values:
            out.extend(_expand_one(prefix + v + suffix))  # further brackets in the suffix
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist expression, like `scontrol show hostnames` does.

    'gpu[001-003,7],login-a[1-2]-ib' -> ['gpu001', 'gpu002', 'gpu003', 'gpu7',
    'login-a1-ib', 'login-a2-ib'].
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part))
    return hosts


def _first_host(nodelist: str) -> str:
    try:
        hosts = expand_nodelist(nodelist)
        if hosts and all(re.fullmatch(r"[\w.\-]+", h) for h in hosts):
            return hosts[0]
    except ValueError:
        pass
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0]


def parse_tasks_per_node(value: str) -> list[int]:
    """'8(x4),2' -> [8, 8, 8, 8, 2] (the format of SLURM_TASKS_PER_NODE)."""
    counts: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise ValueError(f"cannot parse tasks-per-node {value!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


# --------------------------------------------------------------------------- discovery


@overload
def _int(env: Mapping[str, str], *names: str, default: int) -> int: ...


@overload
def _int(env: Mapping[str, str], *names: str, default: None = None) -> int | None: ...


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        v = env.get(name)
        if v not in (None, ""):
            return int(v)
    return default


def _set_int(env: Mapping[str, str], *names: str) -> int:
    """The first of `names` that is set: one that `discover()` checked before it chose the launcher."""
    value = _int(env, *names)
    if value is None:
        raise KeyError(f"none of {', '.join(names)} is set")
    return value


@overload
def _port(env: Mapping[str, str], default: int = DEFAULT_MASTER_PORT) -> int: ...


@overload
def _port(env: Mapping[str, str], default: None) -> int | None: ...


def _port(env: Mapping[str, str], default: int | None = DEFAULT_MASTER_PORT) -> int | None:
    """MASTER_PORT, or `default` when it is unset; one that is not a port is a RendezvousError."""
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) > 65535:
        raise RendezvousError(f"MASTER_PORT={value!r}: not a port number; set MASTER_PORT to a free port in 1-65535")
    return int(value)


def _from_torchrun(env: Mapping[str, str]) -> DistInfo:
    rank = _set_int(env, "RANK")
    world = _int(env, "WORLD_SIZE", default=1)
    local_rank = _int(env, "LOCAL_RANK", default=rank % max(1, world))
    local_world = _int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", default=None)
    if local_world is None:
        # deepspeed.launcher.launch does not export LOCAL_WORLD_SIZE; its CROSS_* variables help
        cross = _int(env, "CROSS_SIZE", default=None)
        local_world = world // cross if cross else world
    node_rank = _int(env, "GROUP_RANK", "CROSS_RANK", "NODE_RANK", default=rank // max(1, local_world))
    return DistInfo(
        rank,
        local_rank,
        world,
        local_world,
        node_rank,
        env.get("MASTER_ADDR") or "127.0.0.1",
        _port(env),
        "torchrun/deepspeed",
    )


def _from_ompi(env: Mapping[str, str]) -> DistInfo:
    rank = _set_int(env, "OMPI_COMM_WORLD_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", default=1)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=world)
    node_rank = _int(env, "OMPI_COMM_WORLD_NODE_RANK", default=rank // max(1, local_world))
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if local_world >= world else "")
    return DistInfo(rank, local_rank, world, local_world, node_rank, addr, _port(env), "mpi")


def _from_mpi4py(env: Mapping[str, str]) -> DistInfo:
    """PMI/PMIx-only environments (MPICH, Intel MPI, srun --mpi=pmix): ask MPI itself."""
    from mpi4py import MPI  # noqa: WPS433 (optional dependency)

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    rank, world = comm.Get_rank(), comm.Get_size()
    local_rank, local_world = local.Get_rank(), local.Get_size()
    addr = env.get("MASTER_ADDR") or comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
    return DistInfo(rank, local_rank, world, local_world, rank // max(1, local_world), addr, _port(env), "mpi")


def _from_slurm(env: Mapping[str, str]) -> DistInfo:
    rank = _set_int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", default=1)
    local_rank = _int(env, "SLURM_LOCALID", default=0)
    node_rank = _int(env, "SLURM_NODEID", default=0)
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    try:
        counts = parse_tasks_per_node(tpn)
        local_world = counts[node_rank] if node_rank < len(counts) else counts[0]
    except (ValueError, IndexError):
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", default=world)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else "127.0.0.1")
    port = _port(env, default=None)
    if port is None:
        # every task of a job computes the same port; two jobs sharing a node rarely collide
        job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID", default=0)
        port = 20000 + job % 20000
    return DistInfo(rank, local_rank, world, local_world, node_rank, addr, port, "slurm")


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    # SLURM_PROCID is also set in the batch script itself, where it must not count as a
    # rank of a multi-task job: only an srun step (SLURM_STEP_ID, not the batch step) does.
    if env.get("SLURM_PROCID") in (None, ""):
        return False
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is None:
        return False
    return step not in ("batch", "extern", "4294967294", "4294967291")


def discover(env: Mapping[str, str] | None = None) -> DistInfo:
    """Who this process is, from the environment (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("GRT_DIST_DISCOVERY", "").lower() == "mpi4py":
        return _from_mpi4py(env)  # ask MPI itself, whatever the environment says
    if env.get("RANK") not in (None, "") and env.get("WORLD_SIZE") not in (None, ""):
        return _from_torchrun(env)
    if env.get("OMPI_COMM_WORLD_RANK") not in (None, ""):
        return _from_ompi(env)
    if _in_slurm_step(env):
        return _from_slurm(env)
    if any(env.get(k) not in (None, "") for k in ("PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")):
        world = _int(env, "PMI_SIZE", "MV2_COMM_WORLD_SIZE", default=None)
        rank = _set_int(env, "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
        local_rank = _int(env, "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", default=None)
        local_world = _int(env, "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", default=None)
        if world is None or local_rank is None or local_world is None:
            return _from_mpi4py(env)
        if local_world < world and not env.get("MASTER_ADDR"):
            return _from_mpi4py(env)
        addr = env.get("MASTER_ADDR") or "127.0.0.1"
        return DistInfo(rank, local_rank, world, local_world, rank // max(1, local_world), addr, _port(env), "mpi")
    return DistInfo(master_addr=env.get("MASTER_ADDR") or "127.0.0.1", master_port=_port(env))


# --------------------------------------------------------------------------- start-up

_INFO: DistInfo | None = None
# Rank 0's rendezvous store server, kept for the life of the process (see _open_store)
_STORE: object | None = None


def _mpi_master_addr() -> str:
    """Rank 0's hostname, broadcast through mpi4py (mpirun across nodes without MASTER_ADDR)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.bcast(socket.gethostname() if comm.Get_rank() == 0 else None, root=0)


def _agent_store() -> bool:
    """torchrun's agent serves the store itself: every rank, rank 0 included, is its client."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _listen_error(port: int, err: Exception) -> RendezvousError:
    m = re.search(r"name: (\w+), message: (.+)$", str(err))
    if m and m.group(1) == "EADDRINUSE":
        reason = "address already in use (another process holds the port)"
    else:
        reason = f"{m.group(2)} ({m.group(1)})" if m else str(err).splitlines()[0]
    return RendezvousError(
        f"rank 0 cannot listen on MASTER_PORT={port} for the process group's store: {reason}; "
        "set MASTER_PORT to a free port"
    )


def _reach_store(info: DistInfo, timeout_s: float, whose: str = "rank 0's store") -> None:
    """Return once rank 0's store (`whose`) answers at MASTER_ADDR:MASTER_PORT, within `timeout_s`.

    torch's own client would wait longer: it retries the connection past its timeout, and
    once a connection is accepted it waits for the store's answer without any limit, so a
    port held by a program that is not the store (a rank 0 that failed to listen on it, and
    another process listens there) kept the other ranks waiting for ever. The connection is
    tried here (refused while rank 0 is still importing: again every 0.2 s), then torch's
    handshake runs in a thread given what is left of the time."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    where = f"{info.master_addr}:{info.master_port}"

    def unreachable(why: str) -> RendezvousError:
        hint = (
            "check that rank 0 started and that MASTER_PORT is free on its host"
            if whose == "rank 0's store"
            else "check that the agent on that host runs; if its node was lost, run torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (grt launch --elastic does)"
        )
        return RendezvousError(
            f"rank {info.rank} could not reach {whose} at {where} (MASTER_ADDR:MASTER_PORT) "
            f"within {timeout_s:g} s (the start-up timeout, train.dist_timeout_s in grt train): {why}; {hint}"
        )

    why = "no connection"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise unreachable(why)
        try:
            with socket.create_connection((info.master_addr, info.master_port), timeout=min(left, 5.0)):
                break
        except OSError as err:
            why = err.strerror or str(err) or type(err).__name__
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    answer: dict[str, object] = {}

    def handshake() -> None:
        try:
            left = max(1.0, deadline - time.monotonic())
            dist.TCPStore(info.master_addr, info.master_port, None, False, timedelta(seconds=left))
            answer["ok"] = True
        except Exception as err:  # noqa: BLE001 - reported as the reason below
            answer["error"] = str(err).splitlines()[0] if str(err) else type(err).__name__

    thread = threading.Thread(target=handshake, name="grt-store-check", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if "ok" not in answer:
        raise unreachable(str(answer.get("error", "the port accepts connections but no store answers there")))


def _open_store(info: DistInfo, timeout_s: float) -> None:
    """Rank 0 opens the rendezvous store on MASTER_PORT itself (port 0: one the kernel picks,
    written back to `info`), before torch's env:// start does: a port already held is one
    line here, and torch's store on rank 0 shares this server (multi_tenant, the same port in
    the same process) instead of binding the port again. Every other rank waits until the
    store answers, `timeout_s` at most. Under torchrun's agent store the ranks meet there
    first and rank 0 opens a store of its own for this worker group (`_round_store`)."""
    if info.world_size > 1 and info.master_port == 0:
        raise RendezvousError(
            f"MASTER_PORT=0: the {info.world_size} ranks need one port that they all know; "
            "set MASTER_PORT to a free port"
        )
    if _agent_store():
        _round_store(info, timeout_s)
    elif info.rank != 0:
        _reach_store(info, timeout_s)
    else:
        _serve_store(info, info.master_port, timeout_s)


def _serve_store(info: DistInfo, port: int, timeout_s: float) -> None:
    """Rank 0: listen on `port` (0: one the kernel picks) for the process group's store, kept in
    _STORE for the life of the process; `info.master_port` becomes the port it listens on."""
    global _STORE
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            info.master_addr,
            port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=os.environ.get("USE_LIBUV", "1") == "1",  # the server torch's env:// start would make
        )
    except RuntimeError as err:  # DistNetworkError
        raise _listen_error(port, err) from None
    _STORE = store
    info.master_port = store.port


# Keys of the agent store where the ranks of one worker group meet (`_round_store`)
_ROUND = "grt/round/"
_POLL_S = 0.05


def _round_store(info: DistInfo, timeout_s: float) -> None:
    """The process group's store under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE,
    torch's default): rank 0 opens a store of its own on a port the kernel picks, and the
    ranks learn it through the agent's store, which `info` names on entry and the new store on
    return.

    The agent's store lives as long as the agent, so that after a restart of the worker group
    it still holds the keys of the group before (torch's own env:// start reads the former
    ranks' gloo addresses from it: the restarted group failed to connect, or read another
    NCCL id), and the restart counts that the agents hand to their workers differ from node to
    node (an agent whose own workers did not fail does not count the restart), so neither can
    name the group. The ranks agree on the group without either: each non-zero rank writes a
    fresh random nonce under its rank and waits for rank 0's answer under that nonce, which
    nobody wrote before; rank 0 answers every nonce it sees (a former rank's stale one too,
    harmlessly) with this group's random token and its store's port, until every rank has said,
    under the token, that it has it. Stale keys are never read as this group's."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    agent_at = f"{info.master_addr}:{info.master_port}"
    _reach_store(info, timeout_s, whose="torchrun's agent store")
    agent = dist.TCPStore(
        info.master_addr,
        info.master_port,
        None,
        False,
        timedelta(seconds=max(1.0, deadline - time.monotonic())),
        wait_for_workers=False,
    )
    if info.rank == 0:
        _serve_store(info, 0, timeout_s)
        _answer_ranks(agent, info.world_size, f"{uuid.uuid4().hex} {info.master_port}", deadline, timeout_s)
        return
    nonce = uuid.uuid4().hex
    agent.set(f"{_ROUND}hello/{info.rank}", nonce)
    key = f"{_ROUND}answer/{nonce}"
    try:
        agent.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except Exception:  # noqa: BLE001 - DistStoreError (a timeout) or a lost connection: one line
        raise RendezvousError(
            f"rank {info.rank}: rank 0 of this worker group did not answer within {timeout_s:g} s (the start-up "
            f"timeout, train.dist_timeout_s in grt train) through torchrun's agent store at {agent_at}; if the "
            "node of the rendezvous's first agent was lost, run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(grt launch --elastic does)"
        ) from None
    token, port = agent.get(key).decode().split()
    agent.set(f"{_ROUND}joined/{token}/{info.rank}", "1")
    info.master_port = int(port)
    _reach_store(info, max(1.0, deadline - time.monotonic()))


def _answer_ranks(
    agent: torch.distributed.TCPStore, world: int, answer: str, deadline: float, timeout_s: float
) -> None:
    """Rank 0's side of `_round_store`: answer each rank's nonce with `answer` until every rank
    has joined under its token (`agent`: the agent's TCPStore)."""
    token = answer.split()[0]
    pending = set(range(1, world))
    answered: dict[int, bytes] = {}
    while pending:
        for r in sorted(pending):
            if agent.check([f"{_ROUND}joined/{token}/{r}"]):
                pending.discard(r)
                continue
            hello = f"{_ROUND}hello/{r}"
            if agent.check([hello]):
                nonce = agent.get(hello)
                if answered.get(r) != nonce:
                    agent.set(f"{_ROUND}answer/{nonce.decode()}", answer)
                    answered[r] = nonce
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank 0: {_ranks(sorted(pending))} of this worker group did not join within {timeout_s:g} s (the "
                "start-up timeout, train.dist_timeout_s in grt train) through torchrun's agent store"
            )
        time.sleep(_POLL_S)


def init_distributed(timeout_s: float = 600) -> DistInfo:
    """Start the process group (idempotent) and return this process's `DistInfo`.

    Raises RendezvousError (a ConfigError: one line, exit 2) when rank 0 cannot listen on
    MASTER_PORT or another rank cannot reach rank 0's store within `timeout_s`."""
    global _INFO
    import torch
    import torch.distributed as dist

    if _INFO is not None and dist.is_initialized():
        return _INFO
    info = discover()
    if info.launcher == "mpi" and not info.master_addr:
        info.master_addr = _mpi_master_addr()
    if not dist.is_initialized():
        if info.launcher == "single" and info.world_size == 1 and not os.environ.get("MASTER_PORT"):
            info.master_addr, info.master_port = "127.0.0.1", 0  # the store's server takes a free port itself
        _open_store(info, timeout_s)
    os.environ.update(
        {
            "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(info.master_port),
            "RANK": str(info.rank),
            "LOCAL_RANK": str(info.local_rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_WORLD_SIZE": str(info.local_world_size),
            "LOCAL_SIZE": str(info.local_world_size),
            "NODE_RANK": str(info.node_rank),
        }
    )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(info.local_rank % max(1, torch.cuda.device_count()))
    else:
        # With LOCAL_SIZE == world size, DeepSpeed's CPU backend routes all_reduce through its
        # shared-memory op, whose OpenMP pool (a second libgomp beside torch's) spins after
        # every call and takes a core from the training threads: ZeRO-1/2 steps ran 3-7x
        # slower on 2 cores. Without LOCAL_SIZE it uses gloo, and leaves no /dev/shm buffer.
        os.environ.pop("LOCAL_SIZE", None)
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(
            dist_backend="nccl" if use_cuda else "gloo",
            auto_mpi_discovery=False,
            distributed_port=info.master_port,
            verbose=False,
            timeout=timedelta(seconds=timeout_s),
            rank=info.rank,
            world_size=info.world_size,
        )
    _INFO = info
    return info


def get_info() -> DistInfo:
    """The `DistInfo` of `init_distributed()`, or `discover()` before it ran."""
    return _INFO if _INFO is not None else discover()


def is_main() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover
        pass
    return get_info().rank == 0


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
        super().__init__("; ".join(f"{_ranks(ranks)} failed: {text}" for text, ranks in by_text.items()))
        self.errors, self.code = errors, code


def _ranks(ranks: list[int]) -> str:
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


@dataclass
class Dist:
    """Where this process stands in a sharded evaluation: rank `rank` of `world` takes every
    world-th item (`shard`); the sums are then combined with `all_reduce`."""

    rank: int = 0
    world: int = 1

    def shard(self, items: list[_T]) -> list[_T]:
        return items[self.rank :: self.world]


def join_launch() -> Dist:
    """The process group of a launcher (torchrun, deepspeed, srun, mpirun), one rank
    included, so that a one-rank launch makes the collectives of a multi-rank one; a lone
    process (no launcher) makes none."""
    if discover().launcher == "single":
        return Dist()
    info = init_distributed()
    return Dist(info.rank, info.world_size)


def _group_exists() -> bool:
    # without importing torch: `grt presets` and the data commands never load it
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


# Seconds exit_process waits for the process group to shut down (NCCL's destroy can wait
# forever on work still in flight) before it ends the process anyway.
EXIT_GRACE_S = 10.0


def exit_process(code: int) -> int:
    """The one exit path of a process that created a process group: shut the group down
    (waiting at most EXIT_GRACE_S), finalize MPI, flush, and end the process here with
    `code`. At interpreter exit the group's communication threads are still joinable, and
    C++ destroys them ("terminate called without an active exception", exit -6), which
    hides the real exit code from the launcher. Without a process group: returns `code`."""
    import threading

    if not _group_exists():
        return code
    import torch.distributed as dist

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone; the exit code is what matters
            pass

    shutdown = threading.Thread(target=destroy, name="grt-exit", daemon=True)
    shutdown.start()
    shutdown.join(EXIT_GRACE_S)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # mpirun counts a rank that exits without MPI_Finalize as failed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code(err: BaseException) -> int:
    if isinstance(err, SystemExit):
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        print(err.code, file=sys.stderr)
        return 1
    if isinstance(err, KeyboardInterrupt):
        return 130
    traceback.print_exception(err)
    return 1


def run_command(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's `main(argv)` as the process entry (the `grt` dispatcher, and every
    `python -m` module that may start a process group): its exit code, exception included,
    goes through exit_process, so no command can forget it. Without a process group it
    returns the code (or lets the exception through), so in-process callers are unaffected;
    a RendezvousError that a command does not catch itself becomes its one line and exit 2."""
    try:
        code = main(argv) or 0
    except RendezvousError as err:  # a command that lets it through (the probe): still one line, exit 2
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except BaseException as err:  # noqa: BLE001 - the process ends here with its exit code
        if not _group_exists():
            raise
        code = _exit_code(err)
    return exit_process(code)
