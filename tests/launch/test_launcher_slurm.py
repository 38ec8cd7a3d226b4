"""Slurm for real: the test starts a one-node cluster (munged, slurmctld, slurmd; see
slurm_cluster.py), checks the generated batch scripts with `sbatch --test-only`, submits them
through `grt launch --launcher slurm` with 2 tasks, and pre-empts jobs with their signal.

Skipped, with the reason, where Slurm or munge is not installed or the daemons cannot start.
"""

import json
import os
import re
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_helpers import (
    check_trained,
    clean_env,
    complete_lines,
    grt_launch,
    probe_results,  # noqa: E402
    read_metrics,
    train_args,
)
from slurm_cluster import SlurmCluster, SlurmUnavailable, default_state_dir, missing_tools  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster(default_state_dir())
    try:
        c.start()
    except SlurmUnavailable as e:
        c.stop()
        pytest.skip(f"no test Slurm cluster: {e}")
    yield c
    c.stop()


def test_a_cluster_in_a_deep_directory_launches_its_jobs(tmp_path):
    """slurmstepd's Unix sockets live in slurmd's spool, and a socket path may not exceed 108 bytes.
    Before: the spool sat in the cluster's directory, so under a deep one (pytest's tmp dirs, now
    and then) every batch launch failed ("Unix socket path ... is too long") and the job was held
    (launch_failed_requeued_held), failing the Slurm tests at random."""
    if missing_tools() or os.geteuid() != 0:
        pytest.skip("no test Slurm cluster here (its tools, or root, missing)")
    deep = SlurmCluster(str(tmp_path / ("d" * 80)), name="grtdeep")
    try:
        deep.start()  # before, munged itself did not start here: its socket sat in the deep directory
        script = tmp_path / "job.sbatch"
        script.write_text("#!/bin/sh\nsrun true\n")
        job = deep.sbatch(str(script), f"--output={tmp_path}/job-%j.out", f"--chdir={tmp_path}")
        info = deep.wait_job(job, timeout=90)  # a held job stays PENDING: a timeout that prints why
        assert info["JobState"] == "COMPLETED", info
    finally:
        deep.stop()


def submit(cluster, *args):
    """`grt launch --launcher slurm ...` against the test cluster; returns the job id."""
    r = grt_launch("--launcher", "slurm", "--cpu", *args, env=clean_env(SLURM_CONF=cluster.conf))
    job = r.stdout.strip().splitlines()[-1].split(";")[0]
    assert job.isdigit(), r.stdout
    return job


def job_log(out, job):
    with open(os.path.join(str(out), f"slurm-{job}.out"), errors="replace") as f:
        return f.read()


def wait_done(cluster, job, out, timeout=400):
    info = cluster.wait_job(job, timeout=timeout)
    assert info["JobState"] == "COMPLETED", (info, job_log(out, job)[-4000:])
    return info


def wait_requeued(cluster, job, timeout=120):
    """Wait until the job was requeued and started again.

    A requeued job is held for the credential lifetime (BeginTime; AuthInfo cred_expire,
    120 s by default, 5 s in the test cluster) before it can start again."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = cluster.job_state(job)
        if info.get("Restarts", "0") != "0" and info.get("JobState") in ("RUNNING", "COMPLETED"):
            return
        time.sleep(0.3)
    raise TimeoutError(f"job {job} was not requeued and restarted: {cluster.job_state(job)}")


# --------------------------------------------------------------------------- sbatch --test-only


def test_generated_scripts_pass_sbatch_test_only(cluster, tmp_path):
    env = clean_env(SLURM_CONF=cluster.conf)
    r = grt_launch(
        "--launcher",
        "slurm",
        "--cpu",
        "--procs-per-node",
        "2",
        "--time",
        "00:10:00",
        "--partition",
        cluster.partition,
        "--job-name",
        "grt-check",
        "--requeue",
        "--signal",
        "USR1@60",
        "--dry-run",
        "--run-dir",
        str(tmp_path),
        "--entry",
        "launcher.probe",
        "--",
        "--out",
        str(tmp_path),
        env=env,
    )
    script = r.stdout.split("#### file: ")[1].split("\n", 1)[1].split("#### end of file")[0]
    path = tmp_path / "check.sbatch"
    path.write_text(script)
    t = cluster.run("sbatch", "--test-only", str(path), check=False)
    assert t.returncode == 0 and "to start at" in t.stderr, t.stderr
    # the 4 x 8 GPU script: this CPU node cannot run it, but Slurm must reject it for the
    # resources only, never for its syntax
    r = grt_launch(
        "--launcher",
        "slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--time",
        "24:00:00",
        "--requeue",
        "--dry-run",
        "--run-dir",
        str(tmp_path / "big"),
        "--entry",
        "launcher.probe",
        "--",
        "--out",
        str(tmp_path),
        env=env,
    )
    big = r.stdout.split("#### file: ")[1].split("\n", 1)[1].split("#### end of file")[0]
    (tmp_path / "big.sbatch").write_text(big)
    t = cluster.run("sbatch", "--test-only", str(tmp_path / "big.sbatch"), check=False)
    assert t.returncode != 0
    assert re.search(r"node configuration is not available|[Gg]eneric resource|gres|[Nn]ode count", t.stderr), t.stderr
    assert "unrecognized option" not in t.stderr and "invalid" not in t.stderr.lower().replace(
        "invalid generic resource", ""
    )


# --------------------------------------------------------------------------- probe job


def test_preempted_probe_is_requeued_and_resumes(cluster, tmp_path):
    job = submit(
        cluster,
        "--procs-per-node",
        "2",
        "--requeue",
        "--entry",
        "launcher.probe",
        "--",
        "--out",
        str(tmp_path),
        "--steps",
        "40",
        "--step-time",
        "0.2",
    )
    progress = tmp_path / "probe-progress.json"
    cluster.wait_for(progress.exists, timeout=300, what="the probe's first step")
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    wait_requeued(cluster, job)
    info = wait_done(cluster, job, tmp_path, timeout=300)
    assert info["Restarts"] == "1"
    log = job_log(tmp_path, job)
    assert "received SIGUSR1" in log and "requeueing job" in log and "(restart 1)" in log
    # two tasks found their ranks from Slurm's variables, MASTER_ADDR from the node list
    recs = probe_results(tmp_path, 2)
    for r in recs:
        assert r["launcher"] == "slurm" and r["slurm_job_id"] == job and r["slurm_restart_count"] == "1"
        assert r["master_addr"] == cluster.host and r["master_port"] == 20000 + int(job) % 20000
    assert [r["local_rank"] for r in recs] == [0, 1]
    assert all(r.get("finished") and 0 < r["resumed_from"] < 40 for r in recs), recs
    assert json.loads((tmp_path / "probe-checkpoint.json").read_text()) == {"step": 40, "finished": True}


# --------------------------------------------------------------------------- training jobs


def test_slurm_trains_two_tasks(cluster, tmp_path):
    out = tmp_path / "run"
    # --wait: `grt launch` returns when the job has ended, with its exit status
    job = submit(
        cluster,
        "--procs-per-node",
        "2",
        "--cpus-per-task",
        "1",
        "--rank-logs",
        "--time",
        "00:20:00",
        "--wait",
        "--",
        *train_args(out, 4),
    )
    assert cluster.job_state(job)["JobState"] == "COMPLETED"
    wait_done(cluster, job, out, timeout=30)
    check_trained(out, 4)
    # each rank's output in its own file (srun --output=.../rank%t.log), dated log lines
    rank0 = open(out / "logs" / "rank0.log").read()
    assert "step 4/4" in rank0 and "saved checkpoint" in rank0
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank 0\] INFO", rank0, flags=re.M), rank0[-2000:]
    assert os.path.getsize(out / "logs" / "rank1.log") > 0
    log = job_log(out, job)
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d grt: job " + job, log, flags=re.M), log[-2000:]
    assert json.load(open(out / "launch" / "config.json")) == json.load(open(out / "config.json"))
    assert json.load(open(out / "launch" / "ds_config.json")) == json.load(open(out / "ds_config.json"))


def test_preempted_training_checkpoints_and_a_resubmission_resumes(cluster, tmp_path):
    out = tmp_path / "run"
    steps = 40
    job = submit(cluster, "--procs-per-node", "2", "--", *train_args(out, steps))
    metrics = out / "metrics.jsonl"
    cluster.wait_for(lambda: complete_lines(metrics) >= 2, timeout=300, what="two training steps")
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    wait_done(cluster, job, out)
    summary = json.load(open(out / "summary.json"))
    stopped = summary["steps"]
    assert summary["stopped_by_signal"] and 2 <= stopped < steps, summary
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step{stopped:08d}" and (out / "checkpoints" / latest / "COMPLETE").exists()
    log = job_log(out, job)
    assert "received SIGUSR1" in log and "checkpoint saved" in log and "resume with: sbatch" in log
    # resubmit the same script: the job resumes from the checkpoint (the script passes --resume)
    script = str(out / "launch" / "slurm.sbatch")
    job2 = cluster.sbatch(script)
    wait_done(cluster, job2, out)
    assert f"resumed from {out / 'checkpoints' / latest} at step {stopped}" in job_log(out, job2)
    rank0 = read_metrics(metrics)
    assert [r["step"] for r in rank0] == list(range(1, steps + 1))
    assert json.load(open(out / "summary.json"))["steps"] == steps
