"""Hang forensics (pretrain/training/report/forensics.py, `grt hangs`): on SIGUSR2 every live rank
writes its stacks, its loop position and its last collectives into <out>/hangs/<time>/ and training
goes on; a rank frozen with SIGSTOP leaves a folder that names it and the collective the others
wait in, the stop line names the folder, and nothing else in the run directory is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from train_jobs import Job, build_data, ckpt_tags, cli, last_step, latest, losses, train_args, wait_for

from pretrain.distributed.hangs import analyze

PHASES = {"data", "forward", "backward", "optimizer", "after step (log, evaluation, save)", "eval", "save"}


def folders(out: Path) -> list[Path]:
    return sorted(p for p in (out / "hangs").iterdir()) if (out / "hangs").is_dir() else []


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("hang_data"))


@pytest.mark.slow
def test_sigusr2_then_a_frozen_rank_leave_folders_that_name_it(data, tmp_path):
    out, timeout_s = tmp_path / "run", 8
    job = Job(train_args(data, out, 400, f"train.dist_timeout_s={timeout_s}", "train.save_every=2"), tmp_path / "logs")
    with job:
        wait_for(lambda: last_step(out) >= 3, 240, job, "step 3")
        # 1. the user asks one rank: both write, training goes on
        job.signal(signal.SIGUSR2, ranks=[0])
        wait_for(lambda: any((f / "rank1.json").is_file() for f in folders(out)), 30, job, "rank 1's dump")
        (asked,) = folders(out)
        wait_for(lambda: (asked / "rank0.json").is_file(), 10, job, "rank 0's dump")
        for r in (0, 1):
            dump = json.loads((asked / f"rank{r}.json").read_text())
            assert dump["rank"] == r and dump["world"] == 2 and dump["step"] >= 3 and dump["phase"] in PHASES, dump
            assert "SIGUSR2" in dump["reason"] or "another rank asked" in dump["reason"]
            names = [e["profiling_name"] for e in dump["flight_recorder"]["entries"]]
            assert any(n.startswith("gloo:") for n in names), names  # gloo's flight recorder, on by default
            text = (asked / f"rank{r}.txt").read_text()
            assert "Thread MainThread" in text and "grt-heartbeat" in text and "phase " in text
            assert (asked / f"fr_trace_rank_{r}").is_file()
        step = last_step(out)
        wait_for(lambda: last_step(out) >= step + 2, 60, job, "training after the dump")
        # 2. rank 1 frozen: rank 0's collective times out, it writes alone and names rank 1
        time.sleep(5.5)  # past the window in which a request joins the previous one (forensics.JOIN_S)
        frozen_at = last_step(out)
        os.kill(job.pids[1], signal.SIGSTOP)
        try:
            job.procs[0].wait(timeout=timeout_s + 40)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running after rank 1 was frozen:\n{job.output(0)}")
    log0 = job.logs[0].read_text()
    assert job.procs[0].returncode not in (0, None)
    new = [f for f in folders(out) if f != asked]
    assert len(new) == 1, (folders(out), log0[-3000:])
    hang = new[0]
    assert f"(grt hangs {hang})" in next(ln for ln in log0.splitlines() if "grt train: stopped:" in ln), log0[-3000:]
    assert "grt train: stopped: rank 0 stopping: rank 1" in log0
    assert (hang / "rank0.json").is_file() and not (hang / "rank1.json").exists()  # the frozen rank wrote nothing
    assert "--- the failed collective's traceback" in (hang / "rank0.txt").read_text()  # where it was called
    report = "\n".join(analyze(hang))
    assert "behind: rank(s) 1: no dump" in report, report
    assert "rank(s) 0 wait in gloo:" in report, report
    said = subprocess.run(cli("hangs", str(hang)), capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and said.stdout.strip() == report, said.stdout + said.stderr
    # 3. nothing else lost: every step's record, the checkpoints complete, the first folder whole
    assert sorted(losses(out)) == list(range(1, max(losses(out)) + 1)) and max(losses(out)) >= frozen_at
    assert latest(out) is not None and ckpt_tags(out)[latest(out)]
    assert {p.name for p in asked.iterdir()} >= {"rank0.txt", "rank1.txt", "rank0.json", "rank1.json"}
    assert (out / "train.log").is_file() and (out / "config.json").is_file()


def _dump(folder: Path, rank: int, entered: int, completed: int, name: str) -> None:
    entries = [
        {"pg_id": 0, "collective_seq_id": s, "profiling_name": name if s == entered else "gloo:all_reduce"}
        for s in range(1, entered + 1)
    ]
    fr = {
        "entries": entries,
        "pg_status": {"0": {"last_enqueued_collective": entered, "last_completed_collective": completed}},
    }
    record = {"rank": rank, "world": 3, "reason": "SIGUSR2", "step": 7, "depth": 2, "phase": "forward", "host": "h"}
    (folder / f"rank{rank}.json").write_text(json.dumps({**record, "flight_recorder": fr}))


def test_the_reader_names_the_rank_behind_and_the_collective(tmp_path):
    """Every rank answered, one entered fewer collectives: it is behind, the others wait in the next."""
    _dump(tmp_path, 0, 12, 11, "gloo:_allgather_base")
    _dump(tmp_path, 1, 11, 11, "gloo:all_reduce")
    _dump(tmp_path, 2, 12, 11, "gloo:_allgather_base")
    report = "\n".join(analyze(tmp_path))
    assert "behind in process group 0: rank(s) 1 (entered collective 11)" in report, report
    assert "rank(s) 0, 2 wait in gloo:_allgather_base (process group 0, collective 12" in report
    assert "no dump" not in report
    _dump(tmp_path, 1, 12, 12, "gloo:_allgather_base")
    (tmp_path / "rank2.json").unlink()
    report = "\n".join(analyze(tmp_path))
    assert "behind: rank(s) 2: no dump" in report and "behind in process group" not in report, report


def test_sigusr2_and_a_loop_that_stops_moving_ask_one_rank_for_a_dump(tmp_path):
    """One rank, no store: SIGUSR2 dumps at once, from the watcher thread; a loop whose marks stop
    moving for stall_s (NCCL's case: its watchdog aborts before Python sees a timeout) dumps once."""
    from pretrain.training.report.forensics import MARK, Watcher

    moving = threading.Event()
    moving.set()

    def move() -> None:
        while moving.is_set():
            MARK.moves += 1
            time.sleep(0.05)

    mover = threading.Thread(target=move, daemon=True)
    mover.start()
    watcher = Watcher(tmp_path / "hangs", 0, 1, None, interval=0.05, stall_s=0.5)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(lambda: len(folders(tmp_path)) == 1, 10, what="the SIGUSR2 dump")
        (asked,) = folders(tmp_path)
        wait_for(lambda: (asked / "rank0.txt").is_file(), 10, what="rank0.txt")
        text = (asked / "rank0.txt").read_text()
        assert "SIGUSR2" in text and "Thread MainThread" in text and "grt-hang-watch" in text
        time.sleep(1.0)  # a loop that moves: no dump
        assert folders(tmp_path) == [asked]
        moving.clear()
        wait_for(lambda: len(folders(tmp_path)) == 2, 10, what="the stall's dump")
        (stalled,) = [f for f in folders(tmp_path) if f != asked]
        wait_for(lambda: (stalled / "rank0.json").is_file(), 10, what="rank0.json")
        assert "has not moved for 0.5 s" in json.loads((stalled / "rank0.json").read_text())["reason"]
        time.sleep(1.0)
        assert len(folders(tmp_path)) == 2  # once per stall
    finally:
        moving.clear()
        watcher.close()
