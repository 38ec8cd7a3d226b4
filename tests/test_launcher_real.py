"""Real multi-process launches on this machine, through `grt launch`, with the probe program.

`launcher.probe` calls `pretrain.distributed.init_distributed()`, all-reduces its rank and
writes what it discovered, so each test proves the launch path and the rank discovery
with the real tool: torchrun, the deepspeed runner (one node, and two "nodes" on one machine
with --no-ssh and node ranks 0 and 1), and `mpirun -np 2` (environment and mpi4py discovery).
Training through each launcher is in test_launcher_train.py; Slurm is in test_launcher_slurm.py.
"""
import glob
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra):
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "NODE_RANK", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI", "DLTS_", "GRT_HOSTFILE"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def grt_launch(*args, env=None, timeout=300, background=False):
    cmd = [sys.executable, "-m", "pretrain.cli", "launch", *args]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def probe_results(out, world):
    files = sorted(glob.glob(os.path.join(out, "probe-rank*.json")))
    recs = [json.load(open(f)) for f in files]
    assert sorted(r["rank"] for r in recs) == list(range(world)), files
    for r in recs:
        assert r["world_size"] == world and r["dist_world_size"] == world
        assert r["allreduce_sum"] == r["expected_sum"] == world * (world + 1) / 2
        assert r["dist_rank"] == r["rank"] and r["backend"] == "gloo"
    return sorted(recs, key=lambda r: r["rank"])


def test_local_torchrun_two_ranks(tmp_path):
    grt_launch("--launcher", "local", "--procs-per-node", "2", "--entry", "launcher.probe",
               "--", "--out", str(tmp_path))
    recs = probe_results(str(tmp_path), 2)
    assert [r["local_rank"] for r in recs] == [0, 1]
    assert all(r["launcher"] == "torchrun/deepspeed" for r in recs)
    launch = json.load(open(tmp_path / "launch.json"))
    assert launch["launcher"] == "local" and launch["world_size"] == 2


def test_deepspeed_runner_two_ranks(tmp_path):
    port = free_port()
    grt_launch("--launcher", "deepspeed", "--procs-per-node", "2", "--master-port", str(port),
               "--entry", "launcher.probe", "--", "--out", str(tmp_path))
    recs = probe_results(str(tmp_path), 2)
    assert all(r["launcher"] == "torchrun/deepspeed" and r["master_port"] == port for r in recs)
    assert [r["local_rank"] for r in recs] == [0, 1]


def test_deepspeed_two_nodes_on_one_machine(tmp_path):
    """The per-node launch run twice (node rank 0 and 1), one master address, no ssh."""
    port = free_port()
    procs = [grt_launch("--launcher", "deepspeed", "--hosts", "localhost,127.0.0.1",
                        "--procs-per-node", "1", "--no-ssh", "--node-rank", str(nr),
                        "--master-addr", "127.0.0.1", "--master-port", str(port),
                        "--run-dir", str(tmp_path / f"node{nr}"), "--entry", "launcher.probe",
                        "--", "--out", str(tmp_path), background=True) for nr in (0, 1)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        outs.append(out)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    recs = probe_results(str(tmp_path), 2)
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in recs] == [(0, 0, 0), (1, 1, 0)]
    assert (tmp_path / "node0" / "hostfile").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"


@pytest.mark.parametrize("discovery", ["env", "mpi4py"])
def test_mpirun_two_ranks(tmp_path, discovery):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian package openmpi-bin)")
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install mpi4py)")
    extra = ["--env", "GRT_DIST_DISCOVERY=mpi4py"] if discovery == "mpi4py" else []
    grt_launch("--launcher", "mpi", "--procs-per-node", "2", "--master-port", str(free_port()),
               "--mpirun-args=--oversubscribe", *extra, "--entry", "launcher.probe",
               "--", "--out", str(tmp_path))
    recs = probe_results(str(tmp_path), 2)
    for r in recs:
        assert r["launcher"] == "mpi"
        assert (r["mpi4py_rank"], r["mpi4py_size"]) == (r["rank"], 2)
    assert [r["local_rank"] for r in recs] == [0, 1]


def test_failing_rank_fails_the_launch(tmp_path):
    cmd = [sys.executable, "-m", "pretrain.cli", "launch", "--launcher", "deepspeed",
           "--procs-per-node", "2", "--master-port", str(free_port()), "--entry", "launcher.probe",
           "--", "--out", str(tmp_path), "--fail-rank", "1"]
    r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
