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
DEFAULT_PORT = 29500


def _pythonpath(existing: str = "") -> str:
    parts = [PROJECT_ROOT] + [p for p in existing.split(os.pathsep) if p and p != PROJECT_ROOT]
    return os.pathsep.join(parts)


def _rank_log_dir(r: Resolved) -> str:
    return os.path.join(os.path.abspath(r.run_dir), "logs")


def _summary(r: Resolved, what: str) -> str:
    return (
        f"{what}: {r.nodes} node(s) x {r.procs} rank(s) = {r.world_size} ranks, "
        f"entry `{' '.join([r.entry_module] + r.entry_args)}`, run dir {r.run_dir}"
    )


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
            cmd += ["--log-dir", _rank_log_dir(r), "--tee", "3"]
        cmd += ["-m", r.entry_module] + r.entry_args + r.train_args
    env = dict(_parse_user_env(r))
    return Plan("local", cmd, env=env, summary=_summary(r, "local"))


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
        cmd += ["--log-dir", _rank_log_dir(r), "--tee", "3"]
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
    env = {**ELASTIC_AGENT_ENV, **_parse_user_env(r)}
    return Plan(
        "local", cmd, env=env, files={script: elastic_script(r, cmd)}, executable_files=[script], summary=summary
    )


def _parse_user_env(r: Resolved) -> dict[str, str]:
    """Rank environment this process does not already have (--env, computed defaults)."""
    return {k: v for k, v in r.env.items() if r.environ.get(k) != v}


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
        cmd += [f"--enable_each_rank_log={_rank_log_dir(r)}"]
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
    env.update(_parse_user_env(r))
    return Plan("deepspeed", cmd, env=env, files=files, summary=_summary(r, "deepspeed runner"))


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
    user_env = _parse_user_env(r)
    env.update(user_env)
    exported = ["MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "PATH", "LD_LIBRARY_PATH"]
    exported += [k for k in r.env if k not in exported]
    # secrets are passed by name only (mpirun copies the value from its own environment)
    prefixes = DEFAULT_EXPORT_PREFIXES + tuple(a.export)
    exported += [k for k in sorted(r.environ) if k.startswith(prefixes) and SECRET.search(k) and k not in exported]
    for k in exported:
        cmd += ["-x", k]
    if a.rank_logs:  # OpenMPI: <dir>/1/rank.N/{stdout,stderr}
        cmd += ["--output-filename", _rank_log_dir(r)]
    if a.mpirun_args:
        cmd += shlex.split(a.mpirun_args)
    cmd += [r.python] + r.rank_argv()
    unset = [k for k in OUTER_RANK_VARS if k in r.environ]
    return Plan("mpi", cmd, env=env, files=files, unset=unset, summary=_summary(r, "mpirun"))


# --------------------------------------------------------------------------- slurm


def _signal_parts(spec: str) -> tuple[str, str] | tuple[None, None]:
    """'USR1@120' -> ('B:USR1@120', 'USR1'); '' -> (None, None)."""
    if not spec:
        return None, None
    full = spec if ":" in spec else f"B:{spec}"
    name = full.split(":", 1)[1].split("@", 1)[0]
    if name.upper().startswith("SIG"):
        name = name[3:]
    return full, name


def container_binds(r: Resolved) -> list[str]:
    """Host directories the ranks need inside a container, each mounted at its own path: the
    working directory, the run directory, the DeepSpeed file's directory, the data (manifest,
    shards, tokenizer; read from the manifest when it is visible here) and, with --host-code,
    this checkout. A directory inside another one goes with it."""
    paths = {os.getcwd(), os.path.abspath(r.run_dir)}
    if r.config is not None:
        from data_pipeline.manifest import Manifest, is_url
        from pretrain.runs.run_config import data_paths

        manifests = data_paths(r.config["data"])  # one, or a mixture's sources'
        paths |= {os.path.dirname(p) for p in [*manifests, r.config["ds_config"]] if "://" not in p}
        for path in manifests:
            try:
                manifest = Manifest.load(path)
            except (OSError, ValueError, KeyError):
                continue  # visible from the nodes only: its directory is mounted, shards next to it are covered
            paths.add(os.path.dirname(manifest.tokenizer_path))
            paths |= {
                os.path.dirname(e.url) for entries in manifest.splits.values() for e in entries if not is_url(e.url)
            }
    if r.args.host_code:
        paths.add(PROJECT_ROOT)
    return [p for p in sorted(paths) if not any(p.startswith(q.rstrip("/") + "/") for q in paths)]


def _slurm_nodes(r: Resolved) -> str:
    """sbatch --nodes: N, or MIN-MAX for --elastic (Slurm starts the job, and a requeued one, on
    as many nodes as it has free within the range)."""
    if r.elastic is None or r.elastic[0] == r.elastic[1]:
        return str(r.nodes)
    return f"{r.elastic[0]}-{r.elastic[1]}"


def slurm_script(r: Resolved, script_path: str) -> str:
    a = r.args
    run_dir = os.path.abspath(r.run_dir)
    cwd = os.getcwd()
    output = a.output or os.path.join(run_dir, "slurm-%j.out")
    sig_full, sig_name = _signal_parts(a.signal)
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={a.job_name}",
        f"#SBATCH --nodes={_slurm_nodes(r)}",
        f"#SBATCH --ntasks-per-node={r.procs}",
    ]
    if r.gpus:
        lines.append(f"#SBATCH --gpus-per-node={r.gpus}")
    if a.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={a.cpus_per_task}")
    if a.mem is not None:
        lines.append(f"#SBATCH --mem={a.mem}")
    for flag, value in (("time", a.time), ("partition", a.partition), ("account", a.account), ("qos", a.qos)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    if a.exclusive:
        lines.append("#SBATCH --exclusive")
    if a.hosts and r.hosts:  # run on these nodes
        lines.append("#SBATCH --nodelist=" + ",".join(h for h, _ in r.hosts))
    lines += [f"#SBATCH --output={output}", "#SBATCH --open-mode=append", f"#SBATCH --chdir={cwd}"]
    if sig_full:
        lines.append(f"#SBATCH --signal={sig_full}")
    if a.requeue:
        lines.append("#SBATCH --requeue")
    for extra in a.sbatch_arg:
        lines.append(f"#SBATCH {extra}")
    lines += [
        "# Written by `grt launch --launcher slurm`; submit with: sbatch " + script_path,
        "set -uo pipefail",
        "export MASTER_ADDR="
        + (q(r.master_addr) if a.master_addr else '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'),
        "export MASTER_PORT=" + (str(r.master_port) if r.master_port else '"$((20000 + SLURM_JOB_ID % 20000))"'),
        f"export GRT_RUN_DIR={q(run_dir)}",
        "log() { echo \"$(date '+%Y-%m-%d %H:%M:%S') grt: $*\"; }",
    ]
    lines.append("unset " + " ".join(OUTER_RANK_VARS) + "  # ranks come from Slurm (SLURM_PROCID, ...)")
    container = a.container_image or a.apptainer
    if container and not a.host_code:
        # the image's code: no checkout on PYTHONPATH, and `python -m` does not put the
        # working directory (perhaps a checkout) first on sys.path (Python 3.11+)
        lines += ["unset PYTHONPATH", "export PYTHONSAFEPATH=1"]
    else:
        lines.append(f"export PYTHONPATH={q(PROJECT_ROOT)}" + '"${PYTHONPATH:+:$PYTHONPATH}"')
    for k, v in r.env.items():
        lines.append(f"export {k}={q(v)}")
    lines.append(
        'log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
        '$SLURM_JOB_NODELIST, $SLURM_NTASKS ranks, master $MASTER_ADDR:$MASTER_PORT"'
    )

    srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks-per-node={r.procs}"]
    if a.cpus_per_task:
        # srun of Slurm 22.05-23.02 does not inherit the job's --cpus-per-task
        srun += [f"--cpus-per-task={a.cpus_per_task}"]
    if a.rank_logs:  # srun opens the files but does not create their directory
        lines.append(f"mkdir -p {q(_rank_log_dir(r))}")
        srun += [f"--output={os.path.join(_rank_log_dir(r), 'rank%t.log')}", "--open-mode=append"]
    rank_cmd = [r.python] + r.rank_argv()
    if a.container_image:
        mounts = a.container_mounts or ",".join(f"{b}:{b}" for b in container_binds(r))
        srun += [f"--container-image={a.container_image}", f"--container-mounts={mounts}", f"--container-workdir={cwd}"]
    elif a.apptainer:
        binds = a.container_mounts or ",".join(container_binds(r))
        rank_cmd = (
            ["apptainer", "exec"]
            + (["--nv"] if r.gpus else [])
            + ["--bind", binds, "--pwd", cwd, a.apptainer]
            + rank_cmd
        )
    for extra in a.srun_arg:
        srun += shlex.split(extra)
    srun_line = shlex.join(srun + rank_cmd)
    if sig_name:
        lines += [
            "# Pre-emption: Slurm signals this script (--signal=B:...) or `scancel --batch "
            f"--signal={sig_name}`; it is",
            "# forwarded to the ranks (scancel: every step but this script's); the trainer saves a checkpoint",
            "# and exits 0.",
            "preempted=0",
            "srun_pid=",
            "forward() {",
            "  preempted=1",
            '  log "received SIG$1, forwarding it to the ranks"',
            "  # through Slurm to every rank on every node, not `kill` on srun: srun answers SIGTERM",
            "  # (or SIGINT) by killing every rank at once, before any could save a checkpoint",
            '  if [ -n "$srun_pid" ]; then scancel --signal="$1" "$SLURM_JOB_ID" || true; fi',
            "}",
            f"trap 'forward {sig_name}' {sig_name}",
        ]
        if sig_name != "TERM":
            lines.append("trap 'forward TERM' TERM")
        lines += [
            f"{srun_line} &",
            "srun_pid=$!",
            "# `wait` returns early when a trapped signal arrives: wait until srun has really ended",
            "while :; do",
            '  wait "$srun_pid"; status=$?',
            '  kill -0 "$srun_pid" 2>/dev/null || break',
            "done",
            'log "ranks exited with status $status"',
            'if [ "$preempted" = 1 ] && [ "$status" = 0 ]; then',
        ]
        if a.requeue:
            lines += [
                '  log "checkpoint saved after the pre-emption signal; requeueing job $SLURM_JOB_ID"',
                '  scontrol requeue "$SLURM_JOB_ID"',
            ]
        else:
            lines += [f'  log "checkpoint saved after the pre-emption signal; resume with: sbatch {script_path}"']
        lines += ["fi", 'exit "$status"']
    else:
        lines += [srun_line]
    return "\n".join(lines) + "\n"


def build_slurm(r: Resolved) -> Plan:
    a = r.args
    if a.container_image and a.apptainer:
        raise ValueError("choose one of --container-image (pyxis) and --apptainer")
    if not r.gpus and not a.cpu:
        raise ValueError("a Slurm job needs --gpus-per-node G (one rank per GPU), or --cpu for a CPU-only job")
    if a.host_code and not (a.container_image or a.apptainer):
        raise ValueError(
            "--host-code goes with --container-image or --apptainer (without a container "
            "the ranks run this checkout's code anyway)"
        )
    script_path = os.path.join(r.launch_dir, "slurm.sbatch")
    script = slurm_script(r, script_path)
    cmd = ["sbatch", "--parsable"] + (["--wait"] if a.wait else []) + [script_path]
    return Plan(
        "slurm",
        cmd,
        files={script_path: script},
        executable_files=[script_path],
        env=_parse_user_env(r),
        summary=_summary(r, "slurm batch job"),
    )


BUILDERS = {"local": build_local, "deepspeed": build_deepspeed, "mpi": build_mpi, "slurm": build_slurm}
