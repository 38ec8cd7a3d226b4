"""The Slurm launcher: `build_slurm` writes the batch script (`slurm_script`) that sbatch runs, srun
starting the ranks (in a container or not), pre-emption signals forwarded to them."""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

from launcher.plan import Plan
from launcher.rank_env import OUTER_RANK_VARS, PROJECT_ROOT, parse_user_env, rank_log_dir, summary

if TYPE_CHECKING:
    from launcher.options import Resolved


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
        from pretrain.runs.data_spec import parse_data

        manifests = parse_data(r.config["data"]).paths  # one, or a mixture's sources'
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
    """The sbatch script: its #SBATCH header, the ranks' environment, then srun (under a trap that
    forwards the pre-emption signal to the ranks when there is one)."""
    run_dir = os.path.abspath(r.run_dir)
    sig_full, sig_name = _signal_parts(r.args.signal)
    prepare, srun_line = _srun(r)
    lines = [*_sbatch_header(r, run_dir, sig_full, script_path), *_environment(r, run_dir), *prepare]
    lines += _forwarding(srun_line, sig_name, r.args.requeue, script_path) if sig_name else [srun_line]
    return "\n".join(lines) + "\n"


def _sbatch_header(r: Resolved, run_dir: str, sig_full: str | None, script_path: str) -> list[str]:
    """The #SBATCH lines: the job's size, limits, log and signal."""
    a = r.args
    output = a.output or os.path.join(run_dir, "slurm-%j.out")
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
    lines += [f"#SBATCH --output={output}", "#SBATCH --open-mode=append", f"#SBATCH --chdir={os.getcwd()}"]
    if sig_full:
        lines.append(f"#SBATCH --signal={sig_full}")
    if a.requeue:
        lines.append("#SBATCH --requeue")
    for extra in a.sbatch_arg:
        lines.append(f"#SBATCH {extra}")
    return [*lines, "# Written by `grt launch --launcher slurm`; submit with: sbatch " + script_path]


def _environment(r: Resolved, run_dir: str) -> list[str]:
    """The shell's settings, the rendezvous, the ranks' environment and the job's first log line."""
    a, q = r.args, shlex.quote
    lines = [
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
    return lines


def _srun(r: Resolved) -> tuple[list[str], str]:
    """The lines that prepare srun (the rank logs' folder) and the srun command of every rank, in
    its container if there is one."""
    a, q, cwd = r.args, shlex.quote, os.getcwd()
    prepare = []
    srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks-per-node={r.procs}"]
    if a.cpus_per_task:
        # srun of Slurm 22.05-23.02 does not inherit the job's --cpus-per-task
        srun += [f"--cpus-per-task={a.cpus_per_task}"]
    if a.rank_logs:  # srun opens the files but does not create their directory
        prepare.append(f"mkdir -p {q(rank_log_dir(r))}")
        srun += [f"--output={os.path.join(rank_log_dir(r), 'rank%t.log')}", "--open-mode=append"]
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
    return prepare, shlex.join(srun + rank_cmd)


def _forwarding(srun_line: str, sig_name: str, requeue: bool, script_path: str) -> list[str]:
    """srun in the background under a trap that forwards `sig_name` (and TERM) to the ranks through
    Slurm; after a pre-emption that saved, the job is requeued or says how to resume."""
    lines = [
        f"# Pre-emption: Slurm signals this script (--signal=B:...) or `scancel --batch --signal={sig_name}`; it is",
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
    if requeue:
        lines += [
            '  log "checkpoint saved after the pre-emption signal; requeueing job $SLURM_JOB_ID"',
            '  scontrol requeue "$SLURM_JOB_ID"',
        ]
    else:
        lines += [f'  log "checkpoint saved after the pre-emption signal; resume with: sbatch {script_path}"']
    return [*lines, "fi", 'exit "$status"']


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
        env=parse_user_env(r),
        summary=summary(r, "slurm batch job"),
    )
