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
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from launcher import builders
from launcher.checks import LaunchError, check_values, elastic_nodes
from launcher.envvars import DEFAULT_EXPORT_PREFIXES, SECRET
from launcher.hosts import Host, env_hostfile, parse_hosts, read_hostfile, slurm_allocation_hosts
from launcher.options import Resolved
from launcher.parser import DEFAULT_ENTRY, DEFAULT_RESTARTS, build_parser, split_argv
from launcher.plan import Plan


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
    if args.preflight or args.preflight_only:  # --preflight: this launch trains, after a --preflight-only one
        entry = _preflight_entry(args, is_train, elastic is not None)
        entry_module, entry_args = entry if args.preflight_only else (entry_module, entry_args)
    config, ds_config, resume = None, None, False
    out = _train_out_dir(train_args)
    only_prints = {"-h", "--help", "--print-config", "--print-ds-config"} & set(train_args)
    if is_train and not args.no_resolve and not only_prints:
        on_this_host = hosts is None and args.launcher != "slurm" and elastic is None
        config, resume, ds_config = resolve_train_config(train_args, world_size, gpus > 0, on_this_host)
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


def _preflight_entry(args: argparse.Namespace, is_train: bool, elastic: bool) -> tuple[str, list[str]]:
    """--preflight-only's entry: every rank runs launcher/preflight.py on the resolved config."""
    from grt_common.errors import ConfigError
    from launcher.preflight import parse_limits

    if not is_train or args.no_resolve:
        raise LaunchError(
            "--preflight checks a grt train launch on its resolved config: not with --entry or --no-resolve"
        )
    if args.preflight and (args.launcher == "slurm" or elastic):
        raise LaunchError(
            "--preflight runs the check, then training, from here: under Slurm or --elastic launch "
            "--preflight-only first (with --wait under Slurm), then the run"
        )
    try:
        parse_limits(args.preflight_limits)
    except ConfigError as err:
        raise LaunchError(str(err)) from None
    return "launcher.preflight", ["--limits", args.preflight_limits] if args.preflight_limits else []


def _preflight_first(argv: list[str]) -> int:
    """--preflight: the check as a launch of its own (its processes end before training's start, which
    takes the run directory's lock and the process group afresh); its verdict, 0 when it passed."""
    own, train_args = split_argv(argv)
    check, _ = build_plan(["--preflight-only" if a == "--preflight" else a for a in own] + ["--", *train_args])
    check.write_files()
    print(f"grt launch: the pre-flight check first: {check.shell_command()}", flush=True)
    return check.execute()


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


def resolve_train_config(
    train_args: Sequence[str], world_size: int = 1, use_cuda: bool = False, on_this_host: bool = True
) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """Resolve `grt train` arguments into one complete run config, once, on this host.

    Like GPT-NeoX, the merged config (preset, model JSON, flags, --set overrides) is built
    here and every rank gets the same file through --config-json.  Paths in it are made
    absolute so that every node reads the same files whatever its working directory.
    Returns (config dict, whether --resume or --branch-from was given: a decay branch's ranks each
    make its checkpoint, pretrain/training/start/branch.py, and the DeepSpeed config every rank
    builds, merged and checked once, here). `on_this_host`: the `world_size` ranks run on this host,
    so their start is planned here, once, before any rank starts (the start's entry,
    pretrain/training/start/entry.py: the data, the checkpoint to resume, the budget, every
    refusal); else it is resolved against the data where this host can read it.
    """
    from grt_common.errors import ConfigError
    from pretrain.runs.config_layers import resolve_ds_path
    from pretrain.runs.data_spec import absolute
    from pretrain.say import say
    from pretrain.training.start.command_line import build_parser as train_parser
    from pretrain.training.start.command_line import read_command_line
    from pretrain.training.start.entry import run_start

    try:
        targs = train_parser().parse_args(list(train_args))
    except SystemExit as e:
        raise LaunchError(f"grt train arguments rejected: {' '.join(train_args)}") from e
    try:
        cfg = read_command_line(targs)
        resume = bool(targs.resume or cfg.branch_from)
        started = run_start(cfg, resume, world_size, use_cuda, "here" if on_this_host and cfg.data else "elsewhere")
        plan = started.plan
        if plan is not None and plan.nothing_to_do:  # a finished run: no rank is started, nothing is written
            raise LaunchError(plan.nothing_to_do, code=0)
        for line in plan.notes if plan is not None else ():  # what the start changes (the ranks get the plan's)
            say(line)
        if plan is not None and plan.resume is not None:  # what the resume changes, said here as the ranks will
            for line in plan.resume_lines(plan.resume.tag, [], plan.resume.notes):
                say(line)
        for line in started.notes:
            print(f"grt launch: {line}", file=sys.stderr)
        cfg = started.cfg
        config = cfg.to_dict()
        config["data"] = cfg.data_spec.with_paths(absolute) if cfg.data else ""
    except ConfigError as e:
        raise LaunchError(f"run config: {e}") from e
    config["out"] = absolute(config["out"]) if config["out"] else ""
    config["ds_config"] = os.path.abspath(resolve_ds_path(config["ds_config"]))
    return config, resume, started.ds


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
    if args.preflight and (code := _preflight_first(argv)):
        return code
    plan.write_files()
    print(f"grt launch: {plan.summary}\ngrt launch: {plan.shell_command()}", flush=True)
    return plan.execute()


if __name__ == "__main__":
    sys.exit(main())
