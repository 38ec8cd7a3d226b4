"""Elastic runs: `grt launch --elastic MIN:MAX` (torchrun's elastic agent on every node) and what
makes a restarted worker group continue the run without a person.

Fast: the launch it builds (checked by torchrun's own argument parser and `bash -n`), its
refusals (one line each), the Slurm node range, and the metrics of a run that resumes after a
kill (MetricsWriter: no step twice, none missing, in metrics.jsonl and in TensorBoard).

Slow (several processes): the probe under plain torchrun, whose restarted worker group meets
through the agent's store that still holds the group before's keys; then on a 2-node namespace
cluster (tests/netns_cluster.py, root), one CPU rank per node, `tiny-grt`: node 1 lost (agent
and worker SIGKILLed: the group restarts on node 0 alone, on a world size that the trainer must
resume on, and reproduces an uninterrupted 2-node run's losses).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_helpers import ROOT, _end_group, clean_env, complete_lines, grt_launch, train_args  # noqa: E402
from multiproc import free_port  # noqa: E402

from launcher.builders import elastic_run_id  # noqa: E402
from launcher.cli import build_plan, main  # noqa: E402
from launcher.parser import DEFAULT_RESTARTS  # noqa: E402
from pretrain.training.report.metrics import MetricsWriter  # noqa: E402

TRAIN = ["--preset", "grt-small", "--data", "data/shards/manifest.json", "--out", "runs/grt-small"]
RUN_DIR = os.path.abspath("runs/grt-small")
CONFIG = os.path.join(RUN_DIR, "launch", "config.json")


# --------------------------------------------------------------------------- helpers (also for the trainer's tests)


def step_records(path: str | os.PathLike[str]) -> list[dict]:
    """The records of a metrics.jsonl, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_losses(path: str | os.PathLike[str], steps: int | None = None) -> dict[int, float]:
    """step -> loss of a metrics.jsonl that must hold every step once: AssertionError naming the
    steps recorded twice, and (with `steps`) those missing from 1..steps or beyond it."""
    records = step_records(path)
    seen = [r["step"] for r in records]
    twice = sorted({s for s in seen if seen.count(s) > 1})
    assert not twice, f"{path}: steps recorded more than once: {twice}"
    if steps is not None:
        missing = sorted(set(range(1, steps + 1)) - set(seen))
        extra = sorted(set(seen) - set(range(1, steps + 1)))
        assert not missing and not extra, f"{path}: steps missing {missing}, beyond {steps}: {extra}"
    return {r["step"]: r["loss"] for r in records}


def assert_losses_equal(got: dict[int, float], reference: dict[int, float], tol: float = 2e-5) -> float:
    """Every step of `reference` with the same loss in `got` (to `tol`); returns the largest difference."""
    assert sorted(got) == sorted(reference), (sorted(got), sorted(reference))
    worst = max(abs(got[s] - reference[s]) for s in reference)
    assert worst < tol, {s: (got[s], reference[s]) for s in reference if abs(got[s] - reference[s]) >= tol}
    return worst


def tb_series(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a TensorBoard scalar series, as TensorBoard loads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# --------------------------------------------------------------------------- metrics across a restart


def _write_steps(writer: MetricsWriter, steps: range, offset: float) -> None:
    """What the trainer writes per step: the step-axis scalars, the same against tokens, the record."""
    for step in steps:
        loss = step + offset
        writer.scalars(step, {"train/loss": loss, "train/lr": 0.1})
        writer.scalars_by_tokens(step * 100, {"train/loss": loss})
        writer.step_record(step, {"loss": loss})


def _killed_run(out: Path, steps: int) -> None:
    """Rank 0 and rank 1 of a run killed after `steps` steps, with a record and an event cut off."""
    first, second = MetricsWriter(out, 0), MetricsWriter(out, 1)
    first.text("config", "killed run")
    _write_steps(first, range(1, steps + 1), 0.0)
    _write_steps(second, range(1, steps + 1), 0.0)
    first.close()
    second.close()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "lo')  # the write the kill interrupted
    (event_file,) = (out / "tb").glob("events.out.tfevents.*")
    with open(event_file, "ab") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00\x01\x02")  # a record header and no record


@pytest.mark.parametrize("told", [True, False], ids=["resume_step", "inferred"])
def test_resumed_metrics_hold_every_step_once(tmp_path, told):
    """A run killed after step 10, resumed from its checkpoint of step 6: metrics.jsonl (and
    metrics.rank1.jsonl) and the TensorBoard series, the step-axis ones and the by_tokens/ ones,
    hold steps 1-12 once each, 7-12 from the resumed run; the cut-off line and event are gone.
    Told the step (`resume_step=6`) or not: then the first step written (7) tells it."""
    out = tmp_path / "run"
    _killed_run(out, 10)
    kw = {"resume_step": 6} if told else {}
    first, second = MetricsWriter(out, 0, **kw), MetricsWriter(out, 1, **kw)
    first.text("config", "resumed run")
    _write_steps(first, range(7, 13), 0.5)
    _write_steps(second, range(7, 13), 0.5)
    first.close()
    second.close()
    expected = {s: s + (0.5 if s > 6 else 0.0) for s in range(1, 13)}
    assert step_losses(out / "metrics.jsonl", 12) == expected
    assert step_losses(out / "metrics.rank1.jsonl", 12) == expected
    assert tb_series(out / "tb", "train/loss") == sorted(expected.items())
    assert [s for s, _ in tb_series(out / "tb", "train/lr")] == list(range(1, 13))
    assert tb_series(out / "tb", "by_tokens/train/loss") == [(100 * s, v) for s, v in sorted(expected.items())]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert len(events.Tensors("config/text_summary")) == 2  # each run's config


def test_a_fresh_start_drops_an_interrupted_runs_records(tmp_path):
    """A run killed before its first checkpoint leaves records; the restart is a fresh start
    (resume_step=0, or nothing said and step 1 written first) and keeps none of them. Without a
    step written, nothing is trimmed (a resume of a finished run)."""
    for kw in ({"resume_step": 0}, {}):
        out = tmp_path / f"run{len(kw)}"
        _killed_run(out, 5)
        writer = MetricsWriter(out, 0, **kw)
        _write_steps(writer, range(1, 3), 0.5)
        writer.close()
        assert step_losses(out / "metrics.jsonl", 2) == {1: 1.5, 2: 2.5}
        assert tb_series(out / "tb", "train/loss") == [(1, 1.5), (2, 2.5)]
    out = tmp_path / "finished"
    _killed_run(out, 3)
    before = (out / "metrics.jsonl").read_text()
    writer = MetricsWriter(out, 0)
    writer.text("config", "nothing to train")
    writer.close()
    assert (out / "metrics.jsonl").read_text() == before


# --------------------------------------------------------------------------- the launch


def elastic_plan(*extra: str, environ: dict | None = None):
    argv = ["--elastic", "1:4", "--gpus-per-node", "8", *extra, "--dry-run", "--", *TRAIN]
    plan, _ = build_plan(argv, environ={"PATH": os.environ["PATH"]} if environ is None else environ)
    return plan


def test_elastic_launch_is_one_torchrun_command_for_every_node(tmp_path):
    """`--elastic 1:4`: torchrun with a c10d rendezvous at --master-addr:--master-port, the run
    directory's id, 3 restarts, and --resume; the same command (with the ranks' environment) in
    <run dir>/launch/elastic.sh for the other nodes. Checked by torchrun's own parser and bash -n."""
    from torch.distributed.run import get_args_parser

    plan = elastic_plan("--master-addr", "n0", "--master-port", "29400", "--max-restarts", "5")
    cmd = plan.command
    run_id = elastic_run_id(RUN_DIR)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == [
        "--nnodes",
        "1:4",
        "--nproc-per-node",
        "8",
        "--max-restarts",
        "5",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "n0:29400",
        "--rdzv-id",
        run_id,
        "-m",
        "pretrain.cli",
        "train",
        "--config-json",
        CONFIG,
        "--resume",
    ]
    targs = get_args_parser().parse_args(cmd[3:])
    assert (targs.nnodes, targs.nproc_per_node, targs.max_restarts) == ("1:4", "8", 5)
    assert (targs.rdzv_backend, targs.rdzv_endpoint, targs.rdzv_id, targs.module) == ("c10d", "n0:29400", run_id, True)
    assert [targs.training_script, *targs.training_script_args] == [
        "pretrain.cli",
        "train",
        "--config-json",
        CONFIG,
        "--resume",
    ]
    assert plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    script = plan.files[os.path.join(RUN_DIR, "launch", "elastic.sh")]
    assert script.splitlines()[-1] == "exec " + shlex.join(cmd)
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script and f"cd {shlex.quote(os.getcwd())}" in script
    path = tmp_path / "elastic.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert "on every other node run: bash" in plan.summary
    assert plan.record["elastic"] == {"nodes": [1, 4], "max_restarts": 5}


def test_elastic_defaults_and_dry_run_output(capsys):
    """Without --master-addr: this host by name (the others must reach it), port 29500, 3 restarts;
    N means N:N. The dry run's last line is the command; --rank-logs and --rdzv-conf pass to torchrun."""
    plan = elastic_plan()
    assert plan.command[plan.command.index("--rdzv-endpoint") + 1] == f"{socket.gethostname()}:29500"
    assert plan.command[plan.command.index("--max-restarts") + 1] == str(DEFAULT_RESTARTS) == "3"
    plan = elastic_plan("--rank-logs", "--rdzv-conf", "last_call_timeout=5", environ={"MASTER_ADDR": "head"})
    assert "--rdzv-endpoint" in plan.command and "head:29500" in plan.command
    i = plan.command.index("--rdzv-conf")
    assert plan.command[i : i + 2] == ["--rdzv-conf", "last_call_timeout=5"]
    assert plan.command[plan.command.index("--log-dir") + 1] == os.path.join(RUN_DIR, "logs")
    assert main(["--elastic", "2", "--cpu", "--procs-per-node", "2", "--dry-run", "--", *TRAIN]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")
    assert " -m torch.distributed.run --nnodes 2:2 --nproc-per-node 2 --max-restarts 3 " in last
    assert last.endswith(f"--config-json {CONFIG} --resume")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--elastic", "3:2"], "--elastic 3:2: MIN (3) is above MAX (2)"),
        (["--elastic", "0:2"], "--elastic 0:2: MIN must be at least 1 node, not 0"),
        (["--elastic=-1:2"], "--elastic -1:2: MIN must be at least 1 node, not -1"),
        (["--elastic", "1:x"], "--elastic '1:x': expected MIN:MAX, whole numbers of nodes (e.g. 1:4), or N for N:N"),
        (["--elastic", "1.5"], "--elastic '1.5': expected MIN:MAX, whole numbers of nodes (e.g. 1:4), or N for N:N"),
        (
            ["--launcher", "mpi", "--elastic", "1:2"],
            "--elastic with --launcher mpi: mpirun ends the whole job when a rank dies and cannot restart it; use "
            "--launcher local (torchrun's elastic agent on every node) or --launcher slurm (a requeue on MIN to MAX "
            "nodes)",
        ),
        (
            ["--launcher", "deepspeed", "--elastic", "1:2"],
            "--elastic with --launcher deepspeed: the deepspeed runner ends the whole job when a rank dies and cannot "
            "restart it; use --launcher local (torchrun's elastic agent on every node) or --launcher slurm (a requeue "
            "on MIN to MAX nodes)",
        ),
        (["--elastic", "1:2", "--nodes", "2"], "--elastic and --nodes exclude each other: MIN:MAX is the node count"),
        (
            ["--elastic", "1:2", "--hosts", "a,b"],
            "--elastic and --hosts exclude each other: every node runs the same command; name the rendezvous host "
            "with --master-addr",
        ),
        (
            ["--elastic", "1:2", "--no-auto-resume"],
            "--elastic and --no-auto-resume exclude each other: a restarted worker group must resume from the "
            "newest checkpoint",
        ),
        (["--max-restarts", "2"], "--max-restarts goes with --elastic (torchrun's elastic agent)"),
        (["--rdzv-conf", "a=1"], "--rdzv-conf goes with --elastic (torchrun's elastic agent)"),
        (["--elastic", "1:2", "--max-restarts=-1"], "--max-restarts -1: must be >= 0"),
        (
            ["--launcher", "slurm", "--cpu", "--elastic", "1:2", "--max-restarts", "2"],
            "--max-restarts with --launcher slurm: a Slurm job is restarted by a requeue (--requeue), not by "
            "torchrun's agent",
        ),
    ],
)
def test_elastic_refusals_are_one_line(capsys, args, message):
    assert main([*args, "--dry-run", "--", *TRAIN]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"grt launch: {message}\n")


def test_slurm_elastic_asks_for_a_node_range():
    """Under Slurm --elastic MIN:MAX is `#SBATCH --nodes=MIN-MAX`: the job (and a requeued one)
    starts on as many nodes as are free in the range, and resumes (--resume) on that world size."""
    for spec, line in (("2:4", "#SBATCH --nodes=2-4"), ("3", "#SBATCH --nodes=3")):
        plan, _ = build_plan(
            ["--launcher", "slurm", "--cpu", "--elastic", spec, "--requeue", "--dry-run", "--", *TRAIN],
            environ={"PATH": os.environ["PATH"]},
        )
        script = next(iter(v for k, v in plan.files.items() if k.endswith("slurm.sbatch")))
        assert line in script.splitlines() and "#SBATCH --requeue" in script
        assert f"--config-json {CONFIG} --resume" in script


# --------------------------------------------------------------------------- restarts (processes)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _wait(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            tail = open(log, errors="replace").read()[-4000:] if log and log.exists() else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.05)


def _probe_step(progress: Path) -> int:
    try:
        return int(json.loads(progress.read_text())["step"])
    except (OSError, ValueError, KeyError):  # not written yet, or being rewritten
        return 0


@pytest.mark.slow
def test_plain_torchrun_restart_meets_in_a_fresh_store(tmp_path):
    """Plain torchrun (its shared agent store, torch's default), 2 probe ranks, rank 1 SIGKILLed:
    the agent restarts the group, whose ranks meet through the agent's store although it still
    holds the killed group's keys (pretrain/distributed/rendezvous.py `_round_store`), and finish. Before,
    the restarted ranks read the killed group's gloo addresses there and failed to connect."""
    out = tmp_path / "probe"
    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += ["--rdzv-id", "probe", "-m", "launcher.probe", "--out", str(out), "--steps", "40", "--step-time", "0.1"]
    env = clean_env(OMP_NUM_THREADS="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    with open(log, "w") as f:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        progress = out / "probe-progress.json"
        _wait(lambda: _probe_step(progress) >= 3, 120, "3 probe steps", log)
        (rank1,) = [p for p in _children(agent.pid) if _env_of(p).get("RANK") == "1"]
        assert _env_of(rank1)["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        os.kill(rank1, signal.SIGKILL)
        assert agent.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        _end_group(agent)
    text = log.read_text()
    assert text.count("failed (exitcode") == 1 and "connectFullMesh failed" not in text, text[-4000:]
    for rank in (0, 1):
        record = json.loads((out / f"probe-rank{rank}.json").read_text())
        assert record["finished"] and record["allreduce_sum"] == 3.0 and record["dist_world_size"] == 2


# --------------------------------------------------------------------------- on the namespace cluster

STEPS = 40
SAVE_EVERY = 5
KILL_AFTER = 12  # complete steps in metrics.jsonl when node 1 is hit
# the model's training noise is drawn per rank: off, so that a run on another world size has the same losses
NO_NOISE = ("model.state_noise_std=0", "model.gate_noise_std=0")


def run_args(out) -> list[str]:
    sets = [f"train.save_every={SAVE_EVERY}", *NO_NOISE]
    return train_args(out, STEPS, "tiny-grt", *[w for s in sets for w in ("--set", s)])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("no namespace cluster: network namespaces need root")
    from netns_cluster import started_or_skip

    yield from started_or_skip(str(tmp_path_factory.mktemp("elastic-cluster")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run: 2 ranks on one machine, the same global batch."""
    out = tmp_path_factory.mktemp("elastic-reference") / "run"
    grt_launch("--procs-per-node", "2", "--master-port", str(free_port()), "--", *run_args(out))
    return step_losses(out / "metrics.jsonl", STEPS)


def node_env(cluster) -> dict[str, str]:
    env = clean_env(OMP_NUM_THREADS="1", NCCL_SOCKET_IFNAME="eth0")
    env["PATH"] = cluster.env["PATH"]
    return env


def node_processes(cluster, node: int) -> dict[str, list[int]]:
    """The torchrun agent(s) and training worker(s) running on `node`."""
    found: dict[str, list[int]] = {"agent": [], "worker": []}
    for pid in cluster.pids(node):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" in argv[:4]:
            found["agent"].append(pid)
        elif b"pretrain.cli" in argv[:5] and b"train" in argv[:6]:  # torchrun starts `python -u -m pretrain.cli train`
            found["worker"].append(pid)
    return found


class ElasticRun:
    """`grt launch --elastic 1:2` on node 0, then its <run dir>/launch/elastic.sh on node 1."""

    def __init__(self, cluster, out: Path, logs: Path, max_restarts: int) -> None:
        self.out, self.logs = out, logs
        port = free_port()
        launch = ["--elastic", "1:2", "--cpu", "--procs-per-node", "1", "--master-port", str(port)]
        # a lost node is dropped from the rendezvous after 2 s x 3 missed keep-alives (default 5 s x 3)
        launch += ["--max-restarts", str(max_restarts), "--rdzv-conf", "keep_alive_interval=2"]
        self.procs: list[subprocess.Popen] = []
        self._start(cluster, 0, [sys.executable, "-m", "pretrain.cli", "launch", *launch, "--", *run_args(out)])
        script = out / "launch" / "elastic.sh"
        _wait(lambda: script.is_file() and self.procs[0].poll() is None, 120, "elastic.sh", self.log(0))
        self._start(cluster, 1, ["bash", str(script)])

    def _start(self, cluster, node: int, cmd: list[str]) -> None:
        with open(self.log(node), "w") as f:
            self.procs.append(
                cluster.popen(
                    node,
                    cmd,
                    env=node_env(cluster),
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def log(self, node: int) -> Path:
        return self.logs / f"node{node}.log"

    def text(self, node: int) -> str:
        return self.log(node).read_text(errors="replace")

    def wait_steps(self, n: int, timeout: float = 240) -> None:
        metrics = self.out / "metrics.jsonl"
        _wait(
            lambda: complete_lines(metrics) >= n and all(p.poll() is None for p in self.procs),
            timeout,
            f"{n} steps",
            self.log(0),
        )

    def stop(self) -> None:
        for p in self.procs:
            _end_group(p)


def watch_restart(out: Path, until: subprocess.Popen, timeout: float) -> list[tuple[float, int, set[int]]]:
    """(time, inode, steps) of metrics.jsonl every 0.05 s, until `until` ends."""
    path = out / "metrics.jsonl"
    seen: list[tuple[float, int, set[int]]] = []
    deadline = time.time() + timeout
    while until.poll() is None and time.time() < deadline:
        try:
            inode = os.stat(path).st_ino
            steps = {r["step"] for r in step_records(path)}
        except (OSError, ValueError):
            steps, inode = set(), -1
        seen.append((time.time(), inode, steps))
        time.sleep(0.05)
    return seen


def first_new_step(seen: list[tuple[float, int, set[int]]], resumed_at: int) -> float:
    """When the restarted group's first step (resumed_at + 1) was in metrics.jsonl: in the file the
    resume rewrote (another inode), or in the old one if the killed run had not passed resumed_at."""
    old_inode = seen[0][1]
    old_max = max(max(steps, default=0) for _, inode, steps in seen if inode == old_inode)
    for t, inode, steps in seen:
        if resumed_at + 1 in steps and (inode != old_inode or old_max <= resumed_at):
            return t
    raise AssertionError(f"step {resumed_at + 1} of the restarted group never appeared")


def resumed_step(log: str) -> int:
    found = re.findall(r"resumed from \S+ at step (\d+)", log)
    assert found, log[-4000:]
    return int(found[-1])


@pytest.mark.slow
def test_lost_node_restarts_the_group_on_the_survivor(cluster, reference, tmp_path):
    """Node 1 lost in mid-run (its agent and its worker SIGKILLed): node 0's agent, which serves the
    rendezvous, drops it and restarts the group on node 0 alone (1 rank), which resumes the 2-rank
    checkpoint on 1 rank with the global batch kept (grad_accum 2) and finishes: every step once
    in metrics.jsonl, with the uninterrupted run's losses (the model's noise off: it is drawn per rank)."""
    out = tmp_path / "run"
    run = ElasticRun(cluster, out, tmp_path, max_restarts=2)
    try:
        run.wait_steps(KILL_AFTER)
        found = node_processes(cluster, 1)
        assert found["agent"] and found["worker"], found
        t_kill = time.time()
        for pid in found["agent"] + found["worker"]:
            os.kill(pid, signal.SIGKILL)
        seen = watch_restart(out, run.procs[0], timeout=400)
        rc = run.procs[0].wait(timeout=60)
    finally:
        run.stop()
    log = run.text(0)
    after = log[log.index("rank 1 stopped responding") :] if "rank 1 stopped responding" in log else ""
    # node 0's agent restarted the group on 1 rank (the trainer's line, dated to the second)
    started = re.search(r"^(\S+ \S+) \[rank 0\] INFO model .* ZeRO stage 2, 1 rank\(s\)", after, re.M)
    assert started, log[-4000:]
    restarted_s = time.mktime(time.strptime(started.group(1), "%Y-%m-%d %H:%M:%S")) - t_kill
    print(
        f"\nELASTIC node {cluster.names[1]} lost: node 0's restarted rank had built its engine, on 1 rank, "
        f"~{restarted_s:.0f} s after the kill"
    )
    assert rc == 0, log[-4000:]
    assert "on 1 rank(s) instead of 2, grad_accum 2 keeps the global batch" in after, after[-4000:]
    resumed = resumed_step(log)
    took = first_new_step(seen, resumed) - t_kill
    worst = assert_losses_equal(step_losses(out / "metrics.jsonl", STEPS), reference)
    print(
        f"\nELASTIC node {cluster.names[1]} lost after step {KILL_AFTER}: node 0 alone resumed at step {resumed}; "
        f"{took:.1f} s from the kill to step {resumed + 1}; max |loss - uninterrupted| = {worst:.1e}"
    )
