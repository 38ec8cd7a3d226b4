"""train.checkpoint_mirror (pretrain/training/checkpoint/mirror.py, pretrain/runs/checkpoint_mirror.py):
a run's checkpoints uploaded to moto's S3 server (tests/moto_s3.py) while it trains, with faults. One
micro-grt run of 6 steps, a checkpoint every 2 (the last 2 kept): step 2's COMPLETE is dropped by the
server until the upload gives up (the run goes on and says so), and the run is killed while step 6's
upload retries its last file (the ZeRO optimizer partition: every other file is up, COMPLETE is not).
Then the run directory is deleted and resumed from the bucket alone: it takes step 4 (step 6's partial
upload has no COMPLETE) and trains steps 5 and 6 to the killed run's losses exactly; `grt export` and
the loader read a mirrored checkpoint by its URL."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from commands import error_lines, grt_in_process, resume_command, train_command
from moto_s3 import MotoS3, moto_s3  # noqa: F401 (a fixture)
from trained_models import ENV, REPO, manifest, single_thread  # noqa: F401 (fixtures)

STEPS, SAVE, KEEP, MICRO = 6, 2, 2, 8
BUCKET = "grt-ckpt"
URL = f"s3://{BUCKET}/run"
SECRET = "grt-test-secret-7f3a"  # the credentials' secret: in no file of the run, local or mirrored
LAST_FILE = "step00000006/zero_pp_rank_0_mp_rank_00_optim_states.pt"  # the last of the checkpoint's files by name


def _grt(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pretrain.cli", *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """moto's S3 server for the module's run, stopped at the end (a failed setup too)."""
    work = tmp_path_factory.mktemp("moto")
    s3 = MotoS3(work)
    yield s3
    s3.stop()


@pytest.fixture(scope="module")
def killed(manifest, server, tmp_path_factory):  # noqa: F811
    """The run killed during step 6's upload (module doc), with the server, its environment and what
    the run left before the kill."""
    tmp = tmp_path_factory.mktemp("mirror")
    env = {**ENV, **server.env, "AWS_SECRET_ACCESS_KEY": SECRET, "GRT_MIRROR_RETRY_S": "4"}
    env["GRT_MIRROR_CACHE"] = str(tmp / "cache")
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL_S3"],
        region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=SECRET,
    )
    client.create_bucket(Bucket=BUCKET)
    server.drop("PUT", "step00000002/COMPLETE")  # a dropped upload: retried for 4 s, then given up
    server.drop("PUT", LAST_FILE)  # the last checkpoint: the run waits for its upload at its end, and is killed
    out = tmp / "run"
    sets = [f"train.save_every={SAVE}", f"train.keep_checkpoints={KEEP}", f"train.checkpoint_mirror={URL}"]
    sets += ["train.warmup_steps=2", "train.lr=3e-3", "train.log_every=1", "train.eval_every=0", "train.schedule=wsd"]
    proc = _grt(train_command("micro-grt", manifest, out, STEPS, MICRO, "ds_configs/zero3.json", sets), env)
    deadline, mid_upload = time.monotonic() + 300, False
    while proc.poll() is None and time.monotonic() < deadline:
        if any(LAST_FILE in r[1] and r[2] == "503" for r in server.requests()):
            mid_upload = True  # step 6's other files are in the bucket, COMPLETE is not
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert mid_upload and proc.returncode == -signal.SIGKILL, (
        f"the run was not killed mid-upload ({proc.returncode}):\n{stderr[-3000:]}"
    )
    shutil.copytree(out / "checkpoints" / "step00000004", tmp / "step4-local")  # what the run itself wrote
    return {"server": server, "env": env, "out": out, "tmp": tmp, "records": records(out)}


def mirror_tags(env: dict[str, str], monkeypatch) -> tuple[list[str], list[str]]:
    from pretrain.runs.checkpoint_mirror import Mirror

    for k, v in env.items():
        if k.startswith(("AWS_", "GRT_MIRROR")):
            monkeypatch.setenv(k, v)
    return Mirror(URL).tags()


def test_a_dropped_upload_is_said_and_a_partial_one_never_taken(killed, monkeypatch):
    complete, partial = mirror_tags(killed["env"], monkeypatch)
    # 2's COMPLETE was refused: its files were pruned with the older ones once 4 was up; 6's upload was killed
    assert (complete, partial) == (["step00000004"], ["step00000006"])
    log = (killed["out"] / "train.log").read_text()
    said = [line for line in log.splitlines() if "was not mirrored" in line]
    assert len(said) == 1 and "step00000002" in said[0] and "training goes on" in said[0], said
    assert "GRT_MIRROR_RETRY_S" in said[0] and "mirrored checkpoint step00000004 to " in log
    for ended in [r["mirror"] for r in killed["records"] if "mirror" in r]:  # those that ended before the last step
        assert ("error" in ended) == (ended["step"] == 2) and ended["stall_s"] >= 0, ended
    assert all(r["step"] <= STEPS for r in killed["records"])  # training went on to its end
    assert not list((killed["out"] / "checkpoints").glob(".mirror-*/COMPLETE"))
    files = [p for p in killed["out"].rglob("*") if p.is_file() and p.suffix in (".json", ".log", ".jsonl", "")]
    assert not [p for p in files if SECRET in p.read_text(errors="replace")]


def test_a_mirrored_checkpoint_is_read_by_its_url(killed, monkeypatch, capsys, tmp_path):
    """`grt export` of a mirror URL: the weights the run wrote in its own step 4; a partial upload is
    refused in one line."""
    for k, v in killed["env"].items():
        if k.startswith(("AWS_", "GRT_MIRROR")):
            monkeypatch.setenv(k, v)
    from safetensors.torch import load_file

    from pretrain.infer.load import consolidate, load_model

    args = ["export", "--checkpoint", f"{URL}/checkpoints/step00000004", "--out", tmp_path / "e", "--no-hf"]
    rc, err = grt_in_process(args, capsys)
    assert rc == 0, err
    exported = load_file(str(tmp_path / "e" / "model.safetensors"))
    local = consolidate(killed["tmp"] / "step4-local")
    assert exported.keys() <= local.keys() and all(torch.equal(exported[k], local[k]) for k in exported)
    loaded = load_model(f"{URL}/checkpoints/step00000004", weights=False)  # grt eval's, generate's loader
    assert Path(loaded.path) == Path(killed["env"]["GRT_MIRROR_CACHE"]) / "s3" / BUCKET / "run/checkpoints/step00000004"
    branch = ["train", "--branch-from", URL, "--out", tmp_path / "branch", "--steps", "8", "--dry-run"]
    rc, err = grt_in_process(branch, capsys)  # a decay branch of the mirror's newest complete checkpoint: 4
    assert rc == 0 and "step00000004" in err and "step00000006" not in err, err
    partial = f"{URL}/checkpoints/step00000006"
    rc, err = grt_in_process(["export", "--checkpoint", partial, "--out", tmp_path / "f"], capsys)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and "no COMPLETE object" in lines[0], err


def test_a_resume_from_the_mirror_alone_continues_exactly(killed, monkeypatch):
    """The run directory deleted: --resume with the mirror fetches step 4 and its config, trains 5 and
    6 to the killed run's losses, and uploads 6 (complete now, the last 2 kept)."""
    out, env = killed["out"], killed["env"]
    Path(f"{killed['server'].log}.faults").write_text("")  # the server drops nothing now
    shutil.rmtree(out)
    proc = _grt(resume_command(out, "--set", f"train.checkpoint_mirror={URL}"), env)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "fetched checkpoint step00000004 from the mirror" in stderr, stderr[-3000:]
    before = {r["step"]: r["loss"] for r in killed["records"] if "loss" in r}
    again = {r["step"]: r["loss"] for r in records(out) if "loss" in r}
    assert sorted(again) == [5, 6] and all(again[s] == before[s] for s in again), (before, again)
    assert mirror_tags(env, monkeypatch) == (["step00000004", "step00000006"], [])


def test_a_dropped_request_is_retried_and_the_checkpoint_completed(moto_s3, tmp_path, monkeypatch):
    """Two refusals of one file's PUT: the upload retries it, COMPLETE is put last, and the fetched copy
    is the checkpoint's files byte for byte."""
    import boto3

    from pretrain.runs.checkpoint_mirror import Mirror

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    step = tmp_path / "step00000004"
    (step / "export").mkdir(parents=True)  # train.export_every's copy: not mirrored
    files = {"rank0_state.pt": b"x" * 5000, "config.json": b"{}", "export/model.safetensors": b"e", "COMPLETE": b"4\n"}
    for name, data in files.items():
        (step / name).write_bytes(data)
    moto_s3.drop("PUT", "step00000004/rank0_state.pt", 2)
    monkeypatch.setenv("GRT_MIRROR_RETRY_S", "30")
    mirror = Mirror(URL)
    assert mirror.upload(step, step.name) == 5002
    puts = [r for r in moto_s3.requests() if r[0] == "PUT"]
    assert [r[2] for r in puts if r[1].endswith("rank0_state.pt")] == ["503", "503", "200"]
    assert puts[-1][1].endswith("step00000004/COMPLETE")  # last
    assert mirror.tags() == (["step00000004"], [])
    fetched = mirror.fetch(step.name, tmp_path / "fetched")
    assert {p.name: p.read_bytes() for p in fetched.rglob("*") if p.is_file()} == {
        "rank0_state.pt": files["rank0_state.pt"],
        "config.json": b"{}",
        "COMPLETE": b"4\n",
    }


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        ([f"train.checkpoint_mirror=s3://AKIA:{SECRET}@grt-ckpt/run"], "credentials come from the environment"),
        (["train.checkpoint_mirror=/mnt/bucket/run"], "must be an s3:// or gs:// URL"),
        ([f"train.checkpoint_mirror={URL}", "train.save_every=0", "train.save_final=false"], "no checkpoint"),
    ],
)
def test_a_mirror_that_cannot_work_is_refused_in_one_line(capsys, manifest, sets, said):  # noqa: F811
    args = train_command("micro-grt", manifest, None, 2, 2, "ds_configs/zero3.json", sets)
    rc, err = grt_in_process([*args, "--dry-run"], capsys)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and said in lines[0], err
    assert SECRET not in err  # never echoed back
