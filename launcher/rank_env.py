"""What the launchers share about a run's ranks: the outer rank variables they clear, the checkout's
root, the rank log directory, the rank environment to set and the plan's summary line."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.options import Resolved

# rank variables of an outer launcher that must not reach ranks started by mpirun or srun
# (pretrain.distributed.discover() reads RANK/WORLD_SIZE first)
OUTER_RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "CROSS_RANK",
    "CROSS_SIZE",
)
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_log_dir(r: Resolved) -> str:
    return os.path.join(os.path.abspath(r.run_dir), "logs")


def summary(r: Resolved, what: str) -> str:
    return (
        f"{what}: {r.nodes} node(s) x {r.procs} rank(s) = {r.world_size} ranks, "
        f"entry `{' '.join([r.entry_module] + r.entry_args)}`, run dir {r.run_dir}"
    )


def parse_user_env(r: Resolved) -> dict[str, str]:
    """Rank environment this process does not already have (--env, computed defaults)."""
    return {k: v for k, v in r.env.items() if r.environ.get(k) != v}
