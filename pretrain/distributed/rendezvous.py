"""The process group's start (`init_distributed`) and the rendezvous before it.

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
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from pretrain.distributed.collectives import Dist, ranks_text
from pretrain.distributed.discovery import DistInfo, RendezvousError, discover

if TYPE_CHECKING:
    import torch

_INFO: DistInfo | None = None
# Rank 0's rendezvous store server, kept for the life of the process (see open_store)
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


def reach_store(info: DistInfo, timeout_s: float, whose: str = "rank 0's store") -> None:
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


def open_store(info: DistInfo, timeout_s: float) -> None:
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
        reach_store(info, timeout_s)
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
    reach_store(info, timeout_s, whose="torchrun's agent store")
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
    reach_store(info, max(1.0, deadline - time.monotonic()))


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
                f"rank 0: {ranks_text(sorted(pending))} of this worker group did not join within {timeout_s:g} s (the "
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
        open_store(info, timeout_s)
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

        if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
            # torch's flight recorder (read as the group starts): a hang dump's last collectives
            # (pretrain/training/report/forensics.py); torchtitan's default size; the user's, 0 = off
            os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
        deepspeed.init_distributed(
            dist_backend="nccl" if use_cuda else "gloo",
            auto_mpi_discovery=False,
            distributed_port=info.master_port,
            verbose=False,
            timeout=timedelta(seconds=timeout_s),
            rank=info.rank,
            world_size=info.world_size,
        )
        _later_groups_wait(timedelta(seconds=timeout_s))
    _INFO = info
    return info


def _later_groups_wait(timeout: timedelta) -> None:
    """Process groups made after the world's without a timeout of their own wait `timeout` too, not
    torch's default (30 min under gloo, 10 under NCCL): DeepSpeed runs ZeRO's gradient reductions
    and partition gathers in its copy of the world group (`dist.new_group(ranks)`), so a rank frozen
    before one kept the others waiting there past train.dist_timeout_s, with no hang dump and no
    stop. torch reads these two names of distributed_c10d when a group is made."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if not hasattr(c10d, name):  # torch >= 2.4 (setup.py) has both
            raise RuntimeError(f"torch {torch.__version__}: no distributed_c10d.{name} (a new group's timeout)")
        if isinstance(getattr(c10d, name), timedelta):  # the NCCL one is None in a torch without NCCL
            setattr(c10d, name, timeout)


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


def join_launch() -> Dist:
    """The process group of a launcher (torchrun, deepspeed, srun, mpirun), one rank
    included, so that a one-rank launch makes the collectives of a multi-rank one; a lone
    process (no launcher) makes none."""
    if discover().launcher == "single":
        return Dist()
    info = init_distributed()
    return Dist(info.rank, info.world_size)
