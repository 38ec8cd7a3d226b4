"""Who this process is, from its environment alone, whichever launcher started it (`discover()`):

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
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import overload

from grt_common.errors import ConfigError

DEFAULT_MASTER_PORT = 29500


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


@functools.cache
def _mpi_identity() -> tuple[int, int, int, int, str]:
    """(rank, world, local rank, local world, rank 0's host) from MPI, asked once per process: the
    questions are collectives of every rank, so a later discover() on one rank alone (rank 0's
    start line, pretrain/say.py) must not ask again (it waited for the other ranks forever)."""
    from mpi4py import MPI  # noqa: WPS433 (optional dependency)

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    rank = comm.Get_rank()
    host = comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
    return rank, comm.Get_size(), local.Get_rank(), local.Get_size(), host


def _from_mpi4py(env: Mapping[str, str]) -> DistInfo:
    """PMI/PMIx-only environments (MPICH, Intel MPI, srun --mpi=pmix): ask MPI itself."""
    rank, world, local_rank, local_world, host = _mpi_identity()
    addr = env.get("MASTER_ADDR") or host
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
