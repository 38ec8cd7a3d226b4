"""Files from elsewhere run nothing and write nowhere outside their folder (issue 58, docs/reliability.md
"What the project trusts and what it refuses").

A payload is planted in a copy of a trained run (micro-dense, ZeRO-3, the session's): a pickle whose
`__reduce__` would touch a marker file. Every command that reads a checkpoint must refuse it in one
line naming the file and the type, exit non-zero, and leave no marker. Commands run in this process
(`grt_in_process`: cheap), one as its own `grt` process (the entry point's switch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import error_lines, grt_in_process
from test_bad_input_data import edited  # a copy of a shard folder, its manifest edited
from trained_models import REPO, dense_run, grt_run, manifest  # noqa: F401 (fixtures)

STEP = "step00000006"  # dense_run's checkpoint


class Payload:
    """Pickled as a call of os.system: loading it with a full unpickler runs `touch marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(run: Path, name: str, marker: Path) -> Path:
    """The payload added to file `name` of `run`'s newest checkpoint (a copy); returns that file."""
    import torch

    path = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / name
    state = torch.load(path, weights_only=False)  # the test's own trained file
    state["note"] = Payload(marker)
    torch.save(state, path)
    return path


def planted_copy(trained: Path, tmp_path: Path, name: str = "zero_pp_rank_0_mp_rank_00_model_states.pt"):
    """A copy of a trained run, its file `name` holding the payload: (run, marker, file)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("train.lock", "tb"))
    marker = tmp_path / "MARKER"
    return run, marker, plant(run, name, marker)


@pytest.fixture
def planted(dense_run, tmp_path):  # noqa: F811
    """A copy of the trained dense run, its DeepSpeed model states holding the payload."""
    return planted_copy(dense_run, tmp_path)


def refused(rc: int, err: str, path: Path) -> None:
    lines = [line for line in error_lines(err) if "error" in line]
    assert rc != 0 and len(lines) == 1, (rc, err[-3000:])
    assert f"{path} holds the type posix.system" in lines[0] and "nothing of it was run" in lines[0], lines


def grt_process(*args: str) -> tuple[int, str]:
    """`grt ARGS` as its own process (a training command ends its process: not in pytest's), with a
    caller's opposite switch set (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), which the entry point overrides."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "@run", "--tasks", "val", "--data", "@manifest", "--device", "cpu"],
        ["generate", "@run", "--prompt", "To be", "--max-new-tokens", "2", "--device", "cpu"],
        ["export", "--checkpoint", "@run", "--out", "@tmp/export", "--no-hf"],
        ["train", "--out", "@run", "--resume", "--steps", "8"],
        ["train", "--out", "@run", "--resume", "--steps", "8", "--dry-run"],
    ],
    ids=["eval", "generate", "export", "resume", "dry-run"],
)
def test_a_planted_checkpoint_runs_nothing(planted, manifest, tmp_path, capsys, command):  # noqa: F811
    run, marker, path = planted
    subs = {"@run": str(run), "@manifest": str(manifest), "@tmp": str(tmp_path)}
    argv = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in command]
    rc, err = grt_process(*argv) if argv[0] == "train" else grt_in_process(argv, capsys)
    assert not marker.exists()
    refused(rc, err, path)


def test_a_planted_checkpoint_runs_nothing_in_analyze(grt_run, manifest, tmp_path, capsys):  # noqa: F811
    """grt analyze takes a looped model only: the trained GRT's copy."""
    run, marker, path = planted_copy(grt_run, tmp_path)
    argv = ["analyze", str(run), "--data", str(manifest), "--out", str(tmp_path / "analysis"), "--device", "cpu"]
    rc, err = grt_in_process(argv, capsys)
    assert not marker.exists()
    refused(rc, err, path)


def test_a_planted_rank_state_runs_nothing_in_a_branch(dense_run, tmp_path):  # noqa: F811
    """The project's own file (rank0_state.pt), read by --branch-from's plan."""
    run, marker, path = planted_copy(dense_run, tmp_path, "rank0_state.pt")
    saved = json.loads((path.parent / "config.json").read_text())
    saved["train"]["schedule"] = "wsd"  # a source a branch may decay
    (path.parent / "config.json").write_text(json.dumps(saved))
    rc, err = grt_process(
        "train", "--branch-from", str(run), "--out", str(tmp_path / "branch"), "--set", "train.decay_tokens=512"
    )
    assert not marker.exists()
    refused(rc, err, path)


def test_deepspeeds_own_loaders_are_weights_only(planted, monkeypatch):
    """DeepSpeed's zero_to_fp32 and the universal conversion (ds_to_universal, a child process) call
    torch.load with weights_only=False themselves: inside the project's loads they are weights-only
    even where the read-through check is bypassed."""
    import pickle

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from pretrain.runs.trusted_files import weights_only_loads
    from pretrain.training.checkpoint import universal

    run, marker, path = planted
    step_dir = run / "checkpoints" / STEP
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError, match="posix.system"):
        get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=STEP)
    assert not marker.exists()
    with pytest.raises(universal.ConversionError, match=f"{path} holds the type posix.system"):
        universal.convert(step_dir)
    monkeypatch.setattr(universal, "read_through_all", lambda _: None)  # the converter alone
    with pytest.raises(universal.ConversionError, match="ds_to_universal failed.*posix.system"):
        universal.convert(step_dir)
    assert not marker.exists()


# -- a manifest: its shard names are paths or URLs, its relative paths stay in its folder ----------
def name_shard(index: int, name: str):
    def edit(raw: dict) -> None:
        raw["splits"]["train"][index]["name"] = name

    return edit


def name_tokenizer(path: str):
    def edit(raw: dict) -> None:
        raw["tokenizer"]["path"] = path

    return edit


def test_a_command_in_a_manifest_runs_nowhere(manifest, tmp_path, capsys):  # noqa: F811
    """`pipe:` (webdataset's shell command) in `grt data inspect --verify` and a 2-step `grt train`."""
    marker = tmp_path / "MARKER"
    path = edited(manifest, tmp_path / "shards", name_shard(1, f"pipe:touch {marker}; cat x"))
    want = f"manifest '{path}': train shard 1 'pipe:touch {marker}; cat x' names a pipe: shard"
    rc, err = grt_in_process(["data", "inspect", str(path), "--verify"], capsys)
    assert rc == 2 and len(error_lines(err)) == 1 and want in err, err
    rc, err = grt_process("train", "--preset", "micro-dense", "--data", str(path), "--out", str(tmp_path / "run"))
    assert rc == 2 and want in error_lines(err)[-1], err[-3000:]
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "edit, want",
    [
        (name_shard(0, "../outside/train-000000.tar"), "train shard 0 '../outside/train-000000.tar' leaves the folder"),
        (name_shard(0, "sub/../../x.tar"), "train shard 0 'sub/../../x.tar' leaves the folder"),
        (name_shard(2, "ftp://host/x.tar"), "train shard 2 'ftp://host/x.tar' names a ftp: shard"),
        (name_tokenizer("../../../../etc/passwd"), "tokenizer.path '../../../../etc/passwd' leaves the folder"),
        (name_tokenizer("/etc/passwd"), "tokenizer '/etc/passwd' has sha256"),  # absolute: read and hashed
        (name_tokenizer("https://host/tok.model"), "tokenizer.path is 'https://host/tok.model'"),
    ],
    ids=["up", "through", "scheme", "tokenizer-up", "tokenizer-elsewhere", "tokenizer-url"],
)
def test_a_manifests_paths_stay_in_its_folder(manifest, tmp_path, capsys, edit, want):  # noqa: F811
    """Refused in one line by every reader of a manifest (`grt data inspect`, `grt eval`'s --data, a
    run's plan: Manifest.load), before anything is read from the path; the tokenizer file itself is
    hashed against the manifest's record."""
    path = edited(manifest, tmp_path / "shards", edit)
    rc, err = grt_in_process(["data", "inspect", str(path), "--verify"], capsys)
    assert rc == 2 and len(error_lines(err)) == 1 and want in err, err


def test_the_dry_run_reads_the_tokenizer_file_itself(manifest, tmp_path):  # noqa: F811
    """A manifest whose tokenizer.path names another file than the one it records: `--dry-run`
    hashes the file (before, it printed the recorded hash and the run died after its engine)."""
    other = tmp_path / "other.model"
    other.write_bytes(b"not the manifest's tokenizer")
    path = edited(manifest, tmp_path / "shards", name_tokenizer(str(other)))
    args = ["train", "--preset", "micro-dense", "--data", str(path), "--out", str(tmp_path / "run"), "--steps", "2"]
    rc, err = grt_process(*args, "--dry-run")
    assert rc == 2 and f"tokenizer '{other}' has sha256" in error_lines(err)[-1], err[-3000:]


# -- a run's markers and records stay in its folder -------------------------------------------------
def test_latest_is_not_followed_out_of_its_folder(dense_run, tmp_path, capsys, caplog):  # noqa: F811
    """`checkpoints/latest` naming another run's checkpoint (holding a payload): the command loads
    this run's own newest checkpoint, and says which."""
    other, marker, _ = planted_copy(dense_run, tmp_path / "other")
    run = tmp_path / "run"
    shutil.copytree(dense_run, run, ignore=shutil.ignore_patterns("train.lock", "tb"))
    (run / "checkpoints" / "latest").write_text(f"../../other/run/checkpoints/{STEP}\n")
    rc, err = grt_in_process(["export", "--checkpoint", str(run), "--out", str(tmp_path / "export"), "--no-hf"], capsys)
    assert rc == 0 and not marker.exists(), err
    assert f"grt: start: loading checkpoint {run / 'checkpoints' / STEP}\n" in err
    assert f"names '../../other/run/checkpoints/{STEP}', which is not a checkpoint of" in caplog.text


def test_a_branch_record_is_not_followed_out_of_its_source(dense_run, tmp_path):  # noqa: F811
    """A branch's branch.json naming a checkpoint outside the run it records as its source: refused."""
    out = tmp_path / "branch"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere" / "checkpoints" / STEP
    record = {"source_run": str(dense_run.resolve()), "checkpoint": str(elsewhere)}
    (out / "branch.json").write_text(json.dumps(record))
    rc, err = grt_process(
        "train", "--branch-from", str(dense_run), "--out", str(out), "--set", "train.decay_tokens=512"
    )
    assert rc == 2 and "branch.json names checkpoint" in error_lines(err)[-1], err[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["branch.json"]


def test_a_log_linked_out_of_the_run_is_not_written(dense_run, tmp_path):  # noqa: F811
    """On --resume (and its --dry-run), a train.log that is a symbolic link out of the run directory:
    refused in one line, the file it names untouched."""
    run = tmp_path / "run"
    shutil.copytree(dense_run, run, ignore=shutil.ignore_patterns("train.lock", "tb"))
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (run / "train.log").unlink()
    (run / "train.log").symlink_to(outside)
    for extra in (["--dry-run"], []):
        rc, err = grt_process("train", "--out", str(run), "--resume", "--steps", "8", *extra)
        assert rc == 2 and "train.log is a symbolic link to" in error_lines(err)[-1], err[-3000:]
    assert outside.read_text() == "not the run's\n"


# -- a full disk during a save names the disk --------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A 200 KiB tmpfs (needs root: skipped elsewhere), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_every_save_names_a_full_disk(full_disk):
    """torch.save says "enforce fail at inline_container.cc" on a full disk: the rank's state file, the
    background writes (train.async_save) and DeepSpeed's own writes (RecordWriteErrors) each say
    ENOSPC, naming the file (grt_common/errors.py's one line)."""
    import errno
    from types import SimpleNamespace

    import torch

    from grt_common.errors import file_system_problem
    from pretrain.training.checkpoint.async_save import BackgroundWrites
    from pretrain.training.engine.deepspeed_internals import RecordWriteErrors, save_file

    state = {"w": torch.zeros(200_000)}
    errors = []
    with pytest.raises(OSError) as info:
        save_file(state, full_disk / "rank0_state.pt")
    errors.append(info.value)
    (full_disk / "rank0_state.pt").unlink()
    writes = BackgroundWrites(SimpleNamespace())
    writes.add(full_disk / "background.pt", state)
    writes.start()
    errors.append(writes.wait())
    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace(save=lambda sd, path: torch.save(sd, path)))
    with RecordWriteErrors(engine) as recorded:
        engine.checkpoint_engine.save(state, str(full_disk / "optim_states.pt"))
    errors.append(recorded.errors[0])
    for err, name in zip(errors, ["rank0_state.pt", "background.pt", "optim_states.pt"]):
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
        assert file_system_problem(err).startswith(f"{full_disk / name}: No space left on device"), err


def test_a_synchronous_save_on_a_full_disk_names_it(manifest, tmp_path):  # noqa: F811
    """A real run whose checkpoints folder is full: one line naming the disk, exit 3."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(out / "checkpoints")]).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        rc, err = grt_process(
            *("train", "--preset", "micro-dense", "--data", str(manifest), "--out", str(out), "--steps", "2"),
            *("--micro-batch-size", "8", "--set", "train.save_every=2", "--set", "train.eval_every=0"),
        )
    finally:
        subprocess.run(["umount", "-l", str(out / "checkpoints")], capture_output=True)
    line = error_lines(err)[-1]
    assert rc == 3 and line.startswith("grt train: stopped: could not write checkpoint"), err[-3000:]
    assert f"No space left on device: the file system of {out / 'checkpoints' / 'step00000002'}" in line, line


# -- one rule for outputs: another command's output is replaced only with --overwrite --------------
def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_output_of_something_else_is_replaced_only_with_overwrite(manifest, dense_run, tmp_path, capsys):  # noqa: F811
    """`grt data prepare` over another prepare's output (other options): refused in one line, the folder
    as it was; the same prepare again is no other output; --overwrite replaces it. `grt export` says
    it the same way (every writer, every kind of folder: test_output_folders.py)."""
    out = tmp_path / "shards"
    tokenizer = manifest.parent.parent / "tok.model"
    base = ["data", "prepare", "-i", str(REPO / "examples" / "data" / "tinyshakespeare.txt"), "-t", str(tokenizer)]
    base += ["-o", str(out), "--max-mb", "0.05", "--workers", "1", "-q"]
    assert grt_in_process([*base, "--seq-len", "64"], capsys)[0] == 0
    assert grt_in_process([*base, "--seq-len", "64"], capsys)[0] == 0  # the same command again
    before = files_of(out)
    rc, err = grt_in_process([*base, "--seq-len", "32"], capsys)
    want = f"{out} exists and holds a prepared dataset (manifest.json); pass --overwrite"
    assert rc == 2 and len(error_lines(err)) == 1 and want in err, err
    assert files_of(out) == before
    assert grt_in_process([*base, "--seq-len", "32", "--overwrite"], capsys)[0] == 0
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 32

    export = tmp_path / "export"
    export.mkdir()
    (export / "notes.txt").write_text("mine\n")
    rc, err = grt_in_process(["export", "--checkpoint", str(dense_run), "--out", str(export), "--no-hf"], capsys)
    assert rc == 2 and f"{export} exists and holds files of something else (notes.txt); pass --overwrite" in err
    assert files_of(export) == {"notes.txt": b"mine\n"}


# -- sizes checked before the engine is built ---------------------------------------------------------
def test_a_model_no_rank_can_hold_is_refused_before_the_engine(manifest, tmp_path):  # noqa: F811
    """`model.d_model=100000`: the start plan (and so `--dry-run`) refuses it in one line naming the
    parameters and the memory; before, the dry run passed and the run died allocating."""
    args = ["train", "--preset", "micro-dense", "--data", str(manifest), "--out", str(tmp_path / "run")]
    rc, err = grt_process(*args, "--steps", "2", "--set", "model.d_model=100000", "--dry-run")
    line = error_lines(err)[-1]
    assert rc == 2 and "600,058,700,000 parameters) needs" in line and "GiB per rank" in line, err[-3000:]
    assert not (tmp_path / "run").exists()


def test_what_a_rank_holds_follows_zero_and_precision():
    from pretrain.training.start.memory_fit import bytes_per_rank

    fp32, bf16 = {"bf16": {"enabled": False}}, {"bf16": {"enabled": True}}
    zero = lambda stage, **kw: {"zero_optimization": {"stage": stage, **kw}}  # noqa: E731
    assert bytes_per_rank(1000, {**fp32, **zero(0)}, 4) == 16_000  # weights 4, gradients 4, Adam 8
    assert bytes_per_rank(1000, {**fp32, **zero(3)}, 2) == 8_000
    assert bytes_per_rank(1000, {**bf16, **zero(1)}, 4) == 2_000 + 2_000 + 3_000  # fp32 master + moments: 12
    assert bytes_per_rank(1000, {**bf16, **zero(2, offload_optimizer={"device": "cpu"})}, 4) == 2_000 + 500


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_broken_export_is_one_line(tmp_path, capsys, damage):
    """A `model.safetensors` cut off or not one: `grt generate` (and every command that loads a model:
    load_model) says so in one line, before (header) and at the load; before, a traceback."""
    from trained_models import small_model, write_export

    export = write_export(small_model(), tmp_path / "export", run_config={})
    weights = export / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "cut" else b"not safetensors")
    argv = ["generate", str(export), "--prompt", "To be", "--tokenizer", str(REPO / "nothing.model"), "--device", "cpu"]
    rc, err = grt_in_process(argv, capsys)
    assert rc == 2 and len(error_lines(err)) == 1, err
    assert f"{weights} is cut off or not a safetensors file" in err and "Traceback" not in err, err
