"""Helpers for the launcher tests: a clean environment, `grt launch` in a subprocess,
tiny token shards for training through each launcher."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from commands import data_commands, manifest_of, train_command
from multiproc import free_port  # noqa: F401 - the tests' one port picker (reserved, collision-free)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TEXT = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")


def clean_env(**extra) -> dict:
    """This environment without any launcher's rank variables (tests may run inside one)."""
    drop = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "LOCAL_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CROSS_RANK",
        "CROSS_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "GRT_HOSTFILE",
        "DLTS_HOSTFILE",
        "GRT_DIST_DISCOVERY",
        "DS_ENV_FILE",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "OMPI_", "PMI", "PMIX_"))
    }
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _end_group(proc) -> None:
    """End a launch we started and every rank under it (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def grt_launch(*args, env=None, timeout=400, background=None, check=True):
    """Run `grt launch ARGS` in its own process group (ended with its ranks on a timeout).

    With background=LOG_PATH start it with its output going to LOG_PATH (a file, not a
    pipe: two launches waited on in turn cannot block each other)."""
    cmd = [sys.executable, "-m", "pretrain.cli", "launch", *args]
    if background:
        log = open(background, "w")
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or clean_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        log.close()
        return proc
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"grt launch timed out after {timeout}s\n{out[-4000:]}\n{err[-4000:]}") from None
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def probe_results(out, world):
    files = sorted(glob.glob(os.path.join(str(out), "probe-rank*.json")))
    recs = [json.load(open(f)) for f in files]
    assert sorted(r["rank"] for r in recs) == list(range(world)), files
    for r in recs:
        assert r["world_size"] == world and r["dist_world_size"] == world
        assert r["allreduce_sum"] == r["expected_sum"] == world * (world + 1) / 2
        assert r["dist_rank"] == r["rank"] and r["backend"] == "gloo"
    return sorted(recs, key=lambda r: r["rank"])


_SHARDS: dict[str, str] = {}


def tiny_shards() -> str:
    """manifest.json of tiny token shards (built once per test process)."""
    if "manifest" in _SHARDS:
        return _SHARDS["manifest"]
    d = tempfile.mkdtemp(prefix="grt-launch-shards-")
    for args in data_commands(DEMO_TEXT, d):
        r = subprocess.run(
            [sys.executable, "-m", "pretrain.cli", *args],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    _SHARDS["manifest"] = str(manifest_of(d))
    return _SHARDS["manifest"]


def train_args(out, steps=4, preset="tiny-grt", *extra):
    """`grt train` arguments (without `train`) for a few fast CPU steps (ZeRO-2, a checkpoint at the end)."""
    zero2 = os.path.join(ROOT, "ds_configs", "zero2.json")
    sets = ("train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.warmup_steps=1")
    return train_command(preset, tiny_shards(), out, steps, 2, zero2, sets, *extra, grad_accum=1)[1:]


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def complete_lines(path) -> int:
    """Lines fully written so far (0 if the file does not exist yet)."""
    try:
        with open(path) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def wait_all(procs, logs, timeout=400):
    """Wait for background launches; assert they all succeeded (their logs on failure)."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:  # a hung launch: end it and its ranks
                _end_group(p)
    texts = [open(log, errors="replace").read() for log in logs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n----\n".join(t[-3000:] for t in texts)
    return texts


def check_trained(out, steps, world=2, first_step=1):
    """The run in `out` logged `steps` steps on every rank, agreed on the loss, and saved."""
    out = str(out)
    rank0 = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rank0][-1] == steps and rank0[0]["step"] == first_step
    for rank in range(1, world):
        other = read_metrics(os.path.join(out, f"metrics.rank{rank}.jsonl"))
        assert [(r["step"], r["loss"], r["depth"]) for r in other] == [
            (r["step"], r["loss"], r["depth"]) for r in rank0
        ]
    latest = open(os.path.join(out, "checkpoints", "latest")).read().strip()
    assert os.path.exists(os.path.join(out, "checkpoints", latest, "COMPLETE"))
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == steps
    return rank0, summary


def throttle(
    find_pid: Callable[[], int | None],
    done: threading.Event,
    running: Callable[[], bool] = lambda: True,
    run_s: float = 0.01,
    stop_s: float = 0.09,
) -> None:
    """Keep the process `find_pid` finds running a tenth of the time (SIGSTOP/SIGCONT) until `done`
    or until `running` says its launch ended: a throttled device, from outside. A tenth, not more:
    on a loaded machine (pytest workers beside it) the unthrottled rank gets a third of a core or
    less, and a quarter came within the 0.8x limit of it. The thread runs at real-time priority
    where it may (root), so that its run windows stay 10 ms however loaded the machine is."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))  # 0: this thread
    except OSError:
        pass
    pid = None
    while not done.is_set() and running():
        pid = pid or find_pid()
        if pid is None:
            time.sleep(0.05)
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
        except ProcessLookupError:
            return
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
