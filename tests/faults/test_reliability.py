"""Reliability under faults (issue 7; docs/reliability.md): real `grt train` processes,
2-rank ZeRO-3 on CPU (gloo, fp32), killed, signalled, starved of disk, fed NaNs and
broken shards. Multi-process tests are marked slow.

The reference is one uninterrupted 2-rank run of REF_STEPS steps; an interrupted and
resumed run must reproduce its per-step losses exactly.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TypedDict

import pytest
from train_jobs import (
    REPO,
    Job,
    build_data,
    ckpt_tags,
    cli,
    descendants,
    fp32_state,
    last_step,
    latest,
    losses,
    run_job,
    stray_files,
    train_args,
    wait_for,
)

REF_STEPS = 16
SAVE = "train.save_every=4"


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("reliability_data"))


class Reference(TypedDict):
    """The uninterrupted reference run: its per-step losses and its output directory."""

    losses: dict[int, float]
    out: Path


@pytest.fixture(scope="session")
def reference(data, tmp_path_factory) -> Reference:
    """Per-step losses of an uninterrupted 2-rank ZeRO-3 run."""
    out = tmp_path_factory.mktemp("reliability_ref") / "run"
    rcs, job = run_job(train_args(data, out, REF_STEPS, SAVE), out.parent / "logs")
    assert rcs == [0, 0], job.output()
    ref = losses(out)
    assert sorted(ref) == list(range(1, REF_STEPS + 1))
    return {"losses": ref, "out": out}


def assert_same_losses(out: Path, ref: dict[int, float], steps) -> None:
    got = losses(out)
    diff = {s: (got.get(s), ref[s]) for s in steps if got.get(s) != ref[s]}
    assert not diff, f"losses differ from the uninterrupted run (step: got, want): {diff}"


def one_line_error(stderr: str) -> str:
    """The error lines of a CLI run's stderr (DeepSpeed's import-time warnings aside)."""
    lines = [
        line
        for line in stderr.splitlines()
        if line.strip() and "[WARNING]" not in line and "Warning" not in line and not line.startswith("  ")
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- bad configuration

BAD_CONFIGS = [
    (["--set", "train.foo=1"], ["train.foo", "accepted keys", "max_bad_steps"]),
    (["--set", "train.steps=many"], ["train.steps='many'", "expected int"]),
    (["--set", "train.skip_corrupt_shards=maybe"], ["train.skip_corrupt_shards='maybe'", "expected bool"]),
    (["--set", "train.depth_sampling=zigzag"], ["train.depth_sampling='zigzag'", "uniform, fixed, poisson"]),
    (["--preset", "huge-grt"], ["unknown preset 'huge-grt'", "micro-grt"]),
    (["--set", "model.layout=1+x3"], ["layout '1+x3' does not parse", "P+CxR+K"]),
    (["--set", "model.layout=1+0x3+1"], ["core must be at least 1"]),
    ("ds_batch", ["train_batch_size=7", "micro_batch_size 4 x grad_accum 1 x ranks 2 = 8", "train.micro_batch_size"]),
    ("ds_missing", ["no such file", "zero3.json"]),
]


def bad_config_args(data: Path, tmp_path: Path, case) -> list[str]:
    args = train_args(data, tmp_path / "run", 5)
    if case == "ds_batch":
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps({"train_batch_size": 7, "zero_optimization": {"stage": 3}}))
        args += ["--ds-config", str(ds)]
    elif case == "ds_missing":
        args += ["--ds-config", str(tmp_path / "zero3.json")]
    else:
        if case[0] == "--preset":
            args = [a for a in args if a != "micro-grt"]
            args.remove("--preset")
        args += case
    return args


# as rank 0 of a 2-rank job whose rank 1 never starts: had a process group been created,
# the run would block in the rendezvous instead of exiting
RANK0_OF_2 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(
    "case,expected",
    BAD_CONFIGS,
    ids=[
        "unknown-key",
        "wrong-type-int",
        "wrong-type-bool",
        "bad-value",
        "unknown-preset",
        "unparsable-layout",
        "zero-layout",
        "ds-batch-mismatch",
        "ds-config-missing",
    ],
)
def test_bad_config_is_one_line_before_any_process_group(data, tmp_path, monkeypatch, capsys, case, expected):
    """rc 2, one line naming the key and what is accepted; no process group, no engine, no files."""
    import torch.distributed as dist

    from pretrain import train as train_cli

    for key, value in RANK0_OF_2.items():
        monkeypatch.setenv(key, value)
    rc = train_cli.main(bad_config_args(data, tmp_path, case)[1:])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("grt train: error: "), err
    for text in expected:
        assert text in err, err
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists(), "the run wrote into --out before failing"


@pytest.mark.parametrize("case", ["ds_batch", ["--set", "model.layout=1+x3"]], ids=["ds-batch", "layout"])
def test_bad_config_process_exits_at_once(data, tmp_path, case):
    """The same as a real `grt train` process (rank 0 of 2): exit 2 at once, one error line."""
    out = tmp_path / "run"
    t0 = time.time()
    res = subprocess.run(
        cli(*bad_config_args(data, tmp_path, case)),
        cwd=REPO,
        env={**os.environ, **RANK0_OF_2},
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.time() - t0
    err = one_line_error(res.stderr)
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(err.splitlines()) == 1 and err.startswith("grt train: error: "), res.stderr
    assert not out.exists(), "the run wrote into --out before failing"
    assert "init_distributed" not in res.stdout + res.stderr and "TorchBackend" not in res.stdout + res.stderr
    assert elapsed < 60


@pytest.mark.slow
def test_eval_depth_beyond_trained_is_refused(reference):
    res = subprocess.run(
        cli("eval", str(reference["out"]), "--depths", "0-9", "--tasks", "val"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(errors) == 1 and errors[0] == res.stderr.strip().splitlines()[-1], res.stderr
    assert errors[0].startswith("grt eval: error: depth(s) [4, 5, 6, 7, 8, 9] exceed the trained maximum of 3")
    assert "--allow-beyond-trained" in errors[0]


# --------------------------------------------------------------------------- checkpoint selection


def test_only_complete_checkpoints_are_ever_chosen(tmp_path):
    """What a kill can leave behind: a tag without COMPLETE, `latest` naming it, a stray
    marker temp file. find_latest picks the newest complete tag in every case."""
    from pretrain.runs.checkpoint_files import find_latest

    root = tmp_path / "checkpoints"
    assert find_latest(root) is None
    for step, complete in ((4, True), (8, True), (12, False)):
        (root / f"step{step:08d}").mkdir(parents=True)
        if complete:
            (root / f"step{step:08d}" / "COMPLETE").write_text(f"{step}\n")
    (root / "step00000012" / ".COMPLETE.tmp123").write_text("12\n")
    assert find_latest(root) == "step00000008"  # no `latest`: the newest complete tag
    (root / "latest").write_text("step00000012\n")
    assert find_latest(root) == "step00000008"  # `latest` names an incomplete tag
    (root / "latest").write_text("step00000004\n")
    assert find_latest(root) == "step00000004"  # killed between COMPLETE of 8 and `latest`: 4 is what was promised
    (root / "latest").write_text("garbage")
    assert find_latest(root) == "step00000008"

    from pretrain.training.checkpoint.store import _remove_debris

    (root / "step00000016").mkdir()
    (root / "step00000016" / ".COMPLETE.tmp4241").write_text("16\n")  # from a kill before a rewrite
    (root / "step00000016" / "COMPLETE").write_text("16\n")
    (root / ".latest.tmp4242").write_text("x")
    _remove_debris(root, "step00000016")  # after step 16 was saved
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step00000004", "step00000008", "step00000016"]
    assert [p.name for p in (root / "step00000016").iterdir()] == ["COMPLETE"]


def test_the_fallback_walks_newest_first_keeping_why_each_was_passed_over(tmp_path):
    """Fallback (the plan's and the load's walk): each tag in turn, newest first; one passed over
    leaves its problem, in order; a tag neither used nor passed over is an error, not a loop; the
    ranks' agreement on an older tag drops this rank's newer ones untried."""
    from pretrain.runs.checkpoint_files import Fallback

    tags = ["step00000012", "step00000008", "step00000004"]
    fallback = Fallback(tmp_path, tags)
    tried = []
    for tag in fallback:
        tried.append(tag)
        if tag == "step00000004":
            break
        fallback.pass_over(tag, f"{tag} is cut off")
    assert tried == tags and fallback.remaining == ["step00000004"]
    assert fallback.unloadable() == [
        "checkpoint step00000012 cannot be loaded (step00000012 is cut off)",
        "checkpoint step00000008 cannot be loaded (step00000008 is cut off)",
    ]
    with pytest.raises(RuntimeError, match="neither used nor passed over"):
        for _ in Fallback(tmp_path, tags):
            pass
    agreed = Fallback(tmp_path, tags)
    agreed.agree("step00000008")
    assert agreed.remaining == tags[1:] and not agreed.passed
    none = Fallback(tmp_path, [])
    assert str(none.none_left("loaded", ["none is complete on every rank"])).startswith(
        f"--resume: no complete checkpoint in {tmp_path} can be loaded (none is complete on every rank)"
    )


def test_the_walk_is_written_once_the_first_usable_tag_or_one_refusal(tmp_path):
    """`Fallback.first_usable`, the walk the plan, the dry run's read-through and the ranks' load all
    take: an unreadable tag is passed over with its problem, the first usable one's result comes back;
    none left is one refusal naming each problem; a refusal of the use ends the walk there; a
    collective walk's rank with none left still proposes (None)."""
    from grt_common.errors import ConfigError
    from pretrain.runs.checkpoint_files import Fallback, UnreadableCheckpoint

    tags = ["step00000012", "step00000008", "step00000004"]

    def use(tag):
        if tag != "step00000004":
            raise UnreadableCheckpoint(tag, "cut off")
        return f"loaded {tag}"

    fallback = Fallback(tmp_path, tags)
    assert fallback.first_usable(use, "read") == "loaded step00000004"
    assert list(fallback.passed) == tags[:2] and fallback.remaining == ["step00000004"]
    with pytest.raises(ConfigError, match=r"can be read \(step00000012: cut off; step00000008: cut off\)"):
        Fallback(tmp_path, tags[:2]).first_usable(use, "read")

    def refuse(tag):
        raise ConfigError(f"{tag}: trained with other settings")

    refused = Fallback(tmp_path, tags)
    with pytest.raises(ConfigError, match="step00000012: trained with other settings"):
        refused.first_usable(refuse, "read")
    assert refused.remaining == tags and not refused.passed  # nothing older tried after a refusal
    proposed = []

    def agree(tag):  # the ranks' round: the last proposal, None, is agreed on as none left
        proposed.append(tag)
        raise ConfigError("none is complete on every rank")

    with pytest.raises(ConfigError, match="none is complete"):
        Fallback(tmp_path, []).first_usable(agree, "loaded", proposes_none=True)
    assert proposed == [None]


def test_heartbeat_names_the_failed_rank(monkeypatch):
    """The diagnosis logic against a real TCP store: a silent rank, a rank with its own
    error, a rank that only saw a failed collective, and a rank that lags."""
    from datetime import timedelta

    import torch.distributed as dist
    from multiproc import free_port

    from pretrain.training.health import Heartbeat

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(port))  # a fresh key space
    hbs = [Heartbeat(r, 3, interval=0.1) for r in range(3)]
    try:
        hbs[0].step = hbs[1].step = hbs[2].step = 5
        time.sleep(0.5)
        hbs[2].close()  # rank 2 goes silent
        assert hbs[0].diagnose() == [
            "rank 2 stopped responding after step 5 (killed, crashed or frozen: no heartbeat "
            f"for 0.3 s) on host {socket.gethostname()}"
        ]
        hbs[1].mark_failed("ShardError: corrupt or truncated shard 'x.tar'")
        notes = hbs[0].diagnose()
        assert notes[0] == "rank 1 failed: ShardError: corrupt or truncated shard 'x.tar'" and "rank 2" in notes[1]
        hbs = hbs[:2] + [Heartbeat(2, 3, interval=0.1)]
        hbs[1].mark_failed("RuntimeError: Connection reset by peer", comm=True)
        hbs[2].step = 5
        time.sleep(0.3)
        assert "rank(s) 1 saw a failed collective too" in hbs[0].diagnose()[0]
        hbs[0].step = 7
        assert hbs[0].diagnose()[0].startswith("rank 2 is alive but stuck at step 5 (this rank reached step 7)")
    finally:
        for hb in hbs:
            hb.close()
        del server


# --------------------------------------------------------------------------- hard kill + exact resume


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_reproduces_losses(data, reference, tmp_path):
    """1. rank 0 is SIGKILLed between DeepSpeed's write of step 8 and its COMPLETE marker:
    the half-written step 8 is never loaded, the resume starts from step 4.
    2. that resumed run is SIGKILLed (both ranks, as when a node dies) at a random moment.
    3. the next resume finishes; every step's loss equals the uninterrupted run's."""
    out = tmp_path / "run"
    logs = tmp_path / "logs"
    ref = reference["losses"]
    args = train_args(data, out, REF_STEPS, SAVE)
    job = Job(args, logs, env={"GRT_INJECT_CKPT_FAULT": "kill@8@0"})
    with job:
        job.procs[0].wait(timeout=240)
        assert job.procs[0].returncode == -signal.SIGKILL, job.output()
        job.wait(timeout=60)  # rank 1 notices the dead peer and exits by itself
    assert job.procs[1].returncode != 0
    assert "rank 0" in job.output(1), job.output(1)
    assert ckpt_tags(out) == {"step00000004": True, "step00000008": False}
    assert latest(out) == "step00000004"

    # resume, then die at a random moment (maybe inside a checkpoint write)
    seed = int(os.environ.get("GRT_TEST_SEED", time.time_ns() % 100000))
    kill_after = random.Random(seed).uniform(0.0, 2.0)
    job = Job(args + ["--resume"], logs)
    with job:
        wait_for(lambda: "resumed from" in job.logs[0].read_text(), 240, job, "the resume")
        assert "step00000004 at step 4" in job.logs[0].read_text()
        wait_for(lambda: last_step(out) >= 9, 120, job, "step 9")
        time.sleep(kill_after)
        job.kill()
    killed_at = last_step(out)
    complete = [t for t, ok in ckpt_tags(out).items() if ok]
    assert latest(out) in complete

    job = Job(args + ["--resume"], logs)
    with job:
        rcs = job.wait(240)
    assert rcs == [0, 0], job.output()
    said = job.logs[0].read_text()
    if f"nothing to do: {out} is at step {REF_STEPS} of {REF_STEPS}" in said:
        resumed_from = REF_STEPS  # the kill came after the last save: the resume has nothing to train
    else:
        resumed_from = int(latest_resume_line(said))
    assert resumed_from <= killed_at
    assert_same_losses(out, ref, range(1, REF_STEPS + 1))
    assert stray_files(out / "checkpoints") == []
    assert all(ckpt_tags(out).values()), f"incomplete checkpoints left behind: {ckpt_tags(out)}"
    print(
        f"\nRELIABILITY hard-kill (GRT_TEST_SEED={seed}): killed at step {killed_at} ({kill_after:.2f} s after "
        f"step 9), resumed from "
        f"{resumed_from}, lost {killed_at - resumed_from} step(s); injected in-checkpoint kill lost 4 steps"
    )


def latest_resume_line(log: str) -> str:
    line = [entry for entry in log.splitlines() if "resumed from" in entry][-1]
    return line.rsplit("at step", 1)[1].strip()


# --------------------------------------------------------------------------- pre-emption


@pytest.mark.slow
def test_sigterm_and_sigusr1_checkpoint_and_exit_cleanly(data, reference, tmp_path):
    """SIGTERM on every rank (Slurm's pre-emption), then SIGUSR1 on rank 1 only (--signal):
    every rank finishes its step, saves, exits 0 within a bound; the next start resumes and
    the losses stay those of the uninterrupted run."""
    out = tmp_path / "run"
    logs = tmp_path / "logs"
    args = train_args(data, out, REF_STEPS, SAVE)
    bound = 60
    for sig, ranks, after in ((signal.SIGTERM, None, 3), (signal.SIGUSR1, [1], 9)):
        job = Job(args + (["--resume"] if after > 3 else []), logs)
        with job:
            wait_for(lambda after=after: last_step(out) >= after, 240, job, f"step {after}")
            t0 = time.time()
            job.signal(sig, ranks)
            rcs = job.wait(bound)
            took = time.time() - t0
        assert rcs == [0, 0], job.output()
        summary = json.loads((out / "summary.json").read_text())
        stopped = summary["steps"]
        assert summary["stopped_by_signal"] and stopped >= after
        assert latest(out) == f"step{stopped:08d}" and ckpt_tags(out)[latest(out)]
        assert f"stop signal received: checkpoint saved at step {stopped}" in job.logs[0].read_text()
        print(
            f"\nRELIABILITY {signal.Signals(sig).name} to ranks {ranks or 'all'}: saved at step {stopped}, "
            f"exited 0 in {took:.1f} s, 0 steps lost"
        )
    assert "resumed from" in job.logs[0].read_text()
    assert_same_losses(out, reference["losses"], range(1, stopped + 1))


@pytest.mark.slow
def test_sigterm_to_every_process_with_loader_workers(data, tmp_path):
    """Slurm's pre-emption and DeepSpeed's launcher signal every process, data-loader
    workers included: the run must still save and exit 0."""
    out = tmp_path / "run"
    job = Job(train_args(data, out, REF_STEPS, "train.num_workers=2"), tmp_path / "logs")
    with job:
        wait_for(lambda: last_step(out) >= 2, 240, job, "step 2")
        for pid in [p for rank_pid in job.pids for p in (rank_pid, *descendants(rank_pid))]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        rcs = job.wait(60)
    assert rcs == [0, 0], job.output()
    assert json.loads((out / "summary.json").read_text())["stopped_by_signal"]


# --------------------------------------------------------------------------- a rank dies or hangs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_rank_failure_stops_the_others_naming_it(data, tmp_path, how):
    """Rank 1 is SIGKILLed (or frozen with SIGSTOP): rank 0 does not hang, it exits non-zero
    within train.dist_timeout_s (+ the diagnosis) with a message naming rank 1."""
    out = tmp_path / "run"
    timeout_s = 12
    job = Job(train_args(data, out, 200, f"train.dist_timeout_s={timeout_s}"), tmp_path / "logs")
    with job:
        wait_for(lambda: last_step(out) >= 3, 240, job, "step 3")
        t0 = time.time()
        os.kill(job.pids[1], signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        try:
            job.procs[0].wait(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running {timeout_s + 30} s after rank 1 was {how}ed:\n{job.output(0)}")
        took = time.time() - t0
    log0 = job.logs[0].read_text()
    assert job.procs[0].returncode not in (0, None)
    assert "rank 1 stopped responding" in log0, log0[-3000:]
    assert "grt train: stopped: rank 0 stopping: rank 1" in log0
    if how == "sigkill":
        assert took < timeout_s, "a dead peer is noticed at once, not after the timeout"
    print(
        f"\nRELIABILITY rank 1 {how}: rank 0 exited {job.procs[0].returncode} after {took:.1f} s "
        f"(dist_timeout_s={timeout_s})"
    )


# --------------------------------------------------------------------------- numerical faults


@pytest.mark.slow
def test_nan_loss_skipped_on_every_rank_then_stop(data, tmp_path):
    """A NaN on rank 1 only at step 3: the micro-batch is skipped on both ranks and counted,
    the parameters stay finite. Three NaNs in a row at step 7 (max_bad_steps=3): exit 3,
    clear message, the last good checkpoint (step 6) intact and finite."""
    out = tmp_path / "run"
    rcs, job = run_job(
        train_args(data, out, 12, "train.save_every=2", "train.max_bad_steps=3"),
        tmp_path / "logs",
        rank_env={1: {"GRT_INJECT_NAN_STEPS": "3,7,7,7"}},
    )
    assert rcs == [3, 3], job.output()
    for r in (0, 1):
        text = job.logs[r].read_text()
        assert text.count("non-finite loss at step 3 (depth") == 1, text[-3000:]
        assert text.count("non-finite loss at step 7") == 3
        assert "grt train: stopped: 3 consecutive non-finite losses at step 7" in text
        assert "The last good checkpoint is step00000006" in text
    assert sorted(losses(out)) == list(range(1, 7)) and all(math.isfinite(v) for v in losses(out).values())
    assert latest(out) == "step00000006" and ckpt_tags(out)["step00000006"]
    state = fp32_state(out / "checkpoints", "step00000006")
    bad = [k for k, v in state.items() if not bool(v.isfinite().all())]
    assert not bad, f"parameters became non-finite after skipped micro-batches: {bad}"
    before = fp32_state(out / "checkpoints", "step00000002")
    assert any(not bool((state[k] == before[k]).all()) for k in state), "training made no progress"
    print(
        "\nRELIABILITY NaN: 4 micro-batches poisoned on rank 1, skipped on both ranks; stopped with exit 3 "
        "at step 7, checkpoint step 6 intact"
    )


# --------------------------------------------------------------------------- data faults


def small_manifest(data: Path, dest: Path, n_train: int, edit=None) -> Path:
    """A copy of the manifest listing only the first n_train train shards (absolute paths),
    optionally edited by edit(entries)."""
    raw = json.loads(data.read_text())
    base = data.parent
    dest.mkdir(parents=True, exist_ok=True)
    entries = []
    for e in raw["splits"]["train"][:n_train]:
        e = dict(e)
        shutil.copyfile(base / e["name"], dest / e["name"])
        entries.append(e)
    raw["splits"] = {"train": entries}
    raw["totals"] = {}
    raw["tokenizer"]["path"] = str(base / raw["tokenizer"]["path"])
    if edit:
        edit(dest, entries)
    path = dest / "manifest.json"
    path.write_text(json.dumps(raw))
    return path


def corrupt(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[2000:2600] = b"\xff" * 600  # garbage over a tar header and payload
    path.write_bytes(bytes(blob))


def broken_shards(dest: Path, entries: list) -> None:
    """Shard 1 corrupt, shard 2 missing, shard 3 cut off mid-member (a `pipe:` shard, which ended
    mid-stream here before, is refused when the manifest is read: tests/faults/test_untrusted_files.py)."""
    corrupt(dest / entries[1]["name"])
    (dest / entries[2]["name"]).unlink()
    third = dest / entries[3]["name"]
    third.write_bytes(third.read_bytes()[:9000])


BROKEN = {
    "corrupt": (1, "corrupt or truncated shard '{path}"),
    "missing": (2, "missing shard '{path}"),
    "cut": (3, "corrupt or truncated shard '{path}'"),
}


def only_broken(which):
    def edit(dest, entries):
        path = dest / entries[BROKEN[which][0]]["name"]
        broken_shards(dest, entries)
        entries[:] = [entries[BROKEN[which][0]]]  # the broken one alone: it is read at the first step
        edit.want = BROKEN[which][1].format(path=path)

    return edit


@pytest.mark.parametrize("which", ["corrupt", "missing", "cut"])
def test_loader_names_the_broken_shard(data, tmp_path, which):
    from data_pipeline.loader import TokenBatchLoader
    from data_pipeline.shards import ShardError

    edit = only_broken(which)
    manifest = small_manifest(data, tmp_path / "shards", 4, edit)
    loader = TokenBatchLoader(str(manifest), micro_batch_size=4, shuffle_buffer=0)
    with pytest.raises(ShardError) as info:
        next(iter(loader))
    assert edit.want in str(info.value)


@pytest.mark.slow
def test_broken_shard_stops_training_with_one_line(data, tmp_path):
    """Without skip_corrupt_shards, a shard cut off mid-member (2 ranks): every rank
    exits 3 with one line naming the shard and the option to skip it; no hang."""
    edit = only_broken("cut")
    manifest = small_manifest(data, tmp_path / "shards", 4, edit)
    rcs, job = run_job(train_args(manifest, tmp_path / "run", 3), tmp_path / "logs", timeout=180)
    assert rcs == [3, 3], job.output()
    for r in (0, 1):
        err = job.logs[r].read_text().strip().splitlines()[-1]
        assert err.startswith(f"grt train: stopped: rank {r} failed: ShardError: ") and edit.want in err, err
        assert "set train.skip_corrupt_shards=true" in err


@pytest.mark.slow
def test_broken_shards_skipped_with_warning_and_count(data, tmp_path):
    """With train.skip_corrupt_shards: corrupt, missing and cut-off shards are skipped
    with a warning, counted in the summary, and the run finishes (2 ranks)."""
    manifest = small_manifest(data, tmp_path / "shards", 6, broken_shards)
    n_seq = sum(e["sequences"] for e in json.loads(manifest.read_text())["splits"]["train"])
    steps = n_seq // 32 + 2  # more than one epoch: every shard is visited
    out = tmp_path / "run"
    rcs, job = run_job(
        train_args(
            manifest, out, steps, "train.skip_corrupt_shards=true", "train.shuffle_buffer=0", micro_batch_size=16
        ),
        tmp_path / "logs",
    )
    assert rcs == [0, 0], job.output()
    summary = json.loads((out / "summary.json").read_text())
    text = job.output()
    assert "unreadable shard(s) so far (train.skip_corrupt_shards)" in text
    assert summary["steps"] == steps
    assert summary["skipped_shards"] >= 1
    skipped = set()
    for name in ("train-000001.tar", "train-000002.tar", "train-000003.tar"):
        if name in text:
            skipped.add(name)
    assert len(skipped) == 3, text[-4000:]
    print(f"\nRELIABILITY data: 3 broken shards (corrupt, missing, cut off) skipped and counted over {steps} steps")


@pytest.mark.slow
def test_resume_refuses_changed_shard_list(data, reference, tmp_path):
    """Resuming with a different shard list: refused before any process group, naming the
    checkpoint and how to override; GRT_ALLOW_DATA_CHANGE=1 lets it go on."""
    out = tmp_path / "run"
    shutil.copytree(reference["out"], out)
    manifest = small_manifest(data, tmp_path / "shards", 30)
    t0 = time.time()
    res = subprocess.run(
        cli(*train_args(manifest, out, REF_STEPS + 2, resume=True)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    )
    err = one_line_error(res.stderr)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "shard list changed since checkpoint step00000016" in err and "GRT_ALLOW_DATA_CHANGE=1" in err, err
    assert time.time() - t0 < 60
    rcs, job = run_job(
        train_args(manifest, out, REF_STEPS + 2, resume=True), tmp_path / "logs", env={"GRT_ALLOW_DATA_CHANGE": "1"}
    )
    assert rcs == [0, 0], job.output()
    assert "resuming anyway" in job.output()
    assert last_step(out) == REF_STEPS + 2


# --------------------------------------------------------------------------- storage faults


@pytest.mark.slow
def test_checkpoint_write_failure_on_one_rank(data, tmp_path):
    """DeepSpeed's write fails with ENOSPC on rank 1 only (step 4): no hang, both ranks stop
    with a clear message (exit 3), the partial step 4 is removed, step 2 stays `latest` and
    loads."""
    out = tmp_path / "run"
    args = train_args(data, out, 6, "train.save_every=2")
    rcs, job = run_job(args, tmp_path / "logs", timeout=240, env={"GRT_INJECT_CKPT_FAULT": "enospc@4@1"})
    assert rcs == [3, 3], job.output()
    for r in (0, 1):
        assert "could not write checkpoint" in job.output(r) and "No space left on device" in job.output(1)
        assert "the previous checkpoint (step00000002) is intact" in job.output(r)
    assert ckpt_tags(out) == {"step00000002": True} and latest(out) == "step00000002"
    assert stray_files(out) == []
    state = fp32_state(out / "checkpoints", "step00000002")  # complete and loadable (resume: see above)
    assert state and all(bool(v.isfinite().all()) for v in state.values())


@pytest.mark.slow
def test_full_disk_keeps_previous_checkpoint(data, tmp_path):
    """A real full disk: the checkpoint directory is a 2 MiB tmpfs (needs root). The save
    that does not fit fails cleanly (exit 3), `latest` names the previous one, which loads."""
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(ckpts)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        res = subprocess.run(
            cli(*train_args(data, tmp_path / "run", 12, "train.save_every=2", "train.keep_checkpoints=5")),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
        err = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-3000:]
        assert err.startswith("grt train: stopped: could not write checkpoint") and "is intact" in err, err
        tags = ckpt_tags(tmp_path / "run")
        assert tags and all(tags.values()), tags  # the failed one was removed
        good = latest(tmp_path / "run")
        assert good == max(tags) and f"({good}) is intact" in err
        state = fp32_state(ckpts, good)
        assert all(bool(v.isfinite().all()) for v in state.values())
        assert stray_files(ckpts) == []
        print(f"\nRELIABILITY full disk: save after {good} failed, {good} intact")
    finally:
        subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)


# --------------------------------------------------------------------------- load


@pytest.mark.slow
def test_long_run_flat_memory_no_leaks(data, tmp_path):
    """A 2-rank run of LOAD_STEPS steps with evaluation and checkpoints: RSS after warm-up
    stays flat on every rank, no stray files, every process exits."""
    steps = int(os.environ.get("GRT_LOAD_STEPS", "200"))
    out = tmp_path / "run"
    job = Job(
        train_args(
            data,
            out,
            steps,
            "train.save_every=50",
            "train.eval_every=50",
            "train.eval_batches=4",
            "train.log_every=50",
            micro_batch_size=2,
        ),
        tmp_path / "logs",
    )
    children = set()
    with job:
        while any(job.alive()):
            for pid in job.pids:
                children.update(descendants(pid))
            time.sleep(0.5)
        rcs = job.wait(10)
    assert rcs == [0, 0], job.output()
    leaked = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not leaked, f"processes left running: {leaked}"
    assert stray_files(out) == []
    assert sorted(ckpt_tags(out)) == [f"step{s:08d}" for s in range(steps - 100, steps + 1, 50)]
    report = []
    for r in (0, 1):
        path = out / ("metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl")
        rss = [json.loads(line)["rss_mb"] for line in path.read_text().splitlines()]
        assert len(rss) == steps
        warm = rss[steps // 4]
        growth = max(rss[steps // 4 :]) - warm
        report.append(f"rank {r}: {rss[0]:.0f} MB at step 1, {warm:.0f} MB after warm-up, max growth {growth:.1f} MB")
        assert growth < max(0.05 * warm, 30), f"rank {r} RSS grew by {growth:.1f} MB after warm-up: {rss[::10]}"
    print(f"\nRELIABILITY load: {steps} steps x 2 ranks; " + "; ".join(report))
