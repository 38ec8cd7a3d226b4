"""The `grt launch` command line: its flags (`build_parser`) and the split at `--` (`split_argv`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

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
    """The flags by group, in the order `--help` lists them."""
    p = argparse.ArgumentParser(
        prog="grt launch",
        description="Start `grt train` locally, with the deepspeed runner, under Slurm or under "
        "MPI. Arguments after `--` (and unknown ones) go to `grt train` on every rank.",
        formatter_class=_Formatter,
        allow_abbrev=False,  # `--out` is grt train's, not an abbreviation of `--output`
    )
    for add in (_where, _elastic, _deepspeed, _run, _slurm, _mpi):
        add(p)
    return p


def _where(p: argparse.ArgumentParser) -> None:
    """Which launcher, on which nodes, with how many ranks, and their rendezvous."""
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


def _elastic(p: argparse.ArgumentParser) -> None:
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


def _deepspeed(p: argparse.ArgumentParser) -> None:
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


def _run(p: argparse.ArgumentParser) -> None:
    """What every rank gets (environment, entry), where the launch files go, and the checks around the run."""
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
        "--preflight",
        action="store_true",
        help="first check every rank (GEMM, all-reduce in and across nodes, disk, the first shard) in a launch of "
        "its own, then train; a rank under the limits stops the launch (launcher/preflight.py)",
    )
    p.add_argument("--preflight-only", action="store_true", help="the check of --preflight alone, no training")
    p.add_argument(
        "--preflight-limits",
        default="",
        help="slow=0.8 (a rank below this share of the median fails), tflops=, busbw= (GB/s), write=, read= (MB/s)",
    )
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


def _slurm(p: argparse.ArgumentParser) -> None:
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


def _mpi(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("mpi")
    m.add_argument("--mpirun", default="mpirun", help="the mpirun program")
    m.add_argument("--mpirun-args", default="", help="extra mpirun arguments")


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []
