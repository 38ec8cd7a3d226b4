"""Ranks and the process group, for every way `grt` is launched, by concern:

- discovery.py: who this process is, from the launcher's environment alone (`discover`);
- rendezvous.py: the process group's start and the store the ranks meet at (`init_distributed`);
- collectives.py: every collective of the project (`all_reduce`, `all_agree`, `check_ranks`:
  every rank stops when one failed), on tensors made on `comm_device()`;
- error_boundary.py: every command's error boundary (`run_command`) and the one exit path of a
  process that started a group (`exit_process`).

Nothing else calls a collective or starts a group (docs/gpu.md says why). Import the names from
here: `from pretrain.distributed import init_distributed`.
"""

from pretrain.distributed.collectives import (
    ERROR_BYTES,
    Dist,
    RankFailed,
    all_agree,
    all_reduce,
    barrier,
    bus_bandwidth,
    check_ranks,
    comm_device,
    gather_floats,
    gather_text,
    ranks_text,
    ranks_with,
)
from pretrain.distributed.discovery import (
    DEFAULT_MASTER_PORT,
    DistInfo,
    RendezvousError,
    discover,
    expand_nodelist,
    parse_tasks_per_node,
)
from pretrain.distributed.error_boundary import EXIT_GRACE_S, exit_process, run_command
from pretrain.distributed.rendezvous import get_info, init_distributed, is_main, join_launch, open_store, reach_store

__all__ = [
    "DEFAULT_MASTER_PORT",
    "ERROR_BYTES",
    "EXIT_GRACE_S",
    "Dist",
    "DistInfo",
    "RankFailed",
    "RendezvousError",
    "all_agree",
    "all_reduce",
    "barrier",
    "bus_bandwidth",
    "check_ranks",
    "comm_device",
    "discover",
    "exit_process",
    "expand_nodelist",
    "gather_floats",
    "gather_text",
    "get_info",
    "init_distributed",
    "is_main",
    "join_launch",
    "open_store",
    "parse_tasks_per_node",
    "ranks_text",
    "ranks_with",
    "reach_store",
    "run_command",
]
