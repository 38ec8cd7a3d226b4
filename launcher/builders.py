"""One builder per launcher: launch options (`options.Resolved`) -> `Plan`."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
from typing import TYPE_CHECKING

from launcher.envvars import DEFAULT_EXPORT_PREFIXES, SECRET
from launcher.hosts import format_hostfile
from launcher.plan import Plan
from launcher.rank_env import OUTER_RANK_VARS, PROJECT_ROOT, parse_user_env, rank_log_dir, summary
from launcher.slurm_script import build_slurm

if TYPE_CHECKING:
    from launcher.options import Resolved

DEFAULT_PORT = 29500


def _pythonpath(existing: str = "") -> str:
    parts = [PROJECT_ROOT] + [p for p in existing.split(os.pathsep) if p and p != PROJECT_ROOT]
    return os.pathsep.join(parts)


# --------------------------------------------------------------------------- local


def build_local(r: Resolved) -> Plan:
    if r.elastic is not None:
        return build_elastic(r)
    if r.nodes > 1:
        raise ValueError("--launcher local runs on this machine only; use deepspeed, slurm or mpi for several nodes")
    py = r.python
    if r.procs == 1 and not r.args.rank_logs:
        cmd = [py] + r.rank_argv()
    else:
        # torchrun (torch.distributed.run) sets RANK/LOCAL_RANK/WORLD_SIZE for each process
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r.procs}"]
        if r.args.rank_logs:  # <dir>/<run id>/attempt_N/<rank>/{stdout,stderr}.log, and the console
            cmd += ["--log-dir", rank_log_dir(r), "--tee", "3"]
        cmd += ["-m", r.entry_module] + r.entry_args + r.train_args
    env = dict(parse_user_env(r))
    return Plan("local", cmd, env=env, summary=summary(r, "local"))


# --------------------------------------------------------------------------- elastic (torchrun's agent)

# The agent's env for every elastic launch: a rendezvous round rebuilds where the workers' store is
# (rank 0 of the round serves a new one) instead of keeping the first round's address, which
# points at a lost node once the rendezvous's first node is gone (pretrain/distributed/rendezvous.py
# `_round_store` copes with the shared store otherwise).
ELASTIC_AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_run_id(run_dir: str) -> str:
    """torchrun's --rdzv-id of a run directory: its name and a hash of its absolute path."""
    path = os.path.abspath(run_dir)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(path)) or "run"
    return f"grt-{name}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def elastic_command(r: Resolved) -> list[str]:
    """One node's torchrun agent of an elastic launch (the same command on every node)."""
    assert r.elastic is not None
    low, high = r.elastic
    cmd = [r.python, "-m", "torch.distributed.run", "--nnodes", f"{low}:{high}", "--nproc-per-node", str(r.procs)]
    cmd += ["--max-restarts", str(r.max_restarts), "--rdzv-backend", "c10d"]
    cmd += [
        "--rdzv-endpoint",
        f"{r.master_addr}:{r.master_port or DEFAULT_PORT}",
        "--rdzv-id",
        elastic_run_id(r.run_dir),
    ]
    if r.args.rdzv_conf:
        cmd += ["--rdzv-conf", r.args.rdzv_conf]
    if r.args.rank_logs:  # <dir>/<run id>/attempt_N/<rank>/{stdout,stderr}.log, and the console
        cmd += ["--log-dir", rank_log_dir(r), "--tee", "3"]
    return cmd + ["-m", r.entry_module] + r.entry_args + r.train_args


def elastic_script(r: Resolved, cmd: list[str]) -> str:
    """<launch dir>/elastic.sh: the agent's command with the environment of every rank, for the other nodes."""
    q = shlex.quote
    env = {**r.env, **ELASTIC_AGENT_ENV, "PYTHONPATH": _pythonpath(r.environ.get("PYTHONPATH", ""))}
    lines = [
        "#!/bin/bash",
        "# Written by `grt launch --elastic`: this run's torchrun agent, the command grt launch runs on the",
        "# launching node; run it on each other node (by hand, from a cluster manager, pdsh -w n1,n2 bash THIS).",
        "set -euo pipefail",
        f"cd {q(os.getcwd())}",
        *(f"export {k}={q(v)}" for k, v in env.items()),
        "exec " + shlex.join(cmd),
    ]
    return "\n".join(lines) + "\n"


def build_elastic(r: Resolved) -> Plan:
    assert r.elastic is not None
    low, high = r.elastic
    cmd = elastic_command(r)
    script = os.path.join(r.launch_dir, "elastic.sh")
    nodes = str(low) if low == high else f"{low} to {high}"
    summary = (
        f"torchrun elastic agent: {nodes} node(s) x {r.procs} rank(s), up to {r.max_restarts} restart(s), "
        f"rendezvous {r.master_addr}:{r.master_port or DEFAULT_PORT}, "
        f"entry `{' '.join([r.entry_module] + r.entry_args)}`, run dir {r.run_dir}; "
        f"on every other node run: bash {script}"
    )
    env = {**ELASTIC_AGENT_ENV, **parse_user_env(r)}
    return Plan(
        "local", cmd, env=env, files={script: elastic_script(r, cmd)}, executable_files=[script], summary=summary
    )


# --------------------------------------------------------------------------- deepspeed


def build_deepspeed(r: Resolved) -> Plan:
    a = r.args
    files: dict[str, str] = {}
    exe = ["deepspeed"] if shutil.which("deepspeed") else [r.python, "-m", "deepspeed.launcher.runner"]
    cmd: list[str] = list(exe)
    multi = r.hosts is not None
    # the runner's MPI backends start one rank per hostfile slot and refuse --num_nodes,
    # --num_gpus, --include and --exclude: they get a hostfile of exactly the chosen ranks
    mpi_backend = multi and not a.no_ssh and a.ds_launcher != "pdsh"
    if mpi_backend and (a.include or a.exclude):
        raise ValueError(
            f"--include/--exclude: the deepspeed runner's {a.ds_launcher} backend cannot "
            "select ranks; use --ds-launcher pdsh, or --nodes/--procs-per-node/--hosts"
        )
    if r.hosts is not None:
        if r.hostfile is not None and not mpi_backend:
            hostfile = r.hostfile
        else:
            hostfile = os.path.join(r.launch_dir, "hostfile")
            files[hostfile] = format_hostfile([(h, r.procs) for h, _ in r.hosts] if mpi_backend else r.hosts)
        cmd += ["--hostfile", hostfile] + ([] if mpi_backend else [f"--num_nodes={r.nodes}"])
    if not mpi_backend:
        cmd += [f"--num_gpus={r.procs}"]
    if multi:
        cmd += [f"--master_addr={r.master_addr}"]
    cmd += [f"--master_port={r.master_port or DEFAULT_PORT}"]
    if a.no_ssh:
        if a.node_rank is None:
            raise ValueError("--no-ssh needs --node-rank (this node's index in the hostfile)")
        if not multi:
            raise ValueError("--no-ssh needs --hostfile or --hosts (all the nodes, in order)")
        cmd += ["--no_ssh", f"--node_rank={a.node_rank}"]
    elif multi:
        cmd += [f"--launcher={a.ds_launcher}"]
        launcher_args = a.launcher_args
        if a.ds_launcher == "openmpi" and "--allow-run-as-root" not in launcher_args:
            launcher_args = " ".join(_mpirun_as_root() + [launcher_args]).strip()  # as `--launcher mpi` does
        if launcher_args:
            cmd += [f"--launcher_args={launcher_args}"]
    # the runner's own options, under their deepspeed names
    for value, flag in ((a.include, "--include"), (a.exclude, "--exclude"), (a.ssh_port, "--ssh_port")):
        if value is not None:
            cmd += [f"{flag}={value}"]
    if a.no_ssh_check:
        cmd += ["--no_ssh_check"]
    if a.rank_logs:
        cmd += [f"--enable_each_rank_log={rank_log_dir(r)}"]
    # ranks read LOCAL_RANK from the environment; without this the runner inserts
    # --local_rank=N in front of the module's own arguments
    cmd += ["--no_local_rank", "--module", r.entry_module] + r.entry_args + r.train_args
    env: dict[str, str] = {}
    if r.env or multi:
        # the deepspeed runner exports every line of this file on every node (multi-node runs)
        env_file = os.path.join(r.launch_dir, ".deepspeed_env")
        lines = dict(r.env)
        if multi:
            lines.setdefault("PYTHONPATH", _pythonpath(r.environ.get("PYTHONPATH", "")))
        files[env_file] = "".join(f"{k}={v}\n" for k, v in lines.items())
        env["DS_ENV_FILE"] = env_file
    env.update(parse_user_env(r))
    return Plan("deepspeed", cmd, env=env, files=files, summary=summary(r, "deepspeed runner"))


# --------------------------------------------------------------------------- mpi


def _mpirun_as_root() -> list[str]:
    """OpenMPI's mpirun refuses to start as root without this flag."""
    return ["--allow-run-as-root"] if os.geteuid() == 0 else []


def build_mpi(r: Resolved) -> Plan:
    a = r.args
    files: dict[str, str] = {}
    cmd = shlex.split(a.mpirun) + ["-np", str(r.world_size)]
    if r.hosts is not None:
        if r.hostfile is not None:
            hostfile = r.hostfile
        else:
            hostfile = os.path.join(r.launch_dir, "hostfile")
            files[hostfile] = format_hostfile(r.hosts)
        cmd += ["--hostfile", hostfile]
    cmd += ["--map-by", f"ppr:{r.procs}:node", "--bind-to", "none"]
    cmd += _mpirun_as_root()
    if r.hosts is None and r.procs > (os.cpu_count() or 1):
        cmd += ["--oversubscribe"]
    env = {
        "MASTER_ADDR": r.master_addr,
        "MASTER_PORT": str(r.master_port or DEFAULT_PORT),
        "PYTHONPATH": _pythonpath(r.environ.get("PYTHONPATH", "")),
    }
    user_env = parse_user_env(r)
    env.update(user_env)
    exported = ["MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "PATH", "LD_LIBRARY_PATH"]
    exported += [k for k in r.env if k not in exported]
    # secrets are passed by name only (mpirun copies the value from its own environment)
    prefixes = DEFAULT_EXPORT_PREFIXES + tuple(a.export)
    exported += [k for k in sorted(r.environ) if k.startswith(prefixes) and SECRET.search(k) and k not in exported]
    for k in exported:
        cmd += ["-x", k]
    if a.rank_logs:  # OpenMPI: <dir>/1/rank.N/{stdout,stderr}
        cmd += ["--output-filename", rank_log_dir(r)]
    if a.mpirun_args:
        cmd += shlex.split(a.mpirun_args)
    cmd += [r.python] + r.rank_argv()
    unset = [k for k in OUTER_RANK_VARS if k in r.environ]
    return Plan("mpi", cmd, env=env, files=files, unset=unset, summary=summary(r, "mpirun"))


BUILDERS = {"local": build_local, "deepspeed": build_deepspeed, "mpi": build_mpi, "slurm": build_slurm}
