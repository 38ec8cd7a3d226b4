"""The launch options' values checked before anything is written (`check_values`, `elastic_nodes`), and
`LaunchError`, the refusal they and `cli.resolve` raise."""

from __future__ import annotations

import argparse
import re
import signal


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
