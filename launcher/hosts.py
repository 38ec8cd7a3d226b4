"""Hostfiles (`host slots=N`, the format DeepSpeed and OpenMPI share) and node lists."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from pretrain.distributed import expand_nodelist

Host = tuple[str, int]  # (hostname, slots)


def read_hostfile(path: str) -> list[Host]:
    """Parse a DeepSpeed/OpenMPI hostfile; comments and blank lines are skipped."""
    hosts: list[Host] = []
    seen = set()
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\d+))?(?:\s+.*)?", line)
            if not m:
                raise ValueError(f"{path}:{lineno}: expected 'HOST slots=N', got {raw.strip()!r}")
            host, slots = m.group(1), int(m.group(2) or 1)
            if host in seen:
                raise ValueError(f"{path}:{lineno}: host {host!r} listed twice")
            seen.add(host)
            hosts.append((host, slots))
    if not hosts:
        raise ValueError(f"hostfile {path} names no host")
    return hosts


def format_hostfile(hosts: list[Host]) -> str:
    return "".join(f"{h} slots={s}\n" for h, s in hosts)


def parse_hosts(text: str) -> list[str]:
    """`--hosts` value: comma/space separated names, Slurm ranges allowed (node[1-4])."""
    out: list[str] = []
    for token in re.split(r"\s+", text.strip()):
        if token:
            out.extend(expand_nodelist(token))
    return out


def env_hostfile(environ: Mapping[str, str] | None = None) -> str | None:
    """A hostfile named by the environment (GRT_HOSTFILE, or DeepSpeed/GPT-NeoX's DLTS_HOSTFILE)."""
    environ = os.environ if environ is None else environ
    for name in ("GRT_HOSTFILE", "DLTS_HOSTFILE"):
        path = environ.get(name)
        if path:
            return path
    return None


def slurm_allocation_hosts(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The nodes of the Slurm allocation this command runs in, if any."""
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return expand_nodelist(nodelist) if nodelist else None
