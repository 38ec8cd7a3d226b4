"""`grt launch` trains a few steps of the tiny preset through each real launcher (CPU, gloo):
the deepspeed runner with 2 local ranks, two "nodes" on one machine (the per-node launch run
twice with node rank 0 and 1), and `mpirun -np 2` with ranks found through mpi4py; and the
plain `deepspeed` and `torchrun` commands on the training entry point, as their users type them.
Slurm is in test_launcher_slurm.py."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_helpers import ROOT, check_trained, clean_env, free_port, grt_launch, train_args, wait_all  # noqa: E402

pytestmark = pytest.mark.slow


def same_config_on_every_rank(out):
    """The config resolved by `grt launch` is the one the ranks trained with."""
    launched = json.load(open(os.path.join(out, "launch", "config.json")))
    used = json.load(open(os.path.join(out, "config.json")))  # written by rank 0 of the trainer
    assert launched == used
    assert launched["model"]["name"] == "tiny-grt" and launched["out"] == str(out)


def test_deepspeed_runner_trains_two_ranks(tmp_path):
    out = tmp_path / "run"
    grt_launch(
        "--launcher", "deepspeed", "--procs-per-node", "2", "--master-port", str(free_port()), "--", *train_args(out, 4)
    )
    rank0, summary = check_trained(out, 4)
    assert not summary["stopped_by_signal"]
    same_config_on_every_rank(out)
    record = json.load(open(out / "launch" / "launch.json"))
    assert record["launcher"] == "deepspeed" and "--no_local_rank" in record["command"]


def test_two_nodes_on_one_machine_agree_on_the_loss(tmp_path):
    out = tmp_path / "run"
    port = free_port()
    procs = [
        grt_launch(
            "--launcher",
            "deepspeed",
            "--hosts",
            "localhost,127.0.0.1",
            "--procs-per-node",
            "1",
            "--no-ssh",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--run-dir",
            str(tmp_path / f"node{node}"),
            "--",
            *train_args(out, 4),
            background=tmp_path / f"node{node}.log",
        )
        for node in (0, 1)
    ]
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
    r = grt_launch(
        "--launcher",
        "mpi",
        "--procs-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "--env",
        "GRT_DIST_DISCOVERY=mpi4py",
        "--mpirun-args=--oversubscribe",
        "--",
        *train_args(out, 4),
        env=clean_env(),
    )
    check_trained(out, 4)
    same_config_on_every_rank(out)
    assert "-np 2" in r.stdout


def plain_train_args(out, steps, ds_config):
    """train_args() with another DeepSpeed file in place of its --ds-config."""
    args = train_args(out, steps)
    i = args.index("--ds-config")
    return args[:i] + args[i + 2 :] + ds_config


def run_plain(cmd, cwd, env, timeout=400):
    """A launcher command as its users type it (own process group, ended on a timeout)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    return out


def test_plain_deepspeed_module_with_megatron_flags(tmp_path):
    """`deepspeed --num_gpus 2 --module pretrain.train --deepspeed --deepspeed_config ds.json`:
    the runner's --local_rank=N is accepted, the HF-style "auto" file is filled and saved."""
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            }
        )
    )
    out = tmp_path / "run"
    cmd = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "pretrain.train",
        *plain_train_args(out, 3, ["--deepspeed", "--deepspeed_config", str(ds)]),
    ]
    run_plain(cmd, ROOT, clean_env())
    check_trained(out, 3)
    saved = json.load(open(out / "ds_config.json"))
    assert saved["train_batch_size"] == 2 * 1 * 2 and saved["gradient_clipping"] == 1.0
    # "auto" dropped (DeepSpeed's default), overlap_comm filled for 2 ranks (ds_config._zero_defaults)
    assert saved["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert saved["optimizer"]["params"]["torch_adam"] is True


def test_plain_torchrun_script_path_outside_the_checkout(tmp_path):
    """`torchrun --nproc_per_node 2 <checkout>/pretrain/train.py` from another directory, without
    PYTHONPATH: the script imports its own checkout and finds a shipped DeepSpeed file by name."""
    out = tmp_path / "run"
    env = clean_env()
    env.pop("PYTHONPATH")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "pretrain", "train.py"),
        *plain_train_args(out, 3, ["--ds-config", "zero1.json"]),
    ]
    run_plain(cmd, str(tmp_path), env)
    check_trained(out, 3)
    assert json.load(open(out / "ds_config.json"))["zero_optimization"]["stage"] == 1
