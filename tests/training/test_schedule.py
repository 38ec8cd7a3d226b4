"""The learning-rate schedules (pretrain/training/engine/lr_schedule.py) and decay branches
(pretrain/training/start/branch.py, docs/training.md "Schedules: cosine and warmup-stable-decay").

The curve of each schedule from the module, checked against DeepSpeed's WarmupCosineLR for
cosine; the wsd scheduler's state through a save and load; the DeepSpeed JSON's scheduler rules
under wsd; then real runs (micro-grt, ZeRO-3, one CPU process): a stable wsd run with
checkpoints, whose logged lr is the module's, and two decay branches of it (from its middle
checkpoints, both decay shapes), which continue its losses exactly until their decay acts, end
at min_lr, and leave every file of the stable run as it was, also when the branch prunes its
copy of the checkpoint; refused branches leave --out as it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
STEPS, WARMUP, LR, MIN_LR = 12, 3, 3e-3, 3e-4
MICRO_BATCH, SEQ_LEN = 4, 64  # the shards fixture's sequences (conftest.py)
TOKENS_PER_STEP = MICRO_BATCH * SEQ_LEN


# -------------------------------------------------------------------------- the curves
def train_config(**kw):
    from pretrain.runs.train_config import TrainConfig

    return TrainConfig(**{"steps": 30, "warmup_steps": 10, "lr": LR, "min_lr": MIN_LR, **kw})


@pytest.mark.parametrize("warmup,steps,horizon", [(10, 30, 0), (0, 30, 0), (1, 20, 0), (10, 40, 30), (50, 30, 0)])
def test_cosine_is_deepspeeds_warmup_cosine_lr(warmup, steps, horizon):
    """cosine stays DeepSpeed's WarmupCosineLR, built from the merged config as before; the
    module's formula gives the same learning rate at every step (and past the horizon)."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from pretrain.training.engine.ds_config import build_ds_config
    from pretrain.training.engine.lr_schedule import Schedule

    t = train_config(warmup_steps=warmup, steps=steps, schedule_steps=horizon)
    ds = build_ds_config({}, t, world_size=1, use_cuda=False)
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    theirs = WarmupCosineLR(opt, **ds["scheduler"]["params"])
    ours = Schedule.of(t, TOKENS_PER_STEP)
    for _ in range(steps + 15):
        theirs.step()
        assert ours.lr_at(theirs.last_batch_iteration) == theirs.get_lr()[0], theirs.last_batch_iteration
    if warmup < (horizon or steps):
        assert ours.lr_after(horizon or steps) == pytest.approx(MIN_LR, rel=1e-12)


@pytest.mark.parametrize("shape", ["linear", "sqrt"])
def test_wsd_warms_up_stays_then_decays_to_min_lr(shape):
    """wsd: cosine's warmup, lr exactly until the last decay_steps = ceil(decay_tokens / tokens per
    step) steps, then linear or 1 - sqrt to min_lr at the last step, min_lr after."""
    from pretrain.training.engine.lr_schedule import Schedule, decay_steps

    t = train_config(schedule="wsd", decay_tokens=7.5 * TOKENS_PER_STEP, decay_shape=shape)
    s = Schedule.of(t, TOKENS_PER_STEP)
    assert s.decay_steps == decay_steps(t.decay_tokens, TOKENS_PER_STEP) == 8
    cosine = Schedule.of(train_config(), TOKENS_PER_STEP)
    lrs = {n: s.lr_after(n) for n in range(0, 40)}  # n: train/lr at step n
    assert [lrs[n] for n in range(0, 11)] == [cosine.lr_after(n) for n in range(0, 11)]  # the same warmup
    assert all(lrs[n] == LR for n in range(11, 23))  # stable: exactly lr
    for n in range(23, 31):  # the last 8 logged steps decay
        progress = (n - 22) / 8
        drop = progress if shape == "linear" else math.sqrt(progress)
        assert lrs[n] == pytest.approx(LR - (LR - MIN_LR) * drop, rel=1e-12), n
    assert all(lrs[n] < lrs[n - 1] for n in range(23, 31))
    assert all(lrs[n] == pytest.approx(MIN_LR, rel=1e-12) for n in range(30, 40))
    if shape == "sqrt":  # 1 - sqrt drops fast first: below the linear decay everywhere inside
        linear = Schedule.of(train_config(schedule="wsd", decay_tokens=t.decay_tokens), TOKENS_PER_STEP)
        assert all(lrs[n] < linear.lr_after(n) for n in range(23, 30))


def test_wsd_without_decay_stays_at_lr_and_a_long_decay_caps_the_warmup():
    from pretrain.training.engine.lr_schedule import Schedule

    stable = Schedule.of(train_config(schedule="wsd"), TOKENS_PER_STEP)
    assert all(stable.lr_after(n) == LR for n in range(11, 1000, 7))
    whole = Schedule.of(train_config(schedule="wsd", decay_tokens=1e9), TOKENS_PER_STEP)  # longer than the run
    lrs = [whole.lr_after(n) for n in range(1, 31)]
    assert max(lrs) < LR and lrs[-1] == pytest.approx(MIN_LR, rel=1e-12)


def test_wsd_scheduler_continues_the_same_sequence_after_a_state_round_trip():
    """What DeepSpeed saves of the scheduler (its state_dict, pickled in the checkpoint) restores
    the sequence bit for bit in a new scheduler of the same config."""
    import pickle

    import torch

    from pretrain.training.engine.lr_schedule import client_scheduler

    t = train_config(schedule="wsd", decay_tokens=5 * TOKENS_PER_STEP, decay_shape="sqrt")
    build = client_scheduler(t, TOKENS_PER_STEP)
    assert build is not None and client_scheduler(train_config(), TOKENS_PER_STEP) is None

    def optimizer():
        groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(3))]}]
        return torch.optim.AdamW(groups, lr=LR)

    straight = build(optimizer())
    assert straight.get_last_lr() == [0.0, 0.0]
    sequence = []
    for _ in range(32):
        straight.step()
        sequence.append(straight.get_last_lr()[0])
    first = build(optimizer())
    for _ in range(17):
        first.step()
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    opt = optimizer()
    again = build(opt)
    again.load_state_dict(saved)
    resumed = []
    for _ in range(15):
        again.step()
        resumed.append(again.get_last_lr()[0])
        assert opt.param_groups[1]["lr"] == resumed[-1]
    assert resumed == sequence[17:]


def test_the_resume_rule_moves_a_wsd_decay_only_where_the_lr_at_the_checkpoint_stays():
    """resume.keep_wsd_lr: a stable stretch may get a longer run or a decay at its new end; a decay
    that has begun keeps its horizon when the run gets longer; a change that would move the learning
    rate at the checkpoint is refused in one line naming both rates."""
    from pretrain.training.start.resume_check import keep_wsd_lr

    tps = TOKENS_PER_STEP
    stable = train_config(schedule="wsd")  # 30 steps, no decay
    longer = train_config(schedule="wsd", steps=50)
    assert "lr 0.003 to the end" in keep_wsd_lr(longer, stable, 20, tps, tps, "checkpoint step00000020")
    assert longer.schedule_steps == 0  # the horizon follows the new length
    ended = train_config(schedule="wsd", steps=38, decay_tokens=8 * tps)  # a decay at the new end
    assert "decay over the last 8 steps" in keep_wsd_lr(ended, stable, 30, tps, tps, "checkpoint step00000030")
    decayed = train_config(schedule="wsd", decay_tokens=8 * tps)  # steps 23-30 decay
    more = train_config(schedule="wsd", steps=40, decay_tokens=8 * tps)
    keep_wsd_lr(more, decayed, 26, tps, tps, "checkpoint step00000026")
    assert more.schedule_steps == 30  # begun: it ends where it was going to, then min_lr
    for changed in (
        train_config(schedule="wsd", decay_tokens=8 * tps),  # a decay over steps 23-30: begun before step 26
        train_config(schedule="wsd", decay_tokens=8 * tps, decay_shape="sqrt", schedule_steps=30),
    ):
        old = stable if changed.decay_shape == "linear" else decayed
        message = one_line_error(lambda t=changed, o=old: keep_wsd_lr(t, o, 26, tps, tps, "checkpoint step00000026"))
        assert message.startswith("resume: the learning rate at checkpoint step00000026 (step 26) would jump")


# ------------------------------------------------------------- the DeepSpeed JSON's rules
def one_line_error(call) -> str:
    from grt_common.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_wsd_gives_deepspeed_no_scheduler_section_and_refuses_another_type():
    from pretrain.training.engine.ds_config import build_ds_config

    t = train_config(schedule="wsd", decay_tokens=1000)
    assert "scheduler" not in build_ds_config({}, t, 1, False)
    auto = {"scheduler": {"type": "auto", "params": {"warmup_num_steps": "auto", "total_num_steps": 30}}}
    assert "scheduler" not in build_ds_config(auto, t, 1, False)  # "auto" or agreeing values: accepted
    message = one_line_error(lambda: build_ds_config({"scheduler": {"type": "WarmupCosineLR"}}, t, 1, False))
    assert message.startswith('DeepSpeed config scheduler.type="WarmupCosineLR" disagrees') and "wsd" in message
    message = one_line_error(lambda: build_ds_config({"scheduler": {"params": {"warmup_num_steps": 99}}}, t, 1, False))
    assert "scheduler.params.warmup_num_steps=99" in message and "train.warmup_steps" in message
    message = one_line_error(lambda: build_ds_config({"scheduler": {"params": {"warmup_max_lr": 1}}}, t, 1, False))
    assert "scheduler.params.warmup_max_lr=1" in message
    cosine = build_ds_config({"scheduler": {"type": "WarmupCosineLR"}}, train_config(), 1, False)
    assert cosine["scheduler"]["params"]["total_num_steps"] == 30  # cosine as before


# ------------------------------------------------------------------------- real runs
def grt(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, f"grt {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under `root`: content hash, size and mtime (files), or None (folders)."""
    state: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            state[rel] = ("dir",)
        else:
            st = p.stat()
            state[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
    return state


def scalars(run: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def run_schedule(run: Path):
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.engine.lr_schedule import Schedule

    return Schedule.of(RunConfig.load(run / "config.json").train, TOKENS_PER_STEP)


@pytest.fixture(scope="module")
def stable(shards, tmp_path_factory) -> dict:
    """A wsd run without decay (train.decay_tokens 0): 12 steps, checkpoints at 4, 8 and 12."""
    out = tmp_path_factory.mktemp("wsd") / "stable"
    grt(
        "train",
        "--preset",
        "micro-grt",
        "--data",
        str(shards),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--ds-config",
        "ds_configs/zero3.json",
        *("--set", f"train.warmup_steps={WARMUP}", "--set", f"train.lr={LR}", "--set", f"train.min_lr={MIN_LR}"),
        *("--set", "train.schedule=wsd", "--set", "train.eval_every=0", "--set", "train.log_every=1"),
        *("--set", "train.save_every=4", "--set", "train.keep_checkpoints=5"),
    )
    return {"out": out, "files": snapshot(out), "data": shards}


def test_the_engine_steps_the_modules_curve(stable):
    """The logged train/lr of the real DeepSpeed run is the module's, step by step: the warmup, then lr."""
    lrs = scalars(stable["out"], "train/lr")
    schedule = run_schedule(stable["out"])
    assert sorted(lrs) == list(range(1, STEPS + 1))
    assert all(lrs[n] == pytest.approx(schedule.lr_after(n), rel=1e-6, abs=1e-12) for n in lrs), lrs
    assert lrs[1] == 0.0 and lrs[STEPS] == pytest.approx(LR, rel=1e-6)


def assert_untouched(stable: dict) -> None:
    assert snapshot(stable["out"]) == stable["files"], "the stable run's files changed"


def test_decay_branch_continues_the_run_and_ends_at_min_lr(stable, tmp_path):
    """From the middle checkpoint (step 8), a linear decay of 4 steps' tokens: train.steps becomes
    8 + 4, the first losses are the stable run's exactly (its updates 9 used the saved lr, 10 the
    same lr), the lr falls as the module says to min_lr at step 12, and the source is untouched."""
    out = tmp_path / "decay"
    proc = grt(
        "train",
        "--branch-from",
        str(stable["out"] / "checkpoints" / "step00000008"),
        "--out",
        str(out),
        "--set",
        f"train.decay_tokens={4 * TOKENS_PER_STEP}",
    )
    assert_untouched(stable)
    # the start's phase lines ("grt train: start: ...") aside, the branch's changes are one line
    notes = [line for line in proc.stderr.splitlines() if line.startswith("grt train:") and " start: " not in line]
    assert len(notes) == 1 and "resuming checkpoint step00000008 with changes" in notes[0], notes
    assert "train.decay_tokens 0.0 -> 1024.0" in notes[0] and "linear decay over the last 4 steps" in notes[0]
    record = json.loads((out / "branch.json").read_text())
    assert record["checkpoint"] == str((stable["out"] / "checkpoints" / "step00000008").resolve())
    assert record["step"] == 8 and record["steps"] == STEPS and record["files"] == "hard links"
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["steps"] == 12 and config["train"]["schedule"] == "wsd"
    assert config["branch_from"] == record["checkpoint"]
    lrs, schedule = scalars(out, "train/lr"), run_schedule(out)
    assert sorted(lrs) == [9, 10, 11, 12]
    assert all(lrs[n] == pytest.approx(schedule.lr_after(n), rel=1e-6) for n in lrs), lrs
    assert lrs[12] == pytest.approx(MIN_LR, rel=1e-6) and lrs[9] < LR
    mine, theirs = losses(out), losses(stable["out"])
    assert [mine[n] for n in (9, 10)] == [theirs[n] for n in (9, 10)]
    assert mine[11] != theirs[11]  # update 10 used the decayed lr
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step00000008", "step00000012"]
    linked = out / "checkpoints" / "step00000008" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    source = stable["out"] / "checkpoints" / "step00000008" / linked.name
    assert os.path.samefile(linked, source)

    # the same command again: the branch exists, nothing is linked or trained (a restart of a finished branch)
    again = grt(
        "train",
        "--branch-from",
        str(stable["out"]),
        "--out",
        str(out),
        "--set",
        f"train.decay_tokens={4 * TOKENS_PER_STEP}",
        "--dry-run",
    )
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "nothing to do" in again.stderr and "at step 12 of 12" in again.stderr, said
    assert_untouched(stable)


def test_sqrt_branch_of_a_longer_run_keeps_the_stable_phase_and_prunes_only_its_links(stable, tmp_path):
    """From step 4 with --steps 12 and a 1-sqrt decay of 4 steps: steps 5-8 keep the stable run's
    lr and losses exactly (the loss through step 10: update 9 still used lr), then the decay. With
    keep_checkpoints=1 the branch prunes its linked copy of step 4: the stable run keeps its files."""
    out = tmp_path / "sqrt"
    grt(
        "train",
        "--branch-from",
        str(stable["out"] / "checkpoints" / "step00000004"),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--set",
        f"train.decay_tokens={4 * TOKENS_PER_STEP}",
        "--set",
        "train.decay_shape=sqrt",
        "--set",
        "train.keep_checkpoints=1",
    )
    assert_untouched(stable)
    lrs, theirs_lr, schedule = scalars(out, "train/lr"), scalars(stable["out"], "train/lr"), run_schedule(out)
    assert sorted(lrs) == list(range(5, 13))
    assert [lrs[n] for n in range(5, 9)] == [theirs_lr[n] for n in range(5, 9)] == [pytest.approx(LR)] * 4
    assert all(lrs[n] == pytest.approx(schedule.lr_after(n), rel=1e-6) for n in lrs), lrs
    assert lrs[9] == pytest.approx(LR - (LR - MIN_LR) * math.sqrt(1 / 4), rel=1e-6)
    assert lrs[12] == pytest.approx(MIN_LR, rel=1e-6)
    mine, theirs = losses(out), losses(stable["out"])
    assert [mine[n] for n in range(5, 11)] == [theirs[n] for n in range(5, 11)]
    assert mine[11] != theirs[11]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step00000012"]


# ----------------------------------------------------------------------- refused branches
def in_process(argv: list[str], capsys) -> tuple[int, list[str]]:
    from pretrain.train import main

    capsys.readouterr()
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def branch_argv(source: Path, out: Path, *extra: str) -> list[str]:
    return ["--branch-from", str(source), "--out", str(out), "--set", f"train.decay_tokens={TOKENS_PER_STEP}", *extra]


def test_refused_branches_leave_out_as_it_was(stable, tmp_path, capsys):
    """Refused in one line, exit 2, --out absent or as it was: a changed lr (the resume rule), a
    cosine source, --out inside the source, no decay; a refusal by the trainer's own checks after the
    links were made (another shard list) removes them again."""
    out = tmp_path / "new"
    cases = [
        (branch_argv(stable["out"], out, "--set", "train.lr=1e-3"), "train.lr 0.003 -> 0.001"),
        (branch_argv(stable["out"], stable["out"] / "inside"), "a branch needs a new run directory"),
        (["--branch-from", str(stable["out"]), "--out", str(out)], "needs its decay"),
        (branch_argv(stable["out"], out, "--set", "train.schedule=cosine"), "trains the wsd schedule's decay"),
    ]
    cosine = tmp_path / "cosine" / "checkpoints" / "step00000004"
    shutil.copytree(stable["out"] / "checkpoints" / "step00000004", cosine)
    saved = json.loads((cosine / "config.json").read_text())
    saved["train"]["schedule"] = "cosine"
    (cosine / "config.json").write_text(json.dumps(saved))
    cases.append((branch_argv(cosine.parent.parent, out), "train.schedule 'cosine' -> 'wsd'"))
    for argv, want in cases:
        rc, err = in_process(argv, capsys)
        assert rc == 2 and len(err) == 1 and err[0].startswith("grt train: error:") and want in err[0], (argv, err)
        assert not out.exists() and not (stable["out"] / "inside").exists()

    other = tmp_path / "other"  # the same text and tokenizer in other shards: another shard list
    tokenizer = stable["data"].parent.parent / "tok.model"
    grt(
        "data",
        "prepare",
        "-i",
        str(REPO / "examples" / "data" / "tinyshakespeare.txt"),
        "--txt-mode",
        "paragraph",
        "-t",
        str(tokenizer),
        "-o",
        str(other),
        "--seq-len",
        str(SEQ_LEN),
        "--shard-size-mb",
        "0.3",
        "--val-fraction",
        "0.05",
        "-q",
    )
    out.mkdir()  # empty: a folder of other files is refused before the links (test_output_folders.py)
    before = snapshot(out)
    rc, err = in_process(branch_argv(stable["out"], out, "--data", str(other / "manifest.json")), capsys)
    assert rc == 2 and len(err) == 1 and "shard list changed since checkpoint step00000012" in err[0], err
    assert snapshot(out) == before
    assert_untouched(stable)


def test_grt_launch_resolves_the_branch_and_writes_nothing(stable, tmp_path):
    """grt launch's config resolution takes --branch-from: the branch's config (wsd, its length,
    branch_from) and a resume, checked against the source on this host; nothing written."""
    from launcher.checks import LaunchError
    from launcher.cli import resolve_train_config

    out = tmp_path / "launched"
    config, resume, _ = resolve_train_config(branch_argv(stable["out"] / "checkpoints", out), 1)
    assert resume and config["train"]["steps"] == 13 and config["train"]["schedule"] == "wsd"
    assert config["branch_from"] == str((stable["out"] / "checkpoints" / "step00000012").resolve())
    assert config["out"] == str(out) and not out.exists()
    with pytest.raises(LaunchError) as err:
        resolve_train_config(branch_argv(stable["out"], out, "--set", "train.warmup_steps=1"), 1)
    assert "train.warmup_steps 3 -> 1" in str(err.value) and not out.exists()
    assert_untouched(stable)


@pytest.mark.slow
def test_two_ranks_branch_at_once_on_another_world_size(stable, tmp_path):
    """Both ranks of a 2-rank launch make the branch (one rename wins), then resume the 1-rank
    checkpoint through DeepSpeed's universal checkpoint, written inside the branch's tag only."""
    from multiproc import run_ranks

    out = tmp_path / "two"
    argv = ["-m", "pretrain.train", *branch_argv(stable["out"] / "checkpoints" / "step00000008", out)]
    results = run_ranks([*argv, "--micro-batch-size", "2", "--set", "train.dist_timeout_s=300"], world=2, env=ENV)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    assert_untouched(stable)
    assert (out / "checkpoints" / "step00000008" / "universal").is_dir()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    lrs = scalars(out, "train/lr")
    assert sorted(lrs) == list(range(9, 10)) and lrs[9] == pytest.approx(MIN_LR, rel=1e-6)
