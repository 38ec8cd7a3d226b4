"""`grt compare` reuses a finished run only for the same data, by identity (issue 58 part 7, "data
trusted by name"): a dataset prepared again at the same path made a rerun tabulate runs trained on
the old one as results on the new."""

from __future__ import annotations

from pathlib import Path

from commands import error_lines, grt_in_process
from trained_models import REPO

from pretrain.tools.compare import cli as compare
from pretrain.tools.compare.runs import record_data


def test_a_finished_run_of_other_data_at_the_same_path_is_not_reused(shards, tmp_path, capsys):
    data = tmp_path / "data"
    prepare = ["data", "prepare", "-i", str(REPO / "examples" / "data" / "tinyshakespeare.txt"), "-o", str(data)]
    prepare += ["-t", str(shards.parent.parent / "tok.model"), "--val-fraction", "0.1", "--seq-len", "64", "-q"]
    prepare += ["--workers", "1"]
    assert grt_in_process([*prepare, "--max-mb", "0.1"], capsys)[0] == 0
    out = tmp_path / "cmp"
    base = ["--data", str(data / "manifest.json"), "--out", str(out), "--configs", "micro-dense", "--tokens", "5000"]
    [run] = compare.build_runs(compare.parse_args(base), 5000)
    run_dir = Path(run["cfg"].out)  # a finished run of this comparison, as its start and end leave it
    run_dir.mkdir(parents=True)
    run["cfg"].save(run_dir / "compare_run_config.json")
    record_data(run_dir, run["cfg"].data)
    (run_dir / "summary.json").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    assert grt_in_process([*prepare, "--max-mb", "0.08", "--overwrite"], capsys)[0] == 0  # prepared again there
    assert compare.main(base) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{run_dir} holds a run trained on other data than {data / 'manifest.json'}" in lines[0]
    assert "--retrain" in lines[0], lines
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
