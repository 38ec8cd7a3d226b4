"""Paths are the caller's in every command (issue 41): each `grt` command run from a directory
that is not the checkout, with every path it is given relative, reads and writes where those
paths point from there, and nothing lands in the checkout.

The data and a 1-step training run are made in <tmp>/work (the data in-process, the training
in a subprocess: it starts a process group); every later command runs from <tmp>/other and names
them as ../work/..., so a path a command saved relative to its own directory (the run's
config.json, an export's run_config.json) would not be found there. The rule they follow: a
user's path is resolved against the caller's directory once, at the door (`grt train` saves its
data and its own DeepSpeed file absolute, `pretrain/runs/data_spec.py` `callers_data` and
`pretrain/runs/config_layers.py` `callers_ds_file`; `grt launch` hands its ranks absolute paths
in the resolved config). `grt compare` with relative paths is tests/infer/test_compare.py's.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from commands import data_commands, manifest_of, resume_command, train_command
from trained_models import DEMO_TEXT, grt, single_thread  # noqa: F401 - single_thread: an autouse fixture

REPO = Path(__file__).resolve().parents[2]
QUICK = ("train.warmup_steps=0", "train.eval_every=0")  # a one-step run that is not refused
# what the commands are told to write, relative to their caller: none of it may appear in the checkout
WRITTEN = ("rel-data", "rel-runs", "rel-export", "rel-analysis", "rel-bench", "rel-eval.json", "rel-eval.png")
DATA = "rel-data"  # in work/: corpus.txt -> rel-data/tok.model, rel-data/shards/manifest.json
MANIFEST = f"../work/{manifest_of(DATA)}"  # the data as the commands run from other/ name it
RUN = "rel-runs/r"  # the training run, in work/
OWN_DS = "my-ds.json"  # the caller's own DeepSpeed file (ZeRO-2: not the default's ZeRO-3), in work/


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """(work, other): two directories beside each other, neither the checkout; work holds a slice
    of the demo text and the caller's own DeepSpeed file. Checks at the end that no command wrote
    any of WRITTEN into the checkout."""
    root = tmp_path_factory.mktemp("caller").resolve()  # as os.getcwd() says it
    work, other = root / "work", root / "other"
    work.mkdir()
    other.mkdir()
    (work / "corpus.txt").write_text(DEMO_TEXT.read_text(encoding="utf-8")[:300_000], encoding="utf-8")
    shutil.copyfile(REPO / "ds_configs" / "zero2.json", work / OWN_DS)
    before = {name for name in WRITTEN if (REPO / name).exists()}
    yield work, other
    assert {name for name in WRITTEN if (REPO / name).exists()} == before, "a command wrote into the checkout"


@pytest.fixture(scope="module")
def data(dirs) -> Path:
    """`grt data tokenizer` and `grt data prepare` in-process in work/, every path relative."""
    from pretrain import cli

    work, _ = dirs
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        for argv in data_commands("corpus.txt", DATA, 512, 0.1, "--workers", "1"):
            assert cli.main(argv) == 0, argv
    return work / manifest_of(DATA)


@pytest.fixture(scope="module")
def run(dirs, data) -> Path:
    """micro-grt trained 1 step from work/ (a subprocess): relative --data, --out and --ds-config."""
    work, _ = dirs
    grt(*train_command("micro-grt", manifest_of(DATA), RUN, 1, 4, OWN_DS, QUICK), cwd=work)
    return work / RUN


def here(argv: list, capsys) -> tuple[int, str, str]:
    """`grt ARGV` in this process, in the working directory: (exit code, stdout, stderr)."""
    from pretrain import cli

    capsys.readouterr()
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as stop:
        rc = stop.code if isinstance(stop.code, int) else 2
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def same_file(cwd: Path, path: str, expected: Path) -> bool:
    """Whether `path`, read from `cwd` (absolute or relative to it), names `expected`."""
    return (cwd / path).resolve() == expected.resolve()


def test_data_commands_write_where_the_caller_said(dirs, data, monkeypatch, capsys):
    work, other = dirs
    assert (work / DATA / "tok.model").is_file() and data.is_file()
    monkeypatch.chdir(other)
    rc, out, err = here(["data", "inspect", f"../work/{DATA}/shards", "--verify"], capsys)
    assert rc == 0 and "0 bad shard" in out, (out, err)


def test_train_print_config_and_dry_run_from_another_directory(dirs, data, monkeypatch, capsys):
    """The default DeepSpeed file is found from any directory, the caller's own one by its relative
    path; the printed config (what config.json will say) names files that any directory finds."""
    from pretrain.training.engine.ds_config import resolve_ds_path

    work, other = dirs
    monkeypatch.chdir(other)
    own = train_command("micro-grt", MANIFEST, "rel-runs/dry", 1, 4, f"../work/{OWN_DS}", QUICK)
    i = own.index("--ds-config")
    default = own[:i] + own[i + 2 :]
    for argv, ds, stage in ((default, REPO / "ds_configs" / "zero3.json", 3), (own, work / OWN_DS, 2)):
        rc, printed, err = here([*argv, "--print-config"], capsys)
        assert rc == 0, err
        config = json.loads(printed)
        assert os.path.isabs(config["data"]) and same_file(other, config["data"], data), config["data"]
        assert resolve_ds_path(config["ds_config"]).resolve() == ds.resolve(), config["ds_config"]
        rc, out, err = here([*argv, "--print-ds-config"], capsys)
        assert rc == 0 and json.loads(out)["zero_optimization"]["stage"] == stage, (out, err)
        rc, out, err = here([*argv, "--dry-run"], capsys)
        assert rc == 0 and "dry run: would train" in err and out == printed, (out, err)
    assert not (other / "rel-runs").exists()  # a dry run writes nothing


def test_train_and_resume_from_another_directory(dirs, data, run):
    """The run trained from work/ with relative paths wrote under work/ and saved paths that
    resolve from anywhere: `grt train --out ../work/rel-runs/r --resume` from other/ continues it
    (its data and DeepSpeed file taken from the saved config.json)."""
    work, other = dirs
    saved = json.loads((run / "config.json").read_text())
    assert saved["data"] == str(data) and saved["ds_config"] == str(work / OWN_DS), saved
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    assert (run / "checkpoints").is_dir()
    grt(*resume_command(f"../work/{RUN}", "--steps", "2"), cwd=other)
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert not (other / "rel-runs").exists()


def test_export_eval_generate_analyze_from_another_directory(dirs, data, run, monkeypatch, capsys):
    work, other = dirs
    monkeypatch.chdir(other)
    rc, _, err = here(["export", "--checkpoint", f"../work/{RUN}", "--out", "rel-export", "--no-hf"], capsys)
    assert rc == 0, err
    assert (other / "rel-export" / "config.json").is_file() and (other / "rel-export" / "tokenizer.model").is_file()
    # the held-out split from the run's saved data (no --data): found from here
    eval_argv = ["eval", "rel-export", "--tasks", "val", "--max-batches", "1", "--batch-size", "4", "--quiet"]
    rc, _, err = here([*eval_argv, "--json-out", "rel-eval.json", "--plot", "rel-eval.png"], capsys)
    assert rc == 0, err
    results = json.loads((other / "rel-eval.json").read_text())
    assert results["val"] and all(v["tokens"] > 0 for v in results["val"].values()), results
    assert (other / "rel-eval.png").read_bytes()[:4] == b"\x89PNG"
    # the run directory itself, and a tokenizer named relative
    gen = ["generate", f"../work/{RUN}", "--prompt", "To be", "--max-new-tokens", "3", "--greedy", "--json"]
    rc, out, err = here([*gen, "--tokenizer", f"../work/{DATA}/tok.model"], capsys)
    assert rc == 0, err
    assert json.loads(out)["samples"][0].startswith("To be")  # stdout is the JSON alone
    analyze = ["analyze", "rel-export", "--data", MANIFEST, "--out", "rel-analysis", "--batch-size", "4"]
    rc, _, err = here([*analyze, "--max-batches", "1", "--freq-batches", "2", "--cka-tokens", "64"], capsys)
    assert rc == 0, err
    assert (other / "rel-analysis" / "report.md").is_file() and (other / "rel-analysis" / "analysis.json").is_file()


def test_bench_data_from_another_directory(dirs, data, monkeypatch, capsys):
    work, other = dirs
    monkeypatch.chdir(other)
    argv = ["bench", "data", "--input", "../work/corpus.txt", "--tokenizer", f"../work/{DATA}/tok.model"]
    argv += ["--out", "rel-bench", "--max-mb", "0.05", "--seq-len", "64", "--shard-size-mb", "0.02"]
    rc, out, err = here([*argv, "--workers", "1", "--loader-seconds", "0.1", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["loader_tokens_per_s"] > 0
    assert (other / "rel-bench" / "shards" / "manifest.json").is_file()


def launched(out: str) -> tuple[dict[str, str], list[str]]:
    """A `grt launch --dry-run` text: its files (path -> content) and its command line's words."""
    files: dict[str, str] = {}
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#### file: "):
            end = lines.index("#### end of file", i)
            files[line.removeprefix("#### file: ")] = "\n".join(lines[i + 1 : end])
    return files, shlex.split(lines[lines.index("#### command") + 1])


def srun_words(script: str) -> list[str]:
    """The ranks' command line of a Slurm script (its srun line)."""
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    return shlex.split(line.removesuffix(" &"))


def test_launch_dry_run_hands_the_ranks_paths_that_resolve(dirs, data, run, monkeypatch, capsys):
    """`grt launch --dry-run` from other/: the files it would write lie under the caller's run
    directory and name the data, the DeepSpeed file and the run directory absolute; without
    --no-resolve's config file the ranks get the relative arguments, and start in the caller's
    directory (Slurm: --chdir), where they resolve."""
    work, other = dirs
    monkeypatch.chdir(other)
    train = train_command("micro-grt", MANIFEST, "rel-runs/launched", 1, 4, f"../work/{OWN_DS}", QUICK)[1:]
    for launcher in (["--launcher", "local"], ["--launcher", "slurm"]):
        rc, out, err = here(["launch", *launcher, "--cpu", "--dry-run", "--", *train], capsys)
        assert rc == 0, err
        files, command = launched(out)
        config_path = str(other / "rel-runs" / "launched" / "launch" / "config.json")
        config = json.loads(files[config_path])
        assert config["data"] == str(data) and config["ds_config"] == str(work / OWN_DS), config
        assert config["out"] == str(other / "rel-runs" / "launched"), config["out"]
        ranks = command if launcher[1] == "local" else srun_words(files[command[-1]])
        assert ranks[ranks.index("--config-json") + 1] == config_path, ranks
        if launcher[1] == "slurm":
            assert command[-1] == str(other / "rel-runs" / "launched" / "launch" / "slurm.sbatch")
            assert f"#SBATCH --chdir={other}" in files[command[-1]]
    # a resume from the run directory alone: the saved paths, absolute
    rc, out, err = here(
        ["launch", "--cpu", "--dry-run", "--", *resume_command(f"../work/{RUN}", "--steps", "3")[1:]], capsys
    )
    assert rc == 0, err
    files, command = launched(out)
    config = json.loads(files[str(run / "launch" / "config.json")])
    assert config["data"] == str(data) and config["out"] == str(run) and command[-1] == "--resume"
    # --no-resolve: the arguments as given, to ranks started in this directory
    rc, out, err = here(["launch", "--launcher", "slurm", "--cpu", "--no-resolve", "--dry-run", "--", *train], capsys)
    assert rc == 0, err
    files, command = launched(out)
    script = files[command[-1]]
    assert f"#SBATCH --chdir={other}" in script and shlex.join(train) in script
    assert not (other / "rel-runs").exists() and not (run / "launch").exists()  # a dry run writes nothing
