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

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_helpers import (
    ROOT,
    _end_group,
    check_trained,
    clean_env,
    complete_lines,
    free_port,  # noqa: E402
    grt_launch,
    train_args,
    wait_all,
)
from netns_cluster import ClusterUnavailable, NetnsCluster, netns_slurm, started_or_skip  # noqa: E402
from train_jobs import losses  # noqa: E402

from pretrain.distributed import expand_nodelist  # noqa: E402

pytestmark = pytest.mark.slow

if os.geteuid() != 0:  # the other reasons (a tool missing, no `ip netns`) skip from the fixture
    pytest.skip("no namespace cluster: network namespaces need root", allow_module_level=True)

STEPS = 4  # each launcher's run
REF_STEPS = 8  # the reference, the fault runs and the pre-empted job
ZERO3 = os.path.join(ROOT, "ds_configs", "zero3.json")
# reach the remote ranks: NCCL_ and GRT_ are among the prefixes every launcher exports
PROPAGATED = {"NCCL_SOCKET_IFNAME": "eth0", "GRT_REHEARSAL_TAG": "netns-cluster"}


def run_args(out, steps=STEPS, *extra):
    """tiny-grt, ZeRO-3, 2 sequences per rank, one learning-rate schedule for every run length
    (so that a 4-step run's losses are the first 4 of the 8-step reference), a checkpoint every 2 steps."""
    return train_args(
        out,
        steps,
        "tiny-grt",
        "--ds-config",
        ZERO3,
        "--set",
        f"train.schedule_steps={REF_STEPS}",
        "--set",
        "train.save_every=2",
        *extra,
    )


def assert_losses_match(out, reference, steps):
    got = losses(out)
    assert sorted(got) == list(range(1, steps + 1)), got
    for step in got:
        assert got[step] == pytest.approx(reference[step], abs=1e-5), (step, got, reference)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_or_skip(str(tmp_path_factory.mktemp("netns-cluster")))


@pytest.fixture(scope="module")
def slurm(cluster):
    """slurmctld on node 0 and one slurmd per node, with their own SLURM_CONF, ports and spool."""
    from slurm_cluster import SlurmUnavailable

    s = netns_slurm(cluster, os.path.join(cluster.dir, "slurm"))
    try:
        s.start()
    except BaseException as e:  # its daemons stopped whatever went wrong
        s.stop()
        if isinstance(e, SlurmUnavailable):
            pytest.skip(f"no Slurm on the namespace cluster: {e}")
        raise
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One machine, 2 ranks (torchrun), REF_STEPS steps: the losses every multi-node run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    grt_launch(
        "--launcher",
        "local",
        "--procs-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "--",
        *run_args(out, REF_STEPS),
    )
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
        proc = cluster.popen(
            0,
            [sys.executable, "-m", "pretrain.cli", "launch", *args],
            env=env or node_env(cluster),
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        raise AssertionError(f"grt launch did not end within {timeout} s:\n{open(log).read()[-4000:]}") from None
    text = open(log, errors="replace").read()
    assert proc.returncode == 0, text[-4000:]
    return text


# --------------------------------------------------------------------------- the fixture


def _netns_names():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_three_node_cluster_is_removed_even_after_a_failure(tmp_path):
    """3 nodes: each reaches every other by name over ssh, with its own hostname; a failure
    inside still ends with every process in the nodes killed and namespaces, links, bridge and
    hosts files gone, and the machine's /etc/netns and /run/sshd as they were. Leftovers of a
    dead test process are removed by the next start, whose stop leaves the first cluster working."""
    from netns_cluster import NETNS_ETC, PREFIX, SHARED_DIRS

    found = {d: os.path.isdir(d) for d in SHARED_DIRS}
    c = NetnsCluster(str(tmp_path / "c3"), nodes=3)
    try:
        c.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no namespace cluster: {e}")
    sleeper = None
    with pytest.raises(RuntimeError, match="a test failing"):
        try:
            r = c.run(2, ["sh", "-c", f"hostname; ssh {c.names[0]} hostname; ssh {c.names[1]} hostname"])
            assert r.stdout.split() == [c.names[2], c.names[0], c.names[1]]
            sleeper = c.popen(1, ["sleep", "600"])
            # what a cluster whose test process died can leave: a namespace with a process in it and
            # its hosts file, and a hosts file whose namespace is gone (a death between the two removals)
            dead = subprocess.Popen(["true"])
            dead.wait()
            stale, orphan = f"{PREFIX}{dead.pid}c1n0", f"{PREFIX}{dead.pid}c1n1"
            subprocess.run(["ip", "netns", "add", stale], check=True)
            stale_sleeper = subprocess.Popen(["nsenter", f"--net=/run/netns/{stale}", "sleep", "600"])
            for ns in (stale, orphan):
                os.makedirs(os.path.join(NETNS_ETC, ns))
                open(os.path.join(NETNS_ETC, ns, "hosts"), "w").close()
            for _ in range(2):  # the second in the first one's directory, as a rerun of the command would be
                NetnsCluster(str(tmp_path / "c1"), nodes=1).start().stop()
            assert stale_sleeper.wait(timeout=10) == -signal.SIGKILL
            assert stale not in _netns_names()
            assert not any(os.path.exists(os.path.join(NETNS_ETC, ns)) for ns in (stale, orphan))
            # the other cluster's stop left what this one's sshd needs
            assert c.run(2, ["ssh", c.names[0], "hostname"]).stdout.strip() == c.names[0]
            raise RuntimeError("a test failing")
        finally:
            c.stop()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not any(n in _netns_names() for n in c.names)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert c.prefix not in links and not any(os.path.exists(os.path.join(NETNS_ETC, n)) for n in c.names)
    if not any(ns.startswith(PREFIX) for ns in _netns_names().splitlines()):  # else another run's cluster is up
        assert {d: os.path.isdir(d) for d in SHARED_DIRS} == found


@pytest.mark.parametrize("nodes", [0, 11])
def test_cluster_command_rejects_a_bad_node_count_in_one_line(tmp_path, nodes):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "netns_cluster.py"), str(tmp_path / "c"), "--nodes", str(nodes)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"netns_cluster: 1 to 10 nodes (link names are limited to 15 characters), not {nodes}\n"


# --------------------------------------------------------------------------- launchers


@pytest.mark.parametrize(
    "launcher",
    [["deepspeed"], ["deepspeed", "--ds-launcher", "openmpi"], ["mpi"]],
    ids=["deepspeed-pdsh", "deepspeed-openmpi", "mpi"],
)
def test_launcher_across_nodes(cluster, reference, tmp_path, launcher):
    """The deepspeed runner over pdsh and over its OpenMPI backend, and mpirun over ssh, from
    node 0 with the cluster's hostfile."""
    if launcher != ["deepspeed"] and shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian package openmpi-bin)")
    out = tmp_path / "run"
    watch = RankWatch(cluster)
    launch_on_node0(
        cluster,
        [
            "--launcher",
            *launcher,
            "--hostfile",
            cluster.hostfile(),
            "--cpu",
            "--procs-per-node",
            "1",
            "--master-port",
            str(free_port()),
            "--",
            *run_args(out),
        ],
        tmp_path / "launch.log",
    )
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
            procs.append(
                cluster.popen(
                    i,
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nnodes",
                        "2",
                        "--nproc-per-node",
                        "1",
                        "--rdzv-backend",
                        "c10d",
                        "--rdzv-endpoint",
                        f"{cluster.names[0]}:{port}",
                        "--rdzv-id",
                        "mnode",
                        "-m",
                        "pretrain.cli",
                        "train",
                        *run_args(out),
                    ],
                    env=node_env(cluster),
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    wait_all(procs, logs, timeout=300)
    watch.check()
    check_trained(out, STEPS)
    assert_losses_match(out, reference, STEPS)


def submit(cluster, slurm, out, *args, log):
    """`grt launch --launcher slurm` on node 0 (2 nodes x 1 CPU rank); returns the job id."""
    text = launch_on_node0(
        cluster,
        ["--launcher", "slurm", "--cpu", "--nodes", "2", "--procs-per-node", "1", *args],
        log,
        env=node_env(cluster, SLURM_CONF=slurm.conf),
    )
    job = text.strip().splitlines()[-1].split(";")[0]
    assert job.isdigit(), text[-3000:]
    return job


def slurm_log(out, job):
    return open(os.path.join(str(out), f"slurm-{job}.out"), errors="replace").read()


def test_slurm_two_nodes(cluster, slurm, reference, tmp_path):
    out = tmp_path / "run"
    watch = RankWatch(cluster)
    job = submit(cluster, slurm, out, "--", *run_args(out), log=tmp_path / "launch.log")
    info = slurm.wait_job(job, timeout=300)
    assert info["JobState"] == "COMPLETED", (info, slurm_log(out, job)[-3000:])
    assert expand_nodelist(info["NodeList"]) == cluster.names
    watch.check()
    check_trained(out, STEPS)
    assert_losses_match(out, reference, STEPS)


def test_slurm_preempted_two_node_job_checkpoints_and_requeue_resumes(cluster, slurm, reference, tmp_path):
    """SIGTERM to the batch script (as Slurm's pre-emption does) is forwarded by the script to
    the ranks on both nodes with `scancel --signal=TERM $SLURM_JOB_ID` (every step but the
    script's), not through srun, which answers SIGTERM by killing every rank at once; they agree
    on one step, save one checkpoint and exit 0; the script requeues the job, which resumes
    from that checkpoint and reproduces the reference."""
    out = tmp_path / "run"
    # checkpoints only at the signal and at the end, so that the signal's one is kept to look at
    job = submit(
        cluster,
        slurm,
        out,
        "--requeue",
        "--",
        *run_args(out, REF_STEPS, "--set", "train.save_every=0"),
        log=tmp_path / "launch.log",
    )
    slurm.wait_for(lambda: complete_lines(out / "metrics.jsonl") >= 2, timeout=300, what="two training steps")
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    info = slurm.wait_job(job, timeout=300, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
    log = slurm_log(out, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    assert "received SIGTERM" in log and "requeueing job" in log and "(restart 1)" in log, log[-4000:]
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert len(tags) == 2 and tags[-1] == f"step{REF_STEPS:08d}", tags
    stopped = int(tags[0][len("step") :])
    assert 2 <= stopped < REF_STEPS
    # one checkpoint, consistent: both ranks' ZeRO partitions and states, at the same step
    import torch

    ckpt = out / "checkpoints" / tags[0]
    assert (ckpt / "COMPLETE").is_file()
    states = [torch.load(ckpt / f"rank{r}_state.pt", weights_only=False) for r in (0, 1)]
    assert [s["step"] for s in states] == [stopped, stopped]
    assert states[0]["loader"] == states[1]["loader"] and states[0]["loader"]["world_size"] == 2
    for r in (0, 1):
        assert (ckpt / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").is_file()
    assert f"resumed from {ckpt} at step {stopped}" in log
    assert_losses_match(out, reference, REF_STEPS)


# --------------------------------------------------------------------------- faults across nodes


class NodeRanks:
    """One `grt train` rank started directly on each node, with the env:// variables a per-node
    launcher sets (rank r on node r, rendezvous on node 0). Like faults.Job, across nodes."""

    def __init__(self, cluster, args, logs, port):
        self.logs = logs
        self.procs = []
        for r in range(cluster.n):
            env = node_env(
                cluster,
                MASTER_ADDR=cluster.names[0],
                MASTER_PORT=str(port),
                RANK=str(r),
                LOCAL_RANK="0",
                WORLD_SIZE=str(cluster.n),
                LOCAL_WORLD_SIZE="1",
            )
            with open(logs[r], "w") as f:
                self.procs.append(
                    cluster.popen(
                        r,
                        [sys.executable, "-m", "pretrain.cli", "train", *args],
                        env=env,
                        cwd=ROOT,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def output(self, rank):
        return open(self.logs[rank], errors="replace").read()

    def wait(self, timeout):
        deadline = time.time() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"ranks still running after {timeout} s:\n"
                + "\n----\n".join(self.output(r)[-3000:] for r in range(len(self.procs)))
            ) from None
        finally:
            self.kill()
        return [p.returncode for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("fault", ["kill", "link-down"])
def test_lost_node_is_named_and_resume_reproduces(cluster, reference, tmp_path, fault):
    """Node 1's rank is SIGKILLed (or node 1's link goes down) in mid-run: the rank on node 0
    stops within train.dist_timeout_s, naming rank 1 and node 1's hostname; a relaunch with
    --resume continues from the last complete checkpoint with the reference's losses."""
    out = tmp_path / "run"
    timeout_s = 10
    args = run_args(out, REF_STEPS, "--set", f"train.dist_timeout_s={timeout_s}")
    ranks = NodeRanks(cluster, args, [tmp_path / f"node{r}.log" for r in range(2)], free_port())
    try:
        deadline = time.time() + 240
        while complete_lines(out / "metrics.jsonl") < 3:
            assert time.time() < deadline and all(p.poll() is None for p in ranks.procs), ranks.output(0)[-3000:]
            time.sleep(0.05)
        t0 = time.time()
        if fault == "kill":
            ranks.procs[1].send_signal(signal.SIGKILL)
        else:
            cluster.link_down(1)
        try:
            ranks.procs[0].wait(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 0's rank still running {timeout_s + 30} s after the fault:\n{ranks.output(0)[-3000:]}")
        took = time.time() - t0
    finally:
        ranks.kill()
        cluster.link_up(1)
    log0 = ranks.output(0)
    assert ranks.procs[0].returncode not in (0, None)
    assert "grt train: stopped: rank 0 stopping: rank 1 stopped responding" in log0, log0[-3000:]
    assert f"on host {cluster.names[1]}" in log0, log0[-3000:]
    if fault == "kill":
        assert took < timeout_s, "a dead peer is noticed at once, not after the timeout"
    print(
        f"\nMULTINODE {fault} on {cluster.names[1]}: node 0's rank exited {ranks.procs[0].returncode} "
        f"after {took:.1f} s (dist_timeout_s={timeout_s})"
    )
    resumed = NodeRanks(cluster, args + ["--resume"], [tmp_path / f"node{r}.resume.log" for r in range(2)], free_port())
    assert resumed.wait(300) == [0, 0], resumed.output(0)[-3000:]
    assert "resumed from" in resumed.output(0)
    assert_losses_match(out, reference, REF_STEPS)
