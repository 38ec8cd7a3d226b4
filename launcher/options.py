"""The launch options after defaults, hostfile and environment are applied (`Resolved`, made by
`cli.resolve`): what every builder (builders.py) reads to make its `Plan`."""

from __future__ import annotations

import argparse
import os
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from launcher.envvars import SECRET
from launcher.hosts import Host


@dataclass
class Resolved:
    """The launch options after defaults, hostfile and environment are applied (built by `resolve`)."""

    args: argparse.Namespace
    environ: dict[str, str]
    hostfile: str | None  # the hostfile `hosts` were read from, None when they were not
    hosts: list[Host] | None  # with the slots of each; None: this machine only, or the scheduler's choice
    nodes: int
    gpus: int  # per node
    procs: int  # ranks per node
    world_size: int
    master_addr: str
    master_port: int | None
    entry_module: str
    entry_args: list[str]
    config: dict[str, Any] | None  # the resolved run config, when the entry is `grt train`
    ds_config: dict[str, Any] | None  # its merged DeepSpeed config, checked before anything starts
    config_path: str | None  # where the run config is written for the ranks
    run_dir: str
    launch_dir: str
    train_args: list[str]  # the entry's arguments after entry_args
    python: str
    env: dict[str, str]  # the environment of every rank
    elastic: tuple[int, int] | None  # --elastic MIN:MAX (nodes), None without
    max_restarts: int  # torchrun --max-restarts of an elastic launch

    def rank_argv(self) -> list[str]:
        """The per-rank program after `python`: -m MODULE ARGS..."""
        return ["-m", self.entry_module] + self.entry_args + self.train_args

    def record(self, argv: Sequence[str]) -> dict[str, object]:
        return {
            "grt_launch_argv": [
                re.sub(r"^([^=]+)=.*", r"\1=<redacted>", a) if SECRET.search(a.split("=", 1)[0]) and "=" in a else a
                for a in argv
            ],
            "train_args": self.train_args,
            "entry": [self.entry_module] + self.entry_args,
            "nodes": self.nodes,
            "procs_per_node": self.procs,
            "gpus_per_node": self.gpus,
            "world_size": self.world_size,
            "hosts": [h for h, _ in self.hosts] if self.hosts else None,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "elastic": None
            if self.elastic is None
            else {"nodes": list(self.elastic), "max_restarts": self.max_restarts},
            "config": self.config_path,
            "rank_env": {k: ("<redacted>" if SECRET.search(k) else v) for k, v in self.env.items()},
            "launch_host": socket.gethostname(),
            "cwd": os.getcwd(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
