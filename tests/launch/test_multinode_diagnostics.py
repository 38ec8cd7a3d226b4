"""The pre-flight check across 2 nodes (network namespaces, netns_cluster.py), 1 CPU rank per
node: the 2-node half of tests/launch/test_preflight.py. What a node adds: the pre-flight names
a slow NODE (its hostname) beside the slow rank.

Needs root (namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from launch_helpers import ROOT, _end_group, free_port, throttle, train_args
from netns_cluster import started_or_skip
from test_multinode import node_env

pytestmark = pytest.mark.slow

if os.geteuid() != 0:  # the other reasons (a tool missing, no `ip netns`) skip from the fixture
    pytest.skip("no namespace cluster: network namespaces need root", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_or_skip(str(tmp_path_factory.mktemp("netns-diag")))


def preflight_pid(cluster, node):
    """The pre-flight rank running in node `node`'s namespace (below sshd and the launcher there)."""
    for pid in cluster.pids(node):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and argv[argv.index(b"-m") + 1 :][:1] == [b"launcher.preflight"]:
            return pid  # not deepspeed's launcher there, whose arguments name the module too
    return None


def test_a_slowed_node_is_named_and_stops_the_launch(cluster, tmp_path):
    """`grt launch --preflight-only` from node 0 over the deepspeed runner (pdsh, ssh) with node 1's
    rank slowed: the table names node 1 by its hostname, and the launch exits non-zero."""
    out, log = tmp_path / "run", tmp_path / "launch.log"
    launch = ["--launcher", "deepspeed", "--hostfile", cluster.hostfile(), "--cpu", "--procs-per-node", "1"]
    launch += ["--master-port", str(free_port()), "--preflight-only", "--", *train_args(out, 2)]
    with open(log, "w") as f:
        proc = cluster.popen(
            0,
            [sys.executable, "-m", "pretrain.cli", "launch", *launch],
            env=node_env(cluster),
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    done = threading.Event()
    slowing = threading.Thread(target=throttle, args=(lambda: preflight_pid(cluster, 1), done), daemon=True)
    slowing.start()
    try:
        rc = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        raise
    finally:
        done.set()
        slowing.join(5)
    text = log.read_text(errors="replace")
    slow = cluster.names[1]
    assert rc != 0, text[-3000:]
    assert f"FAILED: rank 1 on {slow}: GEMM TFLOP/s" in text, text[-3000:]
    assert f"slowest node: 1 ({slow}), GEMM" in text, text[-3000:]
    record = json.loads((out / "launch" / "preflight.json").read_text())
    rows = {r["rank"]: r for r in record["rows"]}
    assert {r: (rows[r]["node"], rows[r]["host"]) for r in rows} == {0: (0, cluster.names[0]), 1: (1, slow)}
    assert rows[1]["gemm_tflops"] < 0.8 * rows[0]["gemm_tflops"], rows
    assert all(rows[r]["cross_busbw"] > 0 and rows[r]["node_busbw"] is None for r in rows), rows  # 1 rank a node
    assert record["failures"] and all(slow in f for f in record["failures"]), record["failures"]
    assert not (out / "metrics.jsonl").exists()  # no training started
