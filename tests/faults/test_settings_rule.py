"""One rule for settings (issue #40 class 1; pretrain/runs/settings_rules.py): a setting that cannot
take effect, two settings deciding the same thing, an explicit value the start would replace, and a
number larger than a run can hold are each refused in one line naming the setting, its value and
the way out; a default that does not fit is said in one line.

Every case runs in this process: the config's rules through `config_from_args` (no data read), the
start's through `grt train --dry-run` on the session's tiny manifest (no process group, no training).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from commands import error_lines
from commands import grt_in_process as grt
from trained_models import manifest, single_thread  # noqa: F401 (fixtures)

TRIED: Counter = Counter()  # per case class, for docs/reliability.md (printed with -s)
HANDLED: Counter = Counter()


def config_error(*argv: str, data: str = "m.json") -> str:
    """The ConfigError `config_from_args` raises for `grt train ARGV` (no data is read)."""
    from grt_common.errors import ConfigError
    from pretrain.train import build_parser, config_from_args

    args = build_parser().parse_args(["--preset", "micro-grt", "--data", data, "--out", "unused", *argv])
    with pytest.raises(ConfigError) as err:
        config_from_args(args)
    return str(err.value)


def dry_run(data: Path | str, out: Path, capsys, *argv: str) -> tuple[int, list[str]]:
    rc, err = grt(["train", "--preset", "micro-grt", "--data", data, "--out", out, *argv, "--dry-run"], capsys)
    return rc, error_lines(err)


def refused(kind: str, message: str, *wants: str) -> None:
    TRIED[kind] += 1
    assert "\n" not in message, message
    for want in wants:
        assert want in message, message
    HANDLED[kind] += 1


def refused_at_start(kind: str, rc: int, err: list[str], out: Path, *wants: str) -> None:
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("grt train: error: "), err
    refused(kind, err[0], *wants)
    assert not out.exists(), "a refused start wrote into --out"


# -- the config's rules (RunConfig.validate) ------------------------------------------------------
CONFIG_CASES = [
    # two settings deciding the run's length
    ("same thing", ["--steps", "50", "--set", "train.tokens=512"], ["train.steps=50", "train.tokens=512", "give one"]),
    # a setting whose schedule or switch is off
    ("no effect", ["--set", "train.decay_tokens=1e6"], ["train.decay_tokens=1e+06", "train.schedule=wsd"]),
    ("no effect", ["--set", "train.decay_shape=sqrt"], ["train.decay_shape='sqrt'", "train.schedule=wsd"]),
    ("no effect", ["--set", "train.wandb_project=proj"], ["train.wandb_project='proj'", "train.wandb=true"]),
    ("no effect", ["--set", "train.wandb_entity=team"], ["train.wandb_entity='team'", "train.wandb=true"]),
    ("no effect", ["--set", "train.profile_ranks=3"], ["train.profile_ranks='3'", "train.profile="]),
    ("no effect", ["--set", "train.eval_tasks_limit=5"], ["train.eval_tasks_limit=5", "train.eval_tasks_every > 0"]),
    ("no effect", ["--set", "train.eval_tasks=hellaswag"], ["train.eval_tasks=", "train.eval_tasks_every > 0"]),
    (
        "no effect",
        ["--set", "train.loss_spike_action=skip", "--set", "train.loss_spike_threshold=0"],
        ["train.loss_spike_action='skip'"],
    ),
    ("no effect", ["--set", "train.muon_lr=0.05"], ["train.muon_lr=0.05", "train.optimizer=muon"]),
    ("no effect", ["--set", "train.muon_momentum=0.9"], ["train.muon_momentum=0.9", "train.optimizer=muon"]),
    ("no effect", ["--set", "train.muon_weight_decay=0.1"], ["train.muon_weight_decay=0.1", "train.optimizer=muon"]),
    # numbers larger than a run can hold
    ("too large", ["--set", "train.tokens=1e300"], ["train.tokens=1e+300", "at most"]),
    ("too large", ["--set", "train.decay_tokens=1e300", "--set", "train.schedule=wsd"], ["train.decay_tokens="]),
    ("too large", ["--steps", str(2**41)], [f"train.steps={2**41:.6g}", "at most"]),
    ("too large", ["--set", f"train.warmup_steps={2**41}"], [f"train.warmup_steps={2**41:.6g}", "at most"]),
    ("too large", ["--set", "train.dist_timeout_s=1e300"], ["train.dist_timeout_s=1e+300", "at most"]),
    ("too large", ["--micro-batch-size", str(2**30)], ["train.micro_batch_size=", "at most"]),
]


@pytest.mark.parametrize("kind,argv,wants", CONFIG_CASES, ids=[" ".join(c[1]) for c in CONFIG_CASES])
def test_a_setting_that_cannot_take_effect_is_refused_in_one_line(kind, argv, wants):
    refused(kind, config_error(*argv), *wants)


def test_a_stage_naming_a_source_twice_is_refused():
    message = config_error("--set", "train.data_stages=1e3:a=1,a=0.5", data="a=1:x/manifest.json,b=1:y/manifest.json")
    refused("same thing", message, "train.data_stages", "'a' is given twice")


def test_settings_that_take_effect_stay_accepted():
    """Each switch with its feature on, and a saved config's values (not given: defaults); each
    value kept as given (a setting dropped to make the rule pass would pass `validate`)."""
    from pretrain.runs.run_config import RunConfig
    from pretrain.train import build_parser, config_from_args

    base = ["--preset", "micro-grt", "--data", "m.json", "--out", "unused"]
    for argv, kept in (
        (["--set", "train.tokens=512"], {"tokens": 512}),
        (["--steps", "50", "--set", "train.tokens=0"], {"steps": 50, "tokens": 0}),
        (
            ["--set", "train.schedule=wsd", "--set", "train.decay_tokens=1e6", "--set", "train.decay_shape=sqrt"],
            {"schedule": "wsd", "decay_tokens": 1e6, "decay_shape": "sqrt"},
        ),
        (["--set", "train.wandb=true", "--set", "train.wandb_project=proj"], {"wandb": True, "wandb_project": "proj"}),
        (
            ["--set", "train.profile=1,1,1", "--set", "train.profile_ranks=0"],
            {"profile": "1,1,1", "profile_ranks": "0"},
        ),
        (
            ["--set", "train.eval_tasks_every=10", "--set", "train.eval_tasks_limit=5"],
            {"eval_tasks_every": 10, "eval_tasks_limit": 5},
        ),
        (
            ["--set", "train.optimizer=muon", "--set", "train.muon_lr=0.05", "--set", "train.muon_weight_decay=0.1"],
            {"optimizer": "muon", "muon_lr": 0.05, "muon_weight_decay": 0.1, "grad_clip": 0.0},
        ),
        (["--set", "train.optimizer=muon", "--set", "train.grad_clip=0.5"], {"optimizer": "muon", "grad_clip": 0.5}),
        (["--steps", str(2**40)], {"steps": 2**40}),
    ):
        train = config_from_args(build_parser().parse_args([*base, *argv])).train
        assert {key: getattr(train, key) for key in kept} == kept, argv
    saved = RunConfig()
    saved.data, saved.train.wandb_project = "m.json", "proj"  # a loaded config: nothing given
    saved.validate()
    assert saved.train.wandb_project == "proj" and not saved.train.wandb


# -- the start's rules (plan_start: the world and the tokens per step known) ----------------------
def test_an_explicit_warmup_the_schedule_would_cut_is_refused(manifest, tmp_path, capsys):
    out = tmp_path / "run"
    rc, err = dry_run(manifest, out, capsys, "--steps", "300", "--set", "train.warmup_steps=2000")
    refused_at_start("replaced", rc, err, out, "train.warmup_steps=2000", "300 steps", "never decay")
    rc, err = dry_run(manifest, out, capsys, "--steps", "2", "--set", "train.warmup_steps=2")  # the whole run: kept
    said = [line for line in err if not line.startswith("grt train: dry run: ")]  # its line names the out path
    assert rc == 0 and not [line for line in said if "warmup" in line], err


def test_a_default_warmup_longer_than_the_run_is_said(manifest, tmp_path, capsys):
    """The issue's `--preset tiny-grt --steps 300`: the default warmup (2000) is kept, and said in one
    line with the way out (a refusal would stop every short run that leaves the warmup at its default)."""
    rc, err = dry_run(manifest, tmp_path / "run", capsys, "--steps", "300")
    assert rc == 0, err
    said = [line for line in err if "train.warmup_steps=2000 (the default)" in line]
    assert len(said) == 1 and "never decays" in said[0] and "--set train.warmup_steps=" in said[0], err
    TRIED["default said"] += 1
    HANDLED["default said"] += 1


def test_muon_alone_takes_its_own_clip_and_says_so(manifest, tmp_path, capsys):
    """train.optimizer=muon alone is not refused for the default gradient clip it never set: the switch
    takes train.grad_clip=0 and the start says so; a clip given beside Muon is still refused."""
    rc, err = dry_run(manifest, tmp_path / "run", capsys, "--steps", "2", "--set", "train.optimizer=muon")
    assert rc == 0, err
    assert len([line for line in err if "train.grad_clip: 0 under train.optimizer=muon" in line]) == 1, err
    rc, err = dry_run(
        manifest,
        tmp_path / "run2",
        capsys,
        "--steps",
        "2",
        "--set",
        "train.optimizer=muon",
        "--set",
        "train.grad_clip=1.0",
    )
    assert rc != 0 and any("train.grad_clip=1.0" in line and "set train.grad_clip=0" in line for line in err), err


START_CASES = [
    (
        "no effect",
        ["--steps", "40", "--set", "train.schedule=wsd", "--set", "train.decay_tokens=1e9"],
        ["train.decay_tokens=1e+09", "never lets the learning rate reach train.lr", "give at most"],
    ),
    ("no effect", ["--steps", "3", "--set", "train.profile=2,1,2"], ["train.profile='2,1,2'", "runs 3 step(s)"]),
    (
        "no effect",
        ["--steps", "3", "--set", "train.profile=0,0,1", "--set", "train.profile_ranks=3"],
        ["train.profile_ranks='3'", "rank 3 is not in this run of 1 rank(s)"],
    ),
    ("too large", ["--set", "train.tokens=1e18"], ["train.tokens=1e+18", "more than the", "steps a run can hold"]),
]


@pytest.mark.parametrize("kind,argv,wants", START_CASES, ids=[" ".join(c[1]) for c in START_CASES])
def test_a_setting_that_does_not_fit_the_run_is_refused_at_the_start(manifest, tmp_path, capsys, kind, argv, wants):
    out = tmp_path / "run"
    rc, err = dry_run(manifest, out, capsys, "--micro-batch-size", "2", *argv)
    refused_at_start(kind, rc, err, out, *wants)


def test_a_mixture_stage_past_the_run_is_refused(manifest, tmp_path, capsys):
    out = tmp_path / "run"
    mixture = f"a=1:{manifest},b=1:{manifest}"
    argv = ["--micro-batch-size", "2", "--set", "train.tokens=512", "--set", "train.data_stages=1e9:a=0,b=1"]
    rc, err = dry_run(mixture, out, capsys, *argv)
    refused_at_start("no effect", rc, err, out, "train.data_stages", "1e+09 tokens", "never applies")


def test_eval_refuses_a_flag_given_twice(capsys):
    rc, err = grt(["eval", "exported/none", "--data", "a/manifest.json", "--data", "b/manifest.json"], capsys)
    assert rc == 2 and len(error_lines(err)) == 1, err
    refused("same thing", error_lines(err)[0], "--data", "given twice", "a/manifest.json", "b/manifest.json")


def test_zz_counts():
    """The counts of this class for docs/reliability.md (run with -s to see them)."""
    print(f"\nsettings rule: tried {dict(TRIED)}, handled {dict(HANDLED)}")
    assert TRIED == HANDLED
