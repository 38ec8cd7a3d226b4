"""The GPU check (scripts/gpu_check.sh) without a GPU: every GPU-mode row that takes a preset and
data passes the trainer's own checks against the data the GPU will make (`grt train --dry-run`,
`grt compare --dry-run`); `--cpu` runs the same rows at a tiny size, within the device's limits on
files, and a call killed halfway keeps the rows it finished."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time

import pytest
from multiproc import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
MAX_FILES_BACK = 8  # what the device tool brings back from $OUT


def plan(work, *args) -> list[tuple[str, int, list[str]]]:
    return [(name, limit, command) for name, limit, _, command in planned(work, *args)]


def planned(work, *args) -> list[tuple[str, int, str, list[str]]]:
    """The rows `--plan` prints: name, time limit, estimated seconds ("-" on the CPU), command."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_CHECK_WORK": str(work)},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("# "):
            continue
        name, limit, estimate, command = line.split("\t")
        rows.append((name, int(limit), estimate, shlex.split(command)))
    return rows


def budget(work, call: str) -> tuple[int, int]:
    """The call's budget and device timeout_s, as `--plan` prints them."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--plan", call],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPU_CHECK_WORK": str(work)},
    )
    m = re.match(r"# call (\d): budget (\d+) s, timeout_s (\d+)$", proc.stdout.splitlines()[0])
    assert m and m[1] == call, proc.stdout[:200]
    return int(m[2]), int(m[3])


def test_both_calls_fit_the_device_with_a_rerun_to_spare_and_the_docs_say_so(tmp_path):
    """The machine's start (240 s, the longest seen), both calls' timeout_s and a rerun of the longer
    one fit in the device's 15 minutes, as the plan's device line sums them; docs/gpu.md gives the
    device tool the timeout_s that the plan prints. (The budgets before, 2 x 225 s, planned a 150 s
    start: at 240 s, 240 + 3 x 245 = 975 s left no rerun.) Call 1's estimates hold every goal's row."""
    (b1, t1), (b2, t2) = budget(tmp_path, "1"), budget(tmp_path, "2")
    assert b1 < t1 <= 600 and b2 < t2 <= 600, (b1, t1, b2, t2)
    assert 240 + t1 + t2 + max(t1, t2) <= 900, (t1, t2)
    for call, t in (("1", t1), ("2", t2)):
        head = subprocess.run(
            ["bash", str(SCRIPT), "--plan", call],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GPU_CHECK_WORK": str(tmp_path)},
        ).stdout.splitlines()
        m = re.match(
            r"# device: start (\d+) \+ call 1 (\d+) \+ call 2 (\d+) \+ a rerun of either (\d+) = (\d+) s of 900$",
            head[1],
        )
        assert m and int(m[1]) >= 240 and int(m[2]) == t1 and int(m[3]) == t2 and int(m[4]) == max(t1, t2), head[1]
        assert int(m[5]) == sum(int(m[i]) for i in range(1, 5)) <= 900, head[1]
        assert re.match(rf"# estimated \d+ s of work for the budget of {t - 15} s", head[-1]), head[-1]
        if call == "1":
            assert head[-1].endswith("every row is expected to run"), head[-1]
    docs = (REPO / "docs" / "gpu.md").read_text()
    assert f"`timeout_s` {t1} for call 1 and {t2} for call 2" in docs


def test_each_calls_first_training_row_has_the_time_of_a_cold_start(tmp_path):
    """The first training row of a call pays CUDA's, Triton's and inductor's cold start (the loss
    chunk's compile): its limit covers its estimate, which counts that start, and every row's
    limit covers its own estimate. It is the call's gate: a limit too short ended the call."""
    for call in ("1", "2"):
        rows = planned(tmp_path, call)
        first = next(r for r in rows if r[3][:2] == ["grt", "train"])
        assert first[1] >= 120 and first[1] >= int(first[2]) + 30, first[:3]
        assert all(limit >= int(estimate) for _, limit, estimate, _ in rows), rows


def test_the_plan_puts_data_then_the_eight_perf_rows_in_call_1(tmp_path):
    """Call 1: the dense baseline first, each pair's dense row before its GRT row; call 2: the CUDA
    numerics (the loss against its reference, the bf16 loop state) before the smoke."""
    rows = plan(tmp_path)
    names = [name for name, _, _ in rows]
    assert names[0] == "data" and all(n.startswith("perf-") for n in names[1:]) and len(names) == 9, names
    perf = {tuple(n.split("-")[-2:]) for n in names[1:9]}
    assert perf == {(f"z{s}", m) for s in (2, 3) for m in ("eager", "compiled")}, perf
    assert all("dense-small" in a and a.replace("dense", "grt") == b for a, b in zip(names[1::2], names[2::2])), names
    for name, _, command in rows[1:9]:
        text = " ".join(command)
        assert "train.activation_checkpointing=off" in text and "train.save_final=false" in text, name
        assert "--steps 24" in text and "train.log_every=8" in text  # 16 measured steps after the first window
        assert "--preset grt-small" in text or "--preset dense-small" in text
        assert "train.precision=bf16" in text
    assert "gutenberg-50257.model" in " ".join(rows[0][2]) and "--seq-len 1024" in " ".join(rows[0][2])
    second = [name for name, _, _ in plan(tmp_path, "2")]
    assert second[:3] == ["data", "bench-loss", "bench-precision"], second
    assert second[3:8] == ["smoke-train", "smoke-resume", "smoke-export", "smoke-eval", "smoke-generate"], second
    commands = {name: command for name, _, command in plan(tmp_path, "2")}
    assert commands["bench-loss"] == ["grt", "bench", "loss", "--rows", "plain,compiled", "--tokens", "16384"]
    assert "--train-steps 0" in " ".join(commands["bench-precision"])


DRY_RUNS = r"""
import contextlib, io, json, sys
from pretrain.train import main as train
from pretrain.tools.compare.cli import main as compare
results = []
for name, command in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = {"train": train, "compare": compare}[command[1]](command[2:] + ["--dry-run"])
    results.append([name, command[1], code, out.getvalue(), err.getvalue()[-1500:]])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def gpu_work(tmp_path_factory):
    """A GPU_CHECK_WORK folder holding the GPU's own data (seq 1024, GPT-2's vocabulary), made by the
    plan's data row: the data the rows of both calls name."""
    work = tmp_path_factory.mktemp("gpu-work")
    data = next(command for name, _, command in plan(work) if name == "data")
    made = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *data[1:]], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr
    return work


@pytest.mark.slow
@pytest.mark.usefixtures("beside_cpu_call_1")
def test_every_gpu_row_with_a_preset_passes_the_trainers_checks_on_the_gpu_data(gpu_work):
    """The GPU's own data (`gpu_work`), then each `grt train` row of both calls (overrides and
    DeepSpeed file as written) with --dry-run and each `grt compare` row with its --dry-run (in one
    process). On the script before this test, tiny-grt (256 tokens of context) on seq-1024 shards
    failed here: `the shards' seq_len=1024 exceeds model.max_seq_len=256`."""
    rows = plan(gpu_work) + [r for r in plan(gpu_work, "2") if r[0] != "data"]
    todo = [[name, command] for name, _, command in rows if command[:2] in (["grt", "train"], ["grt", "compare"])]
    assert len(todo) >= 16, todo
    proc = subprocess.run(
        [sys.executable, "-c", DRY_RUNS],
        input=json.dumps(todo),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, command, code, out, err in json.loads(proc.stdout.strip().splitlines()[-1]):
        # grt train: its line on stderr, the config.json on stdout; grt compare: a line a run on stdout
        said = err if command == "train" else out
        assert code == 0 and "would train" in said, (name, code, out[-1500:], err)
        assert command != "train" or json.loads(out)["model"]["name"], (name, out[-1500:])


def test_dry_run_refuses_a_preset_whose_context_is_shorter_than_the_shards(gpu_work, tmp_path):
    """The failure the old GPU check would have met on the GPU (on its seq-1024 data), now found
    before any process starts."""
    from multiproc import grt

    r = grt(
        "train",
        "--preset",
        "tiny-grt",
        "--data",
        str(gpu_work / "data" / "manifest.json"),
        "--out",
        str(tmp_path / "run"),
        "--dry-run",
    )
    assert r.returncode == 2 and "seq_len=1024 exceeds model.max_seq_len=256" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def _run(out, work, *args, rows=None, env_extra=None):
    """`--cpu` with a `grt` on PATH that fails: the GPU machine has no `grt` installed, the script must
    run the checkout's own CLI. Its output goes to `output.txt` beside `out` (not into it: the files
    that come back), which no pipe can fill while the call runs in the background."""
    stub = work.parent / "no-grt"
    stub.mkdir(exist_ok=True)
    (stub / "grt").write_text("#!/bin/sh\necho 'not the checkout' >&2; exit 99\n")
    (stub / "grt").chmod(0o755)
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PATH": f"{stub}:{os.environ['PATH']}"}
    if rows:
        env["GPU_CHECK_ROWS"] = rows
    env.update(env_extra or {})
    with open(out.parent / "output.txt", "w") as output:
        return subprocess.Popen(
            ["bash", str(SCRIPT), "--cpu", *args],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def _output(out) -> str:
    return (out.parent / "output.txt").read_text()


def _results(out):
    return [line.split("\t") for line in (out / "results.tsv").read_text().splitlines() if line.strip()]


CALL_1 = "test_cpu_mode_runs_every_row_of_call_1_in_the_planned_order"


@pytest.fixture(scope="module")
def cpu_call_1(tmp_path_factory):
    """`--cpu` call 1, started in the background (by `beside_cpu_call_1`, or by CALL_1 itself) and
    awaited by CALL_1. Its rows run one after the other on one thread each (the script sets
    OMP_NUM_THREADS=1), so on CI's 2 cores the tests that run meanwhile, each in its own processes,
    take the core it leaves idle instead of waiting for it. Killed at the module's end if unfinished."""
    base = tmp_path_factory.mktemp("cpu-call-1")
    out, work = base / "out", base / "work"
    proc = _run(out, work)
    yield proc, out, work
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def beside_cpu_call_1(request):
    """Start `cpu_call_1` now when CALL_1, which waits for it, is among the tests to run; otherwise
    (the test run alone, or CALL_1 deselected) start nothing."""
    if any(item.name == CALL_1 and item.module is request.module for item in request.session.items):
        request.getfixturevalue("cpu_call_1")


@pytest.mark.slow
@pytest.mark.usefixtures("beside_cpu_call_1")
def test_a_call_killed_halfway_keeps_the_rows_it_finished(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _run(out, work, rows="^(data|perf-micro-(grt|dense)-z2-eager|smoke-.*)$")
    deadline = time.time() + 600
    summary = out / "summary.md"
    while time.time() < deadline and not (summary.is_file() and "perf-micro-dense-z2-eager" in summary.read_text()):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # as the device tool ends a command that ran past its limit
    proc.wait(timeout=60)
    results = _results(out)
    assert [r[0] for r in results][:2] == ["data", "perf-micro-dense-z2-eager"] and len(results) < 8, results
    assert all(r[6] == "pass" for r in results), results
    assert "perf-micro-dense-z2-eager" in (out / "summary.md").read_text()
    assert "===== perf-micro-dense-z2-eager (pass" in (out / "log.txt").read_text()


@pytest.mark.slow
def test_cpu_mode_runs_every_row_of_call_1_in_the_planned_order(cpu_call_1):
    proc, out, work = cpu_call_1
    proc.wait(timeout=1200)
    assert proc.returncode == 0, _output(out)[-4000:]
    results = _results(out)
    assert [r[0] for r in results] == [name for name, _, _ in plan(work, "--cpu")], results
    assert all(r[6] == "pass" for r in results), results
    perf = [r for r in results if r[0].startswith("perf-")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in perf), perf  # tokens/s and MFU of every perf row
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES_BACK and all(p.parent == out for p in files), files
    summary = (out / "summary.md").read_text()
    assert "micro-grt/micro-dense MFU (equal FLOPs), ZeRO-3 compiled" in summary, summary
    # the rehearsal is the GPU's precision path: DeepSpeed's bf16 mode
    with tarfile.open(out / "logs.tar.gz") as archive:
        logs = {m.name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}
    assert sorted(logs) == sorted(f"logs/{r[0]}.log" for r in results), sorted(logs)
    assert all("bf16" in logs[f"logs/{r[0]}.log"] for r in perf)
    _assert_env_file(out)


def _assert_env_file(out):
    env = (out / "env.txt").read_text()
    for what in ("python ", "torch ", "triton ", "deepspeed ", "torch.version.cuda", "## python3 -m pip list"):
        assert what in env, (what, env[:2000])
    assert "deepspeed==" in env and "torch==" in env, env[-2000:]


# a row whose process fails: loaded by every Python the rows start (through PYTHONPATH), it ends the
# one whose arguments hold the word given
FAULT = """import os, sys
if os.environ["GPU_CHECK_TEST_FAIL"] in sys.argv:
    print("planted failure of", sys.argv, file=sys.stderr, flush=True)
    os._exit(3)  # not sys.exit: a SystemExit inside the site module is a fatal error of its own (exit 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("word, ran", [("prepare", ["data"]), ("train", ["data", "perf-micro-dense-z2-eager"])])
def test_a_failed_data_row_or_first_training_row_ends_the_call_with_its_whole_log(tmp_path, word, ran):
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {"PYTHONPATH": str(tmp_path / "fault"), "GPU_CHECK_TEST_FAIL": word}
    proc = _run(out, work, env_extra=env)
    assert proc.wait(timeout=300) == 1, _output(out)[-3000:]
    results = _results(out)
    assert [r[0] for r in results] == ran and results[-1][6] == "FAIL (exit 3)", results
    assert "the call ends here" in _output(out) and "planted failure of" in _output(out)
    assert f"===== {ran[-1]} (FAIL (exit 3)" in (out / "log.txt").read_text()
    assert "planted failure of" in (out / "log.txt").read_text()


@pytest.mark.slow
def test_a_failed_grt_row_ends_nothing_and_the_dense_rows_and_their_ratio_come_back(tmp_path):
    """Every GRT process fails (as the fused gate or the loop under compile might on a GPU): the call
    goes on past it, the dense rows before and after it pass, and the dense ZeRO-3/ZeRO-2 ratio is in
    the summary. Before, the first training row (a GRT one) was the call's gate and took them all."""
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {"PYTHONPATH": str(tmp_path / "fault"), "GPU_CHECK_TEST_FAIL": "micro-grt"}
    proc = _run(out, work, rows="^(data|perf-micro-(dense|grt)-z2-eager|perf-micro-dense-z3-eager)$", env_extra=env)
    assert proc.wait(timeout=600) == 1, _output(out)[-3000:]  # some rows failed
    results = [(r[0], r[6]) for r in _results(out)]
    assert results == [
        ("data", "pass"),
        ("perf-micro-dense-z2-eager", "pass"),
        ("perf-micro-grt-z2-eager", "FAIL (exit 3)"),
        ("perf-micro-dense-z3-eager", "pass"),
    ], results
    assert re.search(r"\| micro-dense ZeRO-3/ZeRO-2 tokens/s, eager \| [0-9.]+ \|", (out / "summary.md").read_text())


def test_rows_that_need_the_smoke_are_skipped_when_it_did_not_pass(tmp_path):
    """The smoke's export, eval and decode use its run and export: without a passed `smoke-train`
    (here not run at all) they are recorded as skipped for what they need, not run to fail."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _run(out, work, "2", rows="^(data|smoke-export|smoke-eval|bench-decode)$")
    assert proc.wait(timeout=300) == 0, _output(out)[-3000:]
    results = [(r[0], r[6]) for r in _results(out)]
    assert results == [
        ("data", "pass"),
        ("smoke-export", "skipped (needs smoke-train)"),
        ("smoke-eval", "skipped (needs smoke-export)"),
        ("bench-decode", "skipped (needs smoke-export)"),
    ], results


def test_the_throughput_goal_is_45_percent_mfu_of_an_h200_for_dense_small():
    """The summary's one goal and its tokens/s: 45% of 989 TFLOP/s over dense-small's FLOPs per token."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_summary import DENSE_MFU_GOAL, DENSE_TOKENS_GOAL

    from pretrain.model.flops import train_flops_per_token
    from pretrain.presets import get_preset

    tokens = DENSE_MFU_GOAL / 100 * 989e12 / train_flops_per_token(get_preset("dense-small"), 1024, 1)
    assert abs(tokens - DENSE_TOKENS_GOAL) / DENSE_TOKENS_GOAL < 0.005, tokens
    docs = (REPO / "docs" / "performance.md").read_text() + (REPO / "docs" / "gpu.md").read_text()
    assert "470K" not in docs and "470,000" not in docs


def test_rows_past_the_budget_are_skipped_not_failed_and_out_is_emptied_not_removed(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier call")
    proc = _run(out, work, env_extra={"GPU_CHECK_BUDGET_S": "1"})
    assert proc.wait(timeout=120) == 0, _output(out)[-3000:]
    results = _results(out)
    assert [r[0] for r in results] == [name for name, _, _ in plan(work, "--cpu")], results
    assert all(r[6] == "skipped (budget)" for r in results), results
    assert not (out / "stale.txt").exists() and "skipped (budget)" in (out / "summary.md").read_text()
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.txt", "env.txt", "log.txt", "logs.tar.gz", "results.tsv", "summary.md"], files
    _assert_env_file(out)
