"""Real multi-process launches on this machine, through `grt launch`, with the probe program.

`launcher.probe` calls `pretrain.distributed.init_distributed()`, all-reduces its rank and
writes what it discovered, so each test proves the launch path and the rank discovery
with the real tool: torchrun, the deepspeed runner (two "nodes" on one machine with --no-ssh
and node ranks 0 and 1; a failing rank fails the launch), and `mpirun -np 2` (environment and
mpi4py). The deepspeed runner with 2 local ranks trains in test_launcher_train.py.
Training through each launcher is in test_launcher_train.py; Slurm is in test_launcher_slurm.py.
"""

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_helpers import free_port, grt_launch, probe_results, wait_all  # noqa: E402

pytestmark = pytest.mark.slow


def test_local_torchrun_two_ranks(tmp_path):
    grt_launch(
        "--launcher", "local", "--procs-per-node", "2", "--entry", "launcher.probe", "--", "--out", str(tmp_path)
    )
    recs = probe_results(str(tmp_path), 2)
    assert [r["local_rank"] for r in recs] == [0, 1]
    assert all(r["launcher"] == "torchrun/deepspeed" for r in recs)
    launch = json.load(open(tmp_path / "launch" / "launch.json"))
    assert launch["launcher"] == "local" and launch["world_size"] == 2


def test_deepspeed_two_nodes_on_one_machine(tmp_path):
    """The per-node launch run twice (node rank 0 and 1), one master address, no ssh."""
    port = free_port()
    logs = [tmp_path / f"node{nr}.log" for nr in (0, 1)]
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
            str(nr),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--run-dir",
            str(tmp_path / f"node{nr}"),
            "--entry",
            "launcher.probe",
            "--",
            "--out",
            str(tmp_path),
            background=logs[nr],
        )
        for nr in (0, 1)
    ]
    wait_all(procs, logs)
    recs = probe_results(str(tmp_path), 2)
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in recs] == [(0, 0, 0), (1, 1, 0)]
    assert (tmp_path / "node0" / "launch" / "hostfile").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"


def test_mpirun_two_ranks(tmp_path):
    """mpirun with a hostfile; ranks from OMPI_COMM_WORLD_*, checked against mpi4py (test_launcher_train.py trains
    with GRT_DIST_DISCOVERY=mpi4py, ranks asked from mpi4py itself)."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian package openmpi-bin)")
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install mpi4py)")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")  # mpirun starts local ranks without ssh
    grt_launch(
        "--launcher",
        "mpi",
        "--hostfile",
        str(hostfile),
        "--master-port",
        str(free_port()),
        "--mpirun-args=--oversubscribe",
        "--entry",
        "launcher.probe",
        "--",
        "--out",
        str(tmp_path),
    )
    recs = probe_results(str(tmp_path), 2)
    for r in recs:
        assert r["launcher"] == "mpi"
        assert (r["mpi4py_rank"], r["mpi4py_size"]) == (r["rank"], 2)
    assert [r["local_rank"] for r in recs] == [0, 1]


def test_failing_rank_fails_the_launch(tmp_path):
    r = grt_launch(
        "--launcher",
        "deepspeed",
        "--procs-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "--entry",
        "launcher.probe",
        "--",
        "--out",
        str(tmp_path),
        "--fail-rank",
        "1",
        check=False,
    )
    # the launch says which rank failed with its code (rank 0 exits 1 when its peer is gone: the verdict)
    ended = [line for line in r.stderr.splitlines() if line.startswith("grt launch: the ranks ended: ")]
    assert len(ended) == 1 and "rank 1 exit 3" in ended[0], r.stderr[-4000:]
    assert r.returncode in (1, 3) and ended[0].endswith(f"; exit {r.returncode}"), (r.returncode, ended)
