"""Hang forensics and the pre-flight check across 2 nodes (network namespaces, netns_cluster.py),
1 CPU rank per node: the 2-node halves of tests/faults/test_hang_forensics.py and
tests/launch/test_preflight.py. What a node adds: the ranks meet on one hang folder through the
store on node 0's host and each writes into it from its own host, and the pre-flight names a slow
NODE (its hostname) beside the slow rank.

Needs root (namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from launch_helpers import ROOT, _end_group, free_port, throttle, train_args
from netns_cluster import started_or_skip
from test_multinode import NodeRanks, node_env
from train_jobs import ckpt_tags, cli, last_step, latest, losses

from pretrain.distributed.hangs import analyze
from pretrain.training.report.forensics import JOIN_S

pytestmark = pytest.mark.slow

if os.geteuid() != 0:  # the other reasons (a tool missing, no `ip netns`) skip from the fixture
    pytest.skip("no namespace cluster: network namespaces need root", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_or_skip(str(tmp_path_factory.mktemp("netns-diag")))


def node_pid(cluster, node, *module):
    """The process in node `node`'s namespace running `python -m MODULE...` (a rank, below whatever
    started it there: sshd and a launcher, or nsenter's exec chain), or None."""
    want = [m.encode() for m in module]
    for pid in cluster.pids(node):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and argv[argv.index(b"-m") + 1 :][: len(want)] == want:
            return pid  # not deepspeed's launcher there, whose arguments name the module later
    return None


def state(pid):
    """The process's state letter (/proc/PID/stat: T is stopped)."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def folders(out):
    return sorted((out / "hangs").iterdir()) if (out / "hangs").is_dir() else []


def wait_for(predicate, timeout, ranks, what):
    deadline = time.time() + timeout
    while not predicate():
        alive = all(p.poll() is None for p in ranks.procs)
        assert alive and time.time() < deadline, f"waiting for {what}:\n{ranks.output(0)[-3000:]}"
        time.sleep(0.05)


def stacks_of_rank0(out, ranks):
    """Rank 0's own dump (SIGUSR2), for a failure's message: where it waits."""
    before = set(folders(out))
    ranks.procs[0].send_signal(signal.SIGUSR2)
    deadline = time.time() + 10
    while time.time() < deadline:
        for f in set(folders(out)) - before:
            if (f / "rank0.txt").is_file():
                return (f / "rank0.txt").read_text()[-6000:]
        time.sleep(0.1)
    return "(no dump from rank 0 either)"


def test_a_frozen_node_rank_leaves_a_folder_that_names_it(cluster, tmp_path):
    """SIGUSR2 to rank 0 (node 0): rank 1 on node 1 hears of it through the store and writes into the
    same folder from its host; then rank 1's process frozen with SIGSTOP: rank 0 writes alone and
    stops (exit 3) with a line naming rank 1 on node 1 and the folder, `grt hangs` names rank 1 and
    the collective rank 0 waits in, and nothing in the run is lost."""
    out, timeout_s = tmp_path / "run", 8
    # the timeout's request comes >= timeout_s after the freeze: a folder of its own, not the SIGUSR2 one
    assert timeout_s > JOIN_S
    args = train_args(out, 400, "tiny-grt", "--set", "train.save_every=2", "--set", f"train.dist_timeout_s={timeout_s}")
    ranks = NodeRanks(cluster, args, [tmp_path / f"node{r}.log" for r in range(2)], free_port())
    try:
        wait_for(lambda: last_step(out) >= 3, 240, ranks, "step 3")
        ranks.procs[0].send_signal(signal.SIGUSR2)
        wait_for(lambda: any((f / "rank1.json").is_file() for f in folders(out)), 30, ranks, "rank 1's dump")
        (asked,) = folders(out)
        wait_for(lambda: (asked / "rank0.json").is_file(), 10, ranks, "rank 0's dump")
        dumps = {r: json.loads((asked / f"rank{r}.json").read_text()) for r in (0, 1)}
        assert {r: d["host"] for r, d in dumps.items()} == {0: cluster.names[0], 1: cluster.names[1]}
        # the rank's own process, as it said in its dump and as node 1's namespace shows it
        pid = dumps[1]["pid"]
        assert pid == node_pid(cluster, 1, "pretrain.cli", "train"), (pid, cluster.pids(1))
        frozen_at, t_freeze = last_step(out), time.time()
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: state(pid) == "T", 5, ranks, f"rank 1 (pid {pid}) stopped")
        try:
            ranks.procs[0].wait(timeout=timeout_s + 40)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"node 0's rank still running {timeout_s + 40} s after rank 1 (pid {pid}, state {state(pid)}) "
                f"was frozen:\n{ranks.output(0)[-3000:]}\n--- rank 0's stacks ---\n{stacks_of_rank0(out, ranks)}"
            )
        to_exit = time.time() - t_freeze
    finally:
        ranks.kill()  # SIGKILL ends a stopped process too
    log0 = ranks.output(0)
    assert ranks.procs[0].returncode == 3, log0[-3000:]  # stopped (the error boundary's code)
    new = [f for f in folders(out) if f != asked]
    assert len(new) == 1, (folders(out), log0[-3000:])
    hang = new[0]
    stop = next(ln for ln in log0.splitlines() if "grt train: stopped:" in ln)
    assert "rank 0 stopping: rank 1" in stop and f"on host {cluster.names[1]}" in stop, stop
    assert f"(grt hangs {hang})" in stop, stop
    assert (hang / "rank0.json").is_file() and not (hang / "rank1.json").exists()  # the frozen rank wrote nothing
    assert json.loads((hang / "rank0.json").read_text())["host"] == cluster.names[0]
    report = "\n".join(analyze(hang))
    assert "behind: rank(s) 1: no dump" in report, report
    assert "rank(s) 0 wait in gloo:" in report, report
    said = subprocess.run(cli("hangs", str(hang)), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert said.returncode == 0 and said.stdout.strip() == report, said.stdout + said.stderr
    # nothing lost: every step's record, a complete checkpoint, the first folder whole
    assert sorted(losses(out)) == list(range(1, max(losses(out)) + 1)) and max(losses(out)) >= frozen_at
    assert latest(out) is not None and ckpt_tags(out)[latest(out)]
    assert {p.name for p in asked.iterdir()} >= {"rank0.txt", "rank1.txt", "rank0.json", "rank1.json"}
    assert (out / "train.log").is_file() and (out / "config.json").is_file()
    to_folder = (hang / "rank0.json").stat().st_mtime - t_freeze
    print(f"from the freeze: rank 0's dump after {to_folder:.1f} s, its exit after {to_exit:.1f} s")


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
    rank1 = functools.partial(node_pid, cluster, 1, "launcher.preflight")
    slowing = threading.Thread(target=throttle, args=(rank1, done), daemon=True)
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
