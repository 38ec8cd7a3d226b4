"""Failures the start could have foreseen (issue 40, class 4): what the plan can know is checked
before the engine is built and before anything is written into --out, in one line (exit 2)."""

from __future__ import annotations

import os
import subprocess

import pytest
from train_jobs import REPO, cli, train_args


def test_train_wandb_without_a_login_is_refused_before_anything_starts(shards, tmp_path):
    """train.wandb=true, W&B online and no API key (no WANDB_API_KEY, no `wandb login`): one line at
    the start, and no run directory; before, the engine was built and --out made first."""
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / "wandb"), NETRC=str(home / ".netrc"))
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    args = cli(*train_args(shards, out, 2, "train.wandb=true"))
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    errors = [line for line in r.stderr.splitlines() if line.startswith("grt train: error:")]
    assert r.returncode == 2 and not out.exists(), r.stderr[-3000:]  # refused before --out is made
    assert len(errors) == 1 and "train.wandb=true: not logged in to W&B" in errors[0], r.stderr[-3000:]
    assert "WANDB_MODE=offline" in errors[0] and "Traceback" not in r.stderr


def test_export_every_without_transformers_is_refused_by_the_dry_run(shards, tmp_path, monkeypatch):
    """train.export_every needs transformers for the exports' Hugging Face copy: the run's checks
    refuse it in one line, so `--dry-run` (which makes the start's checks) does too; before, only
    the trainer refused it, after the engine was built, and the dry run passed."""
    import importlib.util

    from grt_common.errors import ConfigError
    from pretrain.presets import get_preset
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.trainer import dry_run

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else found(name, *a)
    )
    cfg = RunConfig(model=get_preset("micro-grt"), data=str(shards), out=str(tmp_path / "run"))
    cfg.train.steps, cfg.train.micro_batch_size, cfg.train.save_every, cfg.train.export_every = 4, 4, 2, 2
    with pytest.raises(ConfigError, match=r"train.export_every=2: the Hugging Face copy needs transformers: pip"):
        dry_run(cfg)
    assert not (tmp_path / "run").exists()
