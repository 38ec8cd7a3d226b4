"""`grt launch`: start `grt train` on one machine or a cluster with the same command.

    grt launch [--launcher local|deepspeed|slurm|mpi] [--nodes N] [--gpus-per-node G]
               [--hostfile FILE | --hosts a,b,...] [--dry-run] [launcher options] -- <grt train args>

Everything after `--` (and any argument `grt launch` does not know) is handed to
`grt train` on every rank unchanged.  The per-rank program is
`python -m pretrain.cli train <args>` (`--entry` changes it, e.g. `--entry launcher.probe`
to check a cluster's rank discovery and collectives without training).

`--elastic MIN:MAX` runs torchrun's elastic agent instead (the same command on every node, in
`<run dir>/launch/elastic.sh`): a lost rank or node restarts the worker group, which resumes.

`--dry-run` prints the files the launch would write (hostfile, `.deepspeed_env`, the sbatch
script, elastic.sh) and the exact command line, and runs nothing.  Otherwise the files go to the run
directory (`--run-dir`, else the train `--out` directory, else `runs/launch-<time>`) along
with `launch.json` (the command and environment), and the command runs in the foreground
(Slurm: the script is submitted with `sbatch`).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from launcher import builders
from launcher.envvars import DEFAULT_EXPORT_PREFIXES, SECRET
from launcher.hosts import Host, env_hostfile, parse_hosts, read_hostfile, slurm_allocation_hosts
from launcher.options import Resolved
from launcher.plan import Plan

LAUNCHERS = ("local", "deepspeed", "slurm", "mpi")
# DeepSpeed's "slurm" backend is left out: it cannot start a module (`--launcher slurm` writes
# an sbatch script with srun instead)
DS_LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi")
DEFAULT_ENTRY = "pretrain.cli train"
DEFAULT_RESTARTS = 3  # torchrun --max-restarts of an elastic launch


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where there is one (None, False and [] say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grt launch",
        description="Start `grt train` locally, with the deepspeed runner, under Slurm or under "
        "MPI. Arguments after `--` (and unknown ones) go to `grt train` on every rank.",
        formatter_class=_Formatter,
        allow_abbrev=False,  # `--out` is grt train's, not an abbreviation of `--output`
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="local: one process, or torchrun for several on this machine; deepspeed: "
        "the deepspeed runner; slurm: an sbatch script with srun; mpi: mpirun",
    )
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: hosts in the hostfile, else 1)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node; one rank per GPU (default: hostfile slots, else 0 on a machine without CUDA)",
    )
    p.add_argument(
        "--procs-per-node",
        type=int,
        default=None,
        help="ranks per node (default: --gpus-per-node, else 1); on CPU this is the number of processes",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="CPU ranks: no GPU request, CUDA_VISIBLE_DEVICES empty (a Slurm job needs this or --gpus-per-node)",
    )
    p.add_argument(
        "--hostfile", default=None, help="hostfile ('host slots=N' lines); default $GRT_HOSTFILE or $DLTS_HOSTFILE"
    )
    p.add_argument(
        "--hosts",
        default=None,
        help="comma-separated host names instead of a hostfile (Slurm ranges allowed: "
        "node[01-04]); inside a Slurm allocation its nodes are used by default",
    )
    p.add_argument(
        "--master-addr", default=None, help="rendezvous address (default: $MASTER_ADDR, else the first host)"
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port (default: $MASTER_PORT, else 29500; Slurm: derived from the job id)",
    )
    p.add_argument("--node-rank", type=int, default=None, help="deepspeed --no-ssh: this node's index in the hostfile")
    p.add_argument(
        "--no-ssh",
        action="store_true",
        help="deepspeed: start only this node's ranks (run once per node with --node-rank), no pdsh/ssh",
    )
    p.add_argument(
        "--rank-logs",
        action="store_true",
        help="also write each rank's output to RUN_DIR/logs/ (deepspeed: --enable_each_rank_log, "
        "slurm: srun --output, mpi: --output-filename, local: torchrun --log-dir)",
    )
    e = p.add_argument_group("elastic (torchrun's elastic agent; docs/launching.md, Elastic runs)")
    e.add_argument(
        "--elastic",
        default=None,
        metavar="MIN:MAX",
        help="local: run under torchrun's elastic agent on MIN to MAX nodes (N: N:N), the same command on "
        "every node (<run dir>/launch/elastic.sh); a failed rank or a lost node restarts the worker group, "
        "which resumes from the newest complete checkpoint (--resume is always added); slurm: ask for MIN-MAX "
        "nodes, so that a requeued job starts on those that are free",
    )
    e.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help=f"with --elastic (local): how many times torchrun restarts the worker group (default {DEFAULT_RESTARTS})",
    )
    e.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="with --elastic (local): torchrun's --rdzv-conf, e.g. last_call_timeout=10,keep_alive_interval=2",
    )
    d = p.add_argument_group("deepspeed runner")
    d.add_argument(
        "--ds-launcher",
        choices=DS_LAUNCHERS,
        default="pdsh",
        help="the runner's multi-node backend (--launcher of `deepspeed`; for Slurm use --launcher slurm)",
    )
    d.add_argument("--launcher-args", default="", help="extra arguments for the runner's backend (--launcher_args)")
    d.add_argument("--include", default=None, help="deepspeed --include, e.g. 'node1:0,1@node2'")
    d.add_argument("--exclude", default=None, help="deepspeed --exclude, e.g. 'node3'")
    d.add_argument("--ssh-port", type=int, default=None, help="deepspeed --ssh_port")
    d.add_argument(
        "--no-ssh-check", action="store_true", help="deepspeed --no_ssh_check: skip the runner's passwordless-ssh test"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for every rank (repeatable)",
    )
    p.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="PREFIX",
        help="also pass variables starting with PREFIX from this environment to "
        "every rank (NCCL_, UCX_, FI_, GRT_, ... always are)",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="where the launch files go (default: the train --out directory, else runs/launch-<time>)",
    )
    p.add_argument("--entry", default=DEFAULT_ENTRY, help="per-rank python module and its leading arguments")
    p.add_argument(
        "--no-resolve",
        action="store_true",
        help="hand the train arguments to every rank as they are, instead of resolving "
        "the run config here once and handing every rank --config-json",
    )
    p.add_argument(
        "--no-auto-resume",
        action="store_true",
        help="slurm: do not add --resume (by default a Slurm job resumes from the newest "
        "checkpoint in --out, so that a requeued or resubmitted job continues)",
    )
    p.add_argument(
        "--python", default=None, help="python on the nodes (default: this interpreter; 'python' in a container)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the files and the command, run nothing")
    s = p.add_argument_group("slurm")
    s.add_argument("--job-name", default="grt", help="job name")
    s.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    s.add_argument("--account", default=None, help="account to charge")
    s.add_argument("--qos", default=None, help="quality of service")
    s.add_argument("--time", default=None, help="time limit, e.g. 24:00:00")
    s.add_argument("--cpus-per-task", type=int, default=None, help="CPUs for each rank")
    s.add_argument("--mem", default=None, help="memory per node, e.g. 0 for all")
    s.add_argument("--exclusive", action="store_true", help="whole nodes only")
    s.add_argument("--output", default=None, help="job log path (default RUN_DIR/slurm-%%j.out)")
    s.add_argument(
        "--signal",
        default="USR1@120",
        help="pre-emption warning: SIG@SECONDS before the time limit, sent to the batch "
        "script, which forwards it to the ranks ('' for none)",
    )
    s.add_argument(
        "--requeue",
        action="store_true",
        help="requeue the job after a pre-emption signal led to a checkpoint (and let "
        "Slurm requeue it on node failure/pre-emption)",
    )
    s.add_argument(
        "--container-image",
        default=None,
        help="run the ranks in this image through pyxis/enroot (srun --container-image)",
    )
    s.add_argument(
        "--container-mounts",
        default=None,
        help="container mounts (default: the working directory, the run directory, the "
        "data's manifest, shards and tokenizer, and the DeepSpeed file's directory)",
    )
    s.add_argument(
        "--host-code",
        action="store_true",
        help="containers: run this checkout's code (mounted, on PYTHONPATH) instead of the image's",
    )
    s.add_argument(
        "--apptainer", default=None, metavar="IMAGE", help="run the ranks with `apptainer exec --nv IMAGE` instead"
    )
    s.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        help="extra '#SBATCH' option, e.g. --sbatch-arg=--constraint=h100 (repeatable)",
    )
    s.add_argument("--srun-arg", action="append", default=[], help="extra srun option (repeatable)")
    s.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends")
    m = p.add_argument_group("mpi")
    m.add_argument("--mpirun", default="mpirun", help="the mpirun program")
    m.add_argument("--mpirun-args", default="", help="extra mpirun arguments")
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


class LaunchError(SystemExit):
    """A launch refused before anything runs: `main` prints `grt launch: <message>` and exits with `code`.

    `code` is each refusal's exit status as it always was: 1 for the hosts, --entry and --env, 2 for
    the rest. A SystemExit, so that a caller of `build_plan` that does not catch it exits instead of
    going on without a plan.
    """

    code: int

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def resolve(args: argparse.Namespace, train_args: list[str], environ: dict[str, str]) -> Resolved:
    """Apply defaults, the hostfile and the environment to the launch options, one step at a time."""
    check_values(args, environ)
    elastic = elastic_nodes(args)
    listed_hosts, hostfile = _listed_hosts(args, environ)
    gpus = _gpus_per_node(args, listed_hosts, hostfile is not None)
    procs = args.procs_per_node or gpus or 1
    nodes, hosts = _nodes(args, listed_hosts, procs)
    if elastic is not None:
        nodes = elastic[1]  # the config and the DeepSpeed file are checked for the largest group
    if args.node_rank is not None and args.node_rank >= nodes:
        raise LaunchError(f"--node-rank {args.node_rank}: must be below the number of nodes ({nodes}): 0..{nodes - 1}")
    world_size = nodes * procs
    master_addr, master_port = _master(args, environ, hosts, nodes)
    if elastic is not None and args.launcher == "local" and not (args.master_addr or environ.get("MASTER_ADDR")):
        master_addr = socket.gethostname()  # the rendezvous: this node, by a name the other nodes resolve
    entry_module, entry_args = _entry(args.entry)
    is_train = [entry_module, *entry_args] == DEFAULT_ENTRY.split()
    config, ds_config, resume = None, None, False
    out = _train_out_dir(train_args)
    only_prints = {"-h", "--help", "--print-config", "--print-ds-config"} & set(train_args)
    if is_train and not args.no_resolve and not only_prints:
        on_this_host = hosts is None and args.launcher != "slurm" and elastic is None
        config, resume = resolve_train_config(train_args, world_size if on_this_host else 0)
        ds_config = checked_ds_config(config, world_size, use_cuda=gpus > 0)
        out = config["out"]
    if (args.launcher == "slurm" or elastic is not None) and is_train and not args.no_auto_resume:
        resume = True  # a requeued job, a restarted worker group: continue from the newest checkpoint
    run_dir = args.run_dir or out or os.path.join("runs", time.strftime("launch-%Y%m%d-%H%M%S"))
    launch_dir = os.path.join(os.path.abspath(run_dir), "launch")
    config_path = None if config is None else os.path.join(launch_dir, "config.json")
    container = args.container_image or args.apptainer
    return Resolved(
        args=args,
        environ=environ,
        hostfile=hostfile,
        hosts=hosts,
        nodes=nodes,
        gpus=gpus,
        procs=procs,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        entry_module=entry_module,
        entry_args=entry_args,
        config=config,
        ds_config=ds_config,
        config_path=config_path,
        run_dir=run_dir,
        launch_dir=launch_dir,
        train_args=_rank_train_args(train_args, config_path, resume),
        python=args.python or ("python" if container else sys.executable),
        env=_rank_env(args, environ, gpus, procs),
        elastic=elastic,
        max_restarts=DEFAULT_RESTARTS if args.max_restarts is None else args.max_restarts,
    )


# (flag, smallest, largest or None): the numeric launch flags; a value outside is refused before anything
NUMBER_FLAGS = (
    ("nodes", 1, None),
    ("gpus_per_node", 0, None),
    ("procs_per_node", 1, None),
    ("master_port", 1, 65535),
    ("node_rank", 0, None),
    ("ssh_port", 1, 65535),
    ("cpus_per_task", 1, None),
    ("max_restarts", 0, None),
)
SLURM_TIME = re.compile(r"^(?:\d+-\d+|\d+)(?::\d+){0,2}$|^(?:INFINITE|UNLIMITED)$", re.IGNORECASE)
SLURM_MEM = re.compile(r"^\d+[KMGT]?B?$", re.IGNORECASE)


def check_values(args: argparse.Namespace, environ: dict[str, str]) -> None:
    """Every numeric launch option in range, before any host, file or process: one line (exit 2)
    naming the flag, its value and what is accepted."""
    for name, least, most in NUMBER_FLAGS:
        value = getattr(args, name)
        if value is not None and (value < least or (most is not None and value > most)):
            accepted = f"{least}..{most}" if most is not None else f">= {least}"
            raise LaunchError(f"--{name.replace('_', '-')} {value}: must be {accepted}")
    port = environ.get("MASTER_PORT")
    if args.master_port is None and port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise LaunchError(f"MASTER_PORT={port!r} in the environment: must be a port number, 1..65535")
    if args.time is not None and not SLURM_TIME.match(args.time):
        raise LaunchError(
            f"--time {args.time!r}: a Slurm time limit: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
            "D-HH:MM:SS or UNLIMITED"
        )
    if args.mem is not None and not SLURM_MEM.match(args.mem):
        raise LaunchError(f"--mem {args.mem!r}: a Slurm memory size per node: a whole number, optionally K, M, G or T")
    if args.signal:
        _check_signal(args.signal)


def _check_signal(spec: str) -> None:
    """--signal: [R:|B:]SIG[@SECONDS], as `sbatch --signal` takes it (seconds 0..65535)."""
    body = spec.split(":", 1)[1] if ":" in spec else spec
    name, _, seconds = body.partition("@")
    known = name.isdigit() and 1 <= int(name) <= 64
    known = known or f"SIG{name.upper().removeprefix('SIG')}" in signal.Signals.__members__
    prefix_ok = ":" not in spec or spec.split(":", 1)[0].upper() in ("R", "B", "RB", "BR")
    if not (known and prefix_ok and (not seconds or (seconds.isdigit() and int(seconds) <= 65535))):
        raise LaunchError(
            f"--signal {spec!r}: expected [B:]SIGNAL[@SECONDS] (a signal name or number, seconds 0..65535), "
            "e.g. USR1@120, or '' for none"
        )


ELASTIC = re.compile(r"^\s*(-?\d+)\s*(?::\s*(-?\d+)\s*)?$")
# why --elastic does not go with a launcher: mpirun and the deepspeed runner end the job when a rank dies
ELASTIC_REFUSED = {
    "mpi": "mpirun ends the whole job when a rank dies and cannot restart it",
    "deepspeed": "the deepspeed runner ends the whole job when a rank dies and cannot restart it",
}


def elastic_nodes(args: argparse.Namespace) -> tuple[int, int] | None:
    """--elastic MIN:MAX (or N) as (MIN, MAX), checked with the options it goes with; None without.
    Every refusal is one line (exit 2)."""
    if args.elastic is None:
        for flag, value in (("--max-restarts", args.max_restarts), ("--rdzv-conf", args.rdzv_conf)):
            if value is not None:
                raise LaunchError(f"{flag} goes with --elastic (torchrun's elastic agent)")
        return None
    m = ELASTIC.match(args.elastic)
    if m is None:
        raise LaunchError(
            f"--elastic {args.elastic!r}: expected MIN:MAX, whole numbers of nodes (e.g. 1:4), or N for N:N"
        )
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    if low < 1:
        raise LaunchError(f"--elastic {args.elastic}: MIN must be at least 1 node, not {low}")
    if low > high:
        raise LaunchError(f"--elastic {args.elastic}: MIN ({low}) is above MAX ({high})")
    if args.launcher in ELASTIC_REFUSED:
        raise LaunchError(
            f"--elastic with --launcher {args.launcher}: {ELASTIC_REFUSED[args.launcher]}; use --launcher local "
            "(torchrun's elastic agent on every node) or --launcher slurm (a requeue on MIN to MAX nodes)"
        )
    hosts_why = (
        "Slurm would need every node of --hosts (--nodelist)"
        if args.launcher == "slurm"
        else "every node runs the same command; name the rendezvous host with --master-addr"
    )
    refused = [
        (args.nodes is not None, "--elastic and --nodes exclude each other: MIN:MAX is the node count"),
        (args.hosts is not None, f"--elastic and --hosts exclude each other: {hosts_why}"),
        (args.hostfile is not None, f"--elastic and --hostfile exclude each other: {hosts_why}"),
        (
            args.no_auto_resume,
            "--elastic and --no-auto-resume exclude each other: a restarted worker group must resume from the "
            "newest checkpoint",
        ),
    ]
    if args.launcher == "slurm":
        for flag, value in (("--max-restarts", args.max_restarts), ("--rdzv-conf", args.rdzv_conf)):
            refused.append(
                (
                    value is not None,
                    f"{flag} with --launcher slurm: a Slurm job is restarted by a requeue (--requeue), "
                    "not by torchrun's agent",
                )
            )
    for given, message in refused:
        if given:
            raise LaunchError(message)
    return low, high


def _listed_hosts(args: argparse.Namespace, environ: dict[str, str]) -> tuple[list[Host] | None, str | None]:
    """The hosts named by --hosts, a hostfile or (deepspeed, mpi) a Slurm allocation of several nodes, with
    their slots (0: not given), and the hostfile they were read from; (None, None) when none are named."""
    hostfile = args.hostfile or (env_hostfile(environ) if args.launcher in ("deepspeed", "mpi") else None)
    if args.hosts:
        return [(h, 0) for h in parse_hosts(args.hosts)], None
    if hostfile and os.path.isfile(hostfile):
        return read_hostfile(hostfile), hostfile
    if args.hostfile:
        raise LaunchError(f"hostfile {args.hostfile} does not exist", code=1)
    allocation = slurm_allocation_hosts(environ) if args.launcher in ("deepspeed", "mpi") else None
    if allocation and len(allocation) > 1:
        return [(h, 0) for h in allocation], None
    return None, None


def _gpus_per_node(args: argparse.Namespace, hosts: list[Host] | None, from_hostfile: bool) -> int:
    """--gpus-per-node, else the hostfile's slots, else this machine's GPUs (none for Slurm)."""
    if args.cpu and args.gpus_per_node:
        raise LaunchError("--cpu and --gpus-per-node exclude each other")
    if args.cpu:
        return 0
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    if hosts and from_hostfile:
        return hosts[0][1]
    return _local_gpu_count() if args.launcher != "slurm" else 0


def _nodes(args: argparse.Namespace, hosts: list[Host] | None, procs: int) -> tuple[int, list[Host] | None]:
    """The number of nodes, and the hosts used (the first that many; `procs` slots where none were given)."""
    nodes: int = args.nodes or (len(hosts) if hosts else 1)
    if hosts is not None:
        if len(hosts) < nodes:
            raise LaunchError(f"--nodes {nodes} but only {len(hosts)} hosts given", code=1)
        return nodes, [(h, s or procs) for h, s in hosts[:nodes]]
    if nodes > 1 and args.launcher in ("deepspeed", "mpi"):
        raise LaunchError(f"{nodes} nodes need --hostfile or --hosts (or a Slurm allocation)", code=1)
    return nodes, None


def _master(
    args: argparse.Namespace, environ: dict[str, str], hosts: list[Host] | None, nodes: int
) -> tuple[str, int | None]:
    """The rendezvous address and port (None: the launcher's default)."""
    addr = args.master_addr or environ.get("MASTER_ADDR") or (hosts[0][0] if hosts and nodes > 1 else "127.0.0.1")
    port = args.master_port or environ.get("MASTER_PORT")
    return addr, int(port) if port else None


def _entry(text: str) -> tuple[str, list[str]]:
    """--entry: the per-rank module and its leading arguments."""
    words = shlex.split(text)
    if not words:
        raise LaunchError("--entry is empty", code=1)
    return words[0], words[1:]


def _train_out_dir(train_args: Sequence[str]) -> str | None:
    for i, a in enumerate(train_args):
        for flag in ("--out", "--out-dir", "--output-dir"):
            if a == flag and i + 1 < len(train_args):
                return train_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def _rank_train_args(train_args: list[str], config_path: str | None, resume: bool) -> list[str]:
    """What every rank's entry gets after its own arguments: the resolved config's path, else the arguments
    given; --resume added when the launch resumes."""
    if config_path is not None:
        return ["--config-json", config_path] + (["--resume"] if resume else [])
    if resume and "--resume" not in train_args:
        return train_args + ["--resume"]
    return train_args


def _rank_env(args: argparse.Namespace, environ: dict[str, str], gpus: int, procs: int) -> dict[str, str]:
    prefixes = tuple(DEFAULT_EXPORT_PREFIXES) + tuple(args.export)
    env = {k: v for k, v in sorted(environ.items()) if k.startswith(prefixes) and not SECRET.search(k)}
    if args.cpu:  # the ranks must not pick up a GPU the node happens to have
        env["CUDA_VISIBLE_DEVICES"] = ""
    if not gpus and procs > 1 and "OMP_NUM_THREADS" not in env:
        # CPU ranks: share this machine's cores instead of each taking all of them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // procs))
    env.update(_parse_env(args.env))
    return env


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        if "=" not in pair:
            raise LaunchError(f"--env expects KEY=VALUE, got {pair!r}", code=1)
        k, v = pair.split("=", 1)
        env[k] = v
    return env


def resolve_train_config(train_args: Sequence[str], local_world_size: int = 0) -> tuple[dict[str, Any], bool]:
    """Resolve `grt train` arguments into one complete run config, once, on this host.

    Like GPT-NeoX, the merged config (preset, model JSON, flags, --set overrides) is built
    here and every rank gets the same file through --config-json.  Paths in it are made
    absolute so that every node reads the same files whatever its working directory.
    Returns (config dict, whether --resume or --branch-from was given: a decay branch's ranks each
    make its checkpoint, pretrain/training/branch.py).  local_world_size > 0: the ranks run on
    this host, so their start is planned here, once, before any rank starts (start.py: the data,
    the checkpoint to resume, the budget, every refusal); the config is the plan's.
    """
    from pretrain.config import ConfigError
    from pretrain.runs.run_config import absolute, data_paths, load_manifest, resolve, with_data_paths
    from pretrain.train import build_parser as train_parser
    from pretrain.train import config_from_args
    from pretrain.training.ds_config import resolve_ds_path

    try:
        targs = train_parser().parse_args(list(train_args))
    except SystemExit as e:
        raise LaunchError(f"grt train arguments rejected: {' '.join(train_args)}") from e
    try:
        cfg = config_from_args(targs)
        resume = bool(targs.resume or cfg.branch_from)
        if local_world_size and cfg.data:
            from pretrain.training.start import plan_start, say

            plan = plan_start(cfg, resume, local_world_size)
            if plan.nothing_to_do:  # a finished run: no rank is started, nothing is written (exit 0)
                raise LaunchError(plan.nothing_to_do, code=0)
            for line in plan.notes:  # what the start changes in the config given (the ranks get the plan's)
                say(line)
            if plan.resume is not None:  # what the resume changes, said here as the ranks will
                for line in plan.resume_lines(plan.resume.tag, [], plan.resume.notes):
                    say(line)
            cfg = plan.cfg
        elif cfg.data and all(os.path.isfile(p) for p in data_paths(cfg.data)):
            # the checks that need the data (vocabulary and context follow the tokenizer);
            # skipped when the manifest is only visible from the cluster's nodes
            notes: list[str] = []
            cfg = resolve(cfg, load_manifest(cfg.data), notes)
            for line in notes:
                print(f"grt launch: {line}", file=sys.stderr)
        config = cfg.to_dict()
        config["data"] = with_data_paths(config["data"], absolute) if config["data"] else ""
    except ConfigError as e:
        raise LaunchError(f"run config: {e}") from e
    config["out"] = absolute(config["out"]) if config["out"] else ""
    config["ds_config"] = os.path.abspath(resolve_ds_path(config["ds_config"]))
    return config, resume


def checked_ds_config(config: dict[str, Any], world_size: int, use_cuda: bool) -> dict[str, Any]:
    """The DeepSpeed config every rank will build, merged and checked once, here (with the
    checkpointing mode it allows, so that a refusal is one line, not one per rank)."""
    from pretrain.config import ConfigError
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.ds_config import merged_ds_config, zero_stage
    from pretrain.training.parallelize import check_checkpointing

    try:
        cfg = RunConfig.from_dict(config)
        ds = merged_ds_config(cfg, world_size, use_cuda)
        check_checkpointing(cfg.train.activation_checkpointing, zero_stage(ds))
        return ds
    except ConfigError as e:
        raise LaunchError(f"run config: {e}") from e


def _local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover
        return 0


def build_plan(argv: Sequence[str], environ: dict[str, str] | None = None) -> tuple[Plan, argparse.Namespace]:
    own, train_args = split_argv(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(own)
    train_args = unknown + train_args
    environ = dict(os.environ if environ is None else environ)
    r = resolve(args, train_args, environ)
    plan = builders.BUILDERS[args.launcher](r)
    if r.config_path is not None:
        import json

        ds_path = os.path.join(r.launch_dir, "ds_config.json")
        plan.files = {
            r.config_path: json.dumps(r.config, indent=2) + "\n",
            ds_path: json.dumps(r.ds_config, indent=2) + "\n",
            **plan.files,
        }
    plan.run_dir = r.launch_dir
    plan.record = r.record(argv)
    return plan, args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan, args = build_plan(argv)
    except (LaunchError, ValueError, OSError) as e:  # the builders refuse with ValueError
        print(f"grt launch: {e}", file=sys.stderr)
        return e.code if isinstance(e, LaunchError) else 2
    if args.dry_run:
        sys.stdout.write(plan.render())
        return 0
    plan.write_files()
    print(f"grt launch: {plan.summary}\ngrt launch: {plan.shell_command()}", flush=True)
    return plan.execute()


if __name__ == "__main__":
    sys.exit(main())
