"""`grt launch` trains a few steps of the tiny preset through each real launcher (CPU, gloo):
the deepspeed runner with 2 local ranks, two "nodes" on one machine (the per-node launch run
twice with node rank 0 and 1), and `mpirun -np 2` with ranks found through mpi4py.
Slurm is in test_launcher_slurm.py."""
import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_helpers import check_trained, clean_env, free_port, grt_launch, train_args, wait_all  # noqa: E402

pytestmark = pytest.mark.slow


def same_config_on_every_rank(out):
    """The config resolved by `grt launch` is the one the ranks trained with."""
    launched = json.load(open(os.path.join(out, "launch", "config.json")))
    used = json.load(open(os.path.join(out, "config.json")))  # written by rank 0 of the trainer
    assert launched == used
    assert launched["model"]["name"] == "tiny-grt" and launched["out"] == str(out)


def test_deepspeed_runner_trains_two_ranks(tmp_path):
    out = tmp_path / "run"
    grt_launch("--launcher", "deepspeed", "--procs-per-node", "2", "--master-port", str(free_port()),
               "--", *train_args(out, 4))
    rank0, summary = check_trained(out, 4)
    assert not summary["stopped_by_signal"]
    same_config_on_every_rank(out)
    record = json.load(open(out / "launch" / "launch.json"))
    assert record["launcher"] == "deepspeed" and "--no_local_rank" in record["command"]


def test_two_nodes_on_one_machine_agree_on_the_loss(tmp_path):
    out = tmp_path / "run"
    port = free_port()
    procs = [grt_launch("--launcher", "deepspeed", "--hosts", "localhost,127.0.0.1", "--procs-per-node", "1",
                        "--no-ssh", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                        "--master-port", str(port), "--run-dir", str(tmp_path / f"node{node}"),
                        "--", *train_args(out, 4), background=tmp_path / f"node{node}.log")
             for node in (0, 1)]
    wait_all(procs, [tmp_path / f"node{node}.log" for node in (0, 1)])
    # rank 0 ran on "node" 0 and rank 1 on "node" 1; both logged the same losses
    rank0, _ = check_trained(out, 4)
    assert len({r["loss"] for r in rank0}) > 1
    # each node resolved the same config
    a = json.load(open(tmp_path / "node0" / "launch" / "config.json"))
    b = json.load(open(tmp_path / "node1" / "launch" / "config.json"))
    assert a == b == json.load(open(out / "config.json"))


def test_mpirun_trains_two_ranks_found_through_mpi4py(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian package openmpi-bin)")
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install mpi4py)")
    out = tmp_path / "run"
    r = grt_launch("--launcher", "mpi", "--procs-per-node", "2", "--master-port", str(free_port()),
                   "--env", "GRT_DIST_DISCOVERY=mpi4py", "--mpirun-args=--oversubscribe",
                   "--", *train_args(out, 4), env=clean_env())
    check_trained(out, 4)
    same_config_on_every_rank(out)
    assert "-np 2" in r.stdout
