"""One rule for outputs (issue 58 part 3; docs/reliability.md "What the project trusts and what it
refuses"): every command that writes a folder (`grt data prepare` and `chains`, `grt export`,
`grt analyze`, `grt compare`, `grt demo`, `grt train`) refuses an existing folder that holds something else
(a prepared dataset, an export, other files; through a symbolic link too) in the same words,
exit 2, one line, nothing written (`check_output_folder`, data_pipeline/prepare_output.py). What a
command may write into stays accepted: a new or empty folder, its own output, its own inputs there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import error_lines, grt_in_process, train_command
from trained_models import ENV, REPO, dense_run, manifest, small_model, write_export  # noqa: F401

TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"
WANT = {  # what each folder holds, in the refusal's words
    "dataset": "a prepared dataset (manifest.json)",
    "export": "an export (model.safetensors)",
    "files": "files of something else (notes.txt, sub)",
    "link": "a prepared dataset (manifest.json)",
}


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def folder(kind: str, tmp_path: Path, shards: Path) -> Path:
    """An existing output of something else, of `kind`."""
    out = tmp_path / kind
    if kind in ("dataset", "link"):
        shutil.copytree(shards, tmp_path / "dataset-copy")
        out.symlink_to(tmp_path / "dataset-copy") if kind == "link" else (tmp_path / "dataset-copy").rename(out)
    elif kind == "export":
        write_export(small_model(), out)
    elif kind == "files":
        (out / "sub").mkdir(parents=True)
        (out / "notes.txt").write_text("mine\n")
    else:  # a file where the folder goes
        out.write_text("mine\n")
    return out


def writers(out: Path, manifest: Path, run: Path) -> dict[str, list[str]]:  # noqa: F811
    tok = str(manifest.parent.parent / "tok.model")
    return {
        "prepare": ["data", "prepare", "-i", str(TEXT), "-t", tok, "-o", str(out), "--max-mb", "0.02", "-q"],
        "chains": ["data", "chains", "-o", str(out), "--train-samples", "20", "--val-samples", "4", "-q"],
        "export": ["export", "--checkpoint", str(run), "--out", str(out), "--no-hf"],
        "analyze": ["analyze", str(run), "--out", str(out)],
        "compare": ["compare", "--data", str(manifest), "--out", str(out), "--configs", "micro-dense", "--dry-run"],
        "demo": ["demo", "--out", str(out), "--steps", "1"],  # refused before its tokenizer and data
    }


@pytest.mark.parametrize("kind", ["dataset", "export", "files", "link", "file"])
def test_every_writer_refuses_an_output_of_something_else(kind, manifest, dense_run, tmp_path, capsys):  # noqa: F811
    """Each writer over each kind of folder: exit 2, one line naming the folder and what it holds
    (or, for a file, that it is one), the folder's files as they were."""
    out = folder(kind, tmp_path, manifest.parent)
    before = files_of(out) if out.is_dir() else out.read_bytes()
    for name, argv in writers(out, manifest, dense_run).items():
        rc, err = grt_in_process(argv, capsys)
        lines = [line for line in error_lines(err) if kind != "file" or "error" in line]  # argparse's usage aside
        assert rc == 2 and len(lines) == 1 and str(out) in lines[0], (name, rc, err[-2000:])
        if kind != "file":
            assert f"{out} exists and holds {WANT[kind]}; " in lines[0], (name, lines)
            assert ("pass --overwrite" in lines[0]) == (name not in ("compare", "demo")), (name, lines)
        assert (files_of(out) if out.is_dir() else out.read_bytes()) == before, name


def test_train_refuses_an_output_of_something_else(manifest, tmp_path):  # noqa: F811
    """`grt train --out` a prepared dataset, an export or other files: refused at the start and by
    --dry-run alike, one line, nothing written (it trained into them, exit 0); train has no
    --overwrite, since a run deletes nothing it did not write."""
    for kind in ("dataset", "export", "files"):
        out = folder(kind, tmp_path, manifest.parent)
        before = files_of(out)
        dry = ["--dry-run"] if kind != "dataset" else []  # the real start once, the dry run the others
        argv = train_command("micro-dense", manifest, out, 2, 4, "ds_configs/zero1.json", (), *dry)
        r = subprocess.run(
            [sys.executable, "-m", "pretrain.cli", *argv], cwd=REPO, env=ENV, capture_output=True, text=True
        )
        lines = error_lines(r.stderr)
        assert r.returncode == 2 and len(lines) == 1, (kind, r.returncode, r.stderr[-2000:])
        want = f"--out {out} exists and holds {WANT[kind]}; choose another output (a new or empty folder)"
        assert want in lines[0], (kind, lines)
        assert files_of(out) == before, kind

    from grt_common.errors import ConfigError
    from pretrain.presets import get_preset
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.trainer import dry_run

    someone = tmp_path / "someone"  # a file of a name the run writes is someone's outside a run
    someone.mkdir()
    (someone / "config.json").write_text('{"name": "mine"}\n')
    cfg = RunConfig(model=get_preset("micro-dense"), data=str(manifest), out=str(someone))
    with pytest.raises(ConfigError, match=r"exists and holds files of something else \(config.json\)"):
        dry_run(cfg)
    assert files_of(someone) == {"config.json": b'{"name": "mine"}\n'}

    # grt launch to other hosts (Slurm, elastic) resolves but does not plan the start here: the
    # rule holds there too, before <out>/launch/ is written
    from launcher.checks import LaunchError
    from launcher.cli import resolve_train_config

    other = folder("files", tmp_path / "launched", manifest.parent)
    before = files_of(other)
    for data in (manifest, tmp_path / "on-the-nodes" / "manifest.json"):  # readable here, or not
        argv = train_command("micro-dense", data, other, 2, 4, "ds_configs/zero1.json", ())[1:]
        with pytest.raises(LaunchError, match="exists and holds files of something else"):
            resolve_train_config(argv, 2, False, on_this_host=False)
    assert files_of(other) == before


def test_what_a_command_may_write_into_stays_accepted(manifest, tmp_path, capsys):  # noqa: F811
    """An empty folder; a run directory holding the run's own data (the demo's layout); a prepare's
    folder holding its own input and tokenizer; --overwrite over other files keeps them."""
    from pretrain.presets import get_preset
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.trainer import dry_run

    run = tmp_path / "run"
    shutil.copytree(manifest.parent, run / "data" / "shards")
    for out, data in ((tmp_path / "empty", manifest), (run, run / "data" / "shards" / "manifest.json")):
        out.mkdir(exist_ok=True)
        cfg = RunConfig(
            model=get_preset("micro-dense"), data=str(data), out=str(out), ds_config="ds_configs/zero1.json"
        )
        cfg.train.steps, cfg.train.micro_batch_size = 2, 4
        line, _ = dry_run(cfg)
        assert line.startswith("would train"), line

    own = tmp_path / "own"
    own.mkdir()
    shutil.copy(TEXT, own / "corpus.txt")
    shutil.copy(manifest.parent.parent / "tok.model", own / "tokenizer.model")
    argv = ["data", "prepare", "-i", str(own / "corpus.txt"), "-t", str(own / "tokenizer.model"), "-o", str(own)]
    assert grt_in_process([*argv, "--max-mb", "0.02", "-q"], capsys)[0] == 0
    assert (own / "manifest.json").is_file() and (own / "corpus.txt").is_file()

    other = folder("files", tmp_path, manifest.parent)
    argv = ["data", "prepare", "-i", str(TEXT), "-t", str(own / "tokenizer.model"), "-o", str(other), "-q"]
    assert grt_in_process([*argv, "--max-mb", "0.02"], capsys)[0] == 2
    assert grt_in_process([*argv, "--max-mb", "0.02", "--overwrite"], capsys)[0] == 0
    assert (other / "manifest.json").is_file() and (other / "notes.txt").read_text() == "mine\n"
