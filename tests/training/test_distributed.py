"""Rank discovery from each launcher's environment, and the 1-process group."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pretrain.distributed import DistInfo, discover, expand_nodelist, parse_tasks_per_node

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[001-003,7]", ["gpu001", "gpu002", "gpu003", "gpu7"]),
        ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("login-a[1-2]-ib", ["login-a1-ib", "login-a2-ib"]),
        ("h1.example.org,h2.example.org", ["h1.example.org", "h2.example.org"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_matches_scontrol(tmp_path):
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not installed (Debian package slurm-client/slurm-wlm)")
    conf = tmp_path / "slurm.conf"  # scontrol wants some configuration, even to expand names
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=localhost\n")
    expr = "gpu[001-003,7],x[1-2]y[3-4],login,rack[1-2]-n[08-10]"
    r = subprocess.run(
        ["scontrol", "show", "hostnames", expr],
        capture_output=True,
        text=True,
        env=dict(os.environ, SLURM_CONF=str(conf)),
    )
    if r.returncode != 0:
        pytest.skip(f"scontrol show hostnames needs a configuration here: {r.stderr.strip()[:200]}")
    assert expand_nodelist(expr) == r.stdout.split()


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("8(x4)") == [8, 8, 8, 8]
    assert parse_tasks_per_node("2(x2),1") == [2, 2, 1]
    assert parse_tasks_per_node("4") == [4]


def test_discover_single():
    info = discover({})
    assert info == DistInfo(0, 0, 1, 1, 0, "127.0.0.1", 29500, "single")
    assert info.is_main and info.num_nodes == 1


def test_discover_torchrun():
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "1234",
    }
    assert discover(env) == DistInfo(5, 1, 8, 4, 1, "n0", 1234, "torchrun/deepspeed")


def test_discover_deepspeed_launch():
    # what deepspeed.launcher.launch exports on the second of 4 nodes with 8 GPUs each
    env = {
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "32",
        "LOCAL_SIZE": "8",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert discover(env) == DistInfo(9, 1, 32, 8, 1, "10.0.0.1", 29500, "torchrun/deepspeed")


def test_discover_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "10",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "32",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "6000",
    }
    assert discover(env) == DistInfo(10, 2, 32, 8, 1, "n0", 6000, "mpi")
    # one node, no MASTER_ADDR: loopback
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert discover(env).master_addr == "127.0.0.1"


def test_discover_pmi_with_local_info():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"}
    assert discover(env) == DistInfo(3, 1, 4, 2, 1, "h0", 29500, "mpi")


def _slurm_step_env(**over):
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[007-010]",
        "SLURM_NTASKS": "32",
        "SLURM_TASKS_PER_NODE": "8(x4)",
        "SLURM_PROCID": "13",
        "SLURM_LOCALID": "5",
        "SLURM_NODEID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "32",
        "SLURM_STEP_TASKS_PER_NODE": "8(x4)",
        "SLURM_STEP_NODELIST": "gpu[007-010]",
    }
    env.update(over)
    return env


def test_discover_slurm_step():
    info = discover(_slurm_step_env())
    assert info == DistInfo(13, 5, 32, 8, 1, "gpu007", 20000 + 4242 % 20000, "slurm")
    info = discover(_slurm_step_env(MASTER_ADDR="10.1.1.1", MASTER_PORT="7777"))
    assert (info.master_addr, info.master_port) == ("10.1.1.1", 7777)


def test_discover_slurm_batch_shell_is_not_a_rank():
    # the batch script itself has SLURM_PROCID=0 and SLURM_NTASKS=32 but is no rank of 32
    env = _slurm_step_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    for k in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST"):
        del env[k]
    assert discover(env).launcher == "single"


def test_discover_precedence():
    # the deepspeed runner started inside a Slurm step: RANK/WORLD_SIZE win
    env = _slurm_step_env(RANK="3", LOCAL_RANK="3", WORLD_SIZE="4", LOCAL_SIZE="4")
    assert discover(env).launcher == "torchrun/deepspeed"


PROBE = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from pretrain import distributed as d
    a = d.init_distributed(timeout_s=60)
    b = d.init_distributed()
    t = torch.ones(1); dist.all_reduce(t); d.barrier()
    from deepspeed.utils import groups  # ZeRO's reductions run in DeepSpeed's copy of the world group
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in (dist.group.WORLD, groups._clone_world_group(), dist.new_group())]
    print(json.dumps({"same": a is b, "world": dist.get_world_size(), "backend": dist.get_backend(),
                      "timeouts": timeouts,
                      "sum": t.item(), "main": d.is_main(), "info": a.to_dict(),
                      "env_rank": __import__("os").environ["RANK"]}))
""")


def test_init_distributed_single_process():
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_"))
    }
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["same"] and out["main"] and out["world"] == 1 and out["sum"] == 1.0
    assert out["backend"] == "gloo" and out["env_rank"] == "0"
    assert out["timeouts"] == [60, 60, 60]  # every group waits the run's timeout, DeepSpeed's included
    assert out["info"]["launcher"] == "single" and out["info"]["master_port"] != 29500
