"""Multi-node for real, on one machine: 2 nodes as network namespaces (netns_cluster.py), each
with its own address, hostname and sshd, 1 CPU rank per node, tiny-grt under ZeRO-3.

Each launcher starts the ranks the way it does on a cluster: the deepspeed runner over pdsh
and ssh, mpirun over ssh, Slurm with one slurmd per node (`sbatch -N 2`), and torchrun
started on each node with a c10d rendezvous on node 0. The per-step losses must equal those
of one 2-rank run on one machine (same global batch, same data order), and the launching
environment (an NCCL_ variable and a GRT_ one) must reach the rank on node 1. Then faults
across nodes (a killed rank, a link down) and a pre-empted 2-node Slurm job.

Needs root (namespaces); skipped with the reason otherwise.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_helpers import (ROOT, _end_group, check_trained, clean_env, complete_lines, free_port,  # noqa: E402
                            grt_launch, read_metrics, train_args)
from netns_cluster import ClusterUnavailable, NetnsCluster, netns_slurm, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.slow

_reason = unavailable_reason()
if _reason:
    pytest.skip(f"no namespace cluster: {_reason}", allow_module_level=True)

STEPS = 4  # each launcher's run
REF_STEPS = 8  # the reference, the fault runs and the pre-empted job
ZERO3 = os.path.join(ROOT, "ds_configs", "zero3.json")
# reach the remote ranks: NCCL_ and GRT_ are among the prefixes every launcher exports
PROPAGATED = {"NCCL_SOCKET_IFNAME": "eth0", "GRT_REHEARSAL_TAG": "netns-cluster"}


def run_args(out, steps=STEPS, *extra):
    """tiny-grt, ZeRO-3, 2 sequences per rank, one learning-rate schedule for every run length
    (so that a 4-step run's losses are the first 4 of the 8-step reference), a checkpoint every 2 steps."""
    return train_args(out, steps, "tiny-grt", "--ds-config", ZERO3, "--set", f"train.schedule_steps={REF_STEPS}",
                      "--set", "train.save_every=2", *extra)


def losses(out, rank=0):
    """step -> loss; a resumed run appends, so the last record of a step wins."""
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(str(out), name))}


def assert_losses_match(out, reference, steps):
    got = losses(out)
    assert sorted(got) == list(range(1, steps + 1)), got
    for step in got:
        assert got[step] == pytest.approx(reference[step], abs=1e-5), (step, got, reference)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = NetnsCluster(str(tmp_path_factory.mktemp("netns-cluster")), nodes=2)
    try:
        c.start()
    except ClusterUnavailable as e:
        c.stop()
        pytest.skip(f"no namespace cluster: {e}")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One machine, 2 ranks (torchrun), REF_STEPS steps: the losses every multi-node run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    grt_launch("--launcher", "local", "--procs-per-node", "2", "--master-port", str(free_port()),
               "--", *run_args(out, REF_STEPS))
    return losses(out)


def node_env(cluster, **extra):
    """The environment of a launch started on a node: the cluster's ssh first on PATH, one
    thread per rank (as the one-machine reference), the variables that must reach the ranks."""
    env = clean_env(OMP_NUM_THREADS="1", **PROPAGATED, **extra)
    env["PATH"] = cluster.env["PATH"]
    return env


class RankWatch:
    """Finds the training rank running on `node` (a `pretrain.cli train` process in its
    namespace, below whatever launched it) and keeps its environment, while a launch runs."""

    def __init__(self, cluster, node=1):
        self.cluster, self.node = cluster, node
        self.environ = None
        self.hostname = cluster.names[node]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2) and self.environ is None:
            for pid in self.cluster.pids(self.node):
                try:
                    argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                    if not (b"pretrain.cli" in argv[:4] and b"train" in argv[:5]):
                        continue  # a launcher's own process (sshd, orted, slurmstepd, torchrun's agent)
                    raw = open(f"/proc/{pid}/environ", "rb").read()
                except OSError:
                    continue
                self.environ = dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)
                return

    def check(self):
        self._stop.set()
        self._thread.join(5)
        assert self.environ is not None, f"no training rank was seen on {self.hostname}"
        for k, v in PROPAGATED.items():
            assert self.environ.get(k) == v, (k, self.environ.get(k))


def launch_on_node0(cluster, args, log, timeout=300, env=None):
    """`grt launch ARGS` started on node 0 (where a user would log in); waits and returns its log."""
    with open(log, "w") as f:
        proc = cluster.popen(0, [sys.executable, "-m", "pretrain.cli", "launch", *args], env=env or node_env(cluster),
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        raise AssertionError(f"grt launch did not end within {timeout} s:\n{open(log).read()[-4000:]}")
    text = open(log, errors="replace").read()
    assert proc.returncode == 0, text[-4000:]
    return text


# --------------------------------------------------------------------------- launchers


def test_deepspeed_runner_over_pdsh(cluster, reference, tmp_path):
    out = tmp_path / "run"
    watch = RankWatch(cluster)
    launch_on_node0(cluster, ["--launcher", "deepspeed", "--hostfile", cluster.hostfile(), "--cpu",
                              "--procs-per-node", "1", "--master-port", str(free_port()),
                              "--", *run_args(out)], tmp_path / "launch.log")
    watch.check()
    check_trained(out, STEPS)
    assert_losses_match(out, reference, STEPS)


def test_mpirun_over_ssh(cluster, reference, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian package openmpi-bin)")
    out = tmp_path / "run"
    watch = RankWatch(cluster)
    launch_on_node0(cluster, ["--launcher", "mpi", "--hostfile", cluster.hostfile(), "--cpu",
                              "--procs-per-node", "1", "--master-port", str(free_port()),
                              "--", *run_args(out)], tmp_path / "launch.log")
    watch.check()
    check_trained(out, STEPS)
    assert_losses_match(out, reference, STEPS)


def test_torchrun_on_each_node(cluster, reference, tmp_path):
    """Plain torchrun, started by hand on every node, meeting at node 0's c10d rendezvous."""
    out = tmp_path / "run"
    port = free_port()
    watch = RankWatch(cluster)
    logs = [tmp_path / f"torchrun-node{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        with open(logs[i], "w") as f:
            procs.append(cluster.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                           "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                           "--rdzv-endpoint", f"{cluster.names[0]}:{port}", "--rdzv-id", "mnode",
                                           "-m", "pretrain.cli", "train", *run_args(out)],
                                       env=node_env(cluster), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                       start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                _end_group(p)
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(l.read_text()[-3000:] for l in logs)
    watch.check()
    check_trained(out, STEPS)
    assert_losses_match(out, reference, STEPS)
