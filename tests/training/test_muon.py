"""train.optimizer=muon (pretrain/training/engine/muon.py, ds_config.py, engine/build.py): which parameters Muon
updates, the DeepSpeed config it merges to and its refusals, the engine's step against a
single-process reference under ZeRO-1/2/3 on 1 and 2 ranks, and an exact resume (Muon's momentum
saved), on the same and on another number of ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multiproc import REPO, run_ranks
from train_jobs import build_data, per_step, run_job, train_args

from grt_common.errors import ConfigError
from pretrain.model import build_model
from pretrain.presets import get_preset
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import TrainConfig
from pretrain.training.engine.ds_config import build_ds_config, load_ds_json
from pretrain.training.engine.muon import muon_names

MUON = ("train.optimizer=muon", "train.grad_clip=0")


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = build_model(get_preset("micro-grt"))
    chosen = muon_names(model)
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
    # the blocks' matrices, the loop's projections and the gate MLP
    assert {
        "prelude.0.attn.c_attn.weight",
        "loop.core.0.mlp.c_fc.weight",
        "loop.proj_state.weight",
        "loop.anchor.proj.weight",
        "loop.anchor.gate_fc.weight",
        "loop.gate_fc_state.weight",
        "loop.gate_out.weight",
        "coda.0.mlp.c_proj.weight",
    } <= chosen
    # embeddings (the head is tied to wte), norms, biases: AdamW
    assert not chosen & {"wte.weight", "wpe.weight", "ln_f.weight", "loop.gate_out.bias", "exit_norm.weight"}
    assert chosen == matrices - {"wte.weight", "wpe.weight"}


def test_a_scalar_read_out_stays_on_adamw():
    model = build_model(get_preset("micro-mor"))
    routers = {n for n, p in model.named_parameters() if n.startswith("routers.") and p.dim() == 2}
    assert routers and not routers & muon_names(model)  # (1 x d): nothing to orthogonalise


def merged(train: TrainConfig, stage: int = 2, base: dict | None = None) -> dict:
    return build_ds_config(base or load_ds_json(f"ds_configs/zero{stage}.json"), train, 1, use_cuda=False)


def test_the_merged_config_names_deepspeeds_muon_with_the_run_configs_rates():
    train = TrainConfig(optimizer="muon", grad_clip=0.0, lr=1e-3, muon_lr=0.03, muon_momentum=0.9)
    opt = merged(train)["optimizer"]
    assert opt["type"] == "Muon"
    p = opt["params"]
    assert (p["muon_lr"], p["adam_lr"], p["lr"], p["momentum"]) == (0.03, 1e-3, 1e-3, 0.9)
    assert p["betas"] == list(train.betas) and p["torch_adam"] is True
    assert merged(TrainConfig())["optimizer"]["type"] == "AdamW"  # the default stays
    zero3 = merged(train, 3)
    assert zero3["zero_optimization"]["reduce_scatter"] is False  # DeepSpeed's Muon under ZeRO-3 needs it off


@pytest.mark.parametrize(
    "train,base,words",
    [
        (TrainConfig(optimizer="muon"), None, "set train.grad_clip=0"),
        (
            TrainConfig(optimizer="muon", grad_clip=0.0),
            {"optimizer": {"type": "AdamW"}},
            'optimizer.type="AdamW" disagrees with the run config (train.optimizer (muon) = "Muon")',
        ),
        (
            TrainConfig(),
            {"optimizer": {"type": "Muon"}},
            'optimizer.type="Muon" disagrees with the run config',
        ),
        (
            TrainConfig(optimizer="muon", grad_clip=0.0),
            {"optimizer": {"params": {"muon_lr": 0.5}}},
            "optimizer.params.muon_lr=0.5 disagrees with the run config (train.muon_lr = 0.02)",
        ),
        (
            TrainConfig(optimizer="muon", grad_clip=0.0),
            {"zero_optimization": {"stage": 3, "reduce_scatter": True}},
            "Muon under ZeRO-3 cannot reduce-scatter",
        ),
    ],
)
def test_a_combination_deepspeeds_muon_cannot_do_is_refused_in_one_line(train, base, words):
    with pytest.raises(ConfigError) as err:
        merged(train, base=base)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("optimizer", "sgd", "train.optimizer='sgd': accepted values are adamw, muon"),
        ("muon_lr", 0.0, "train.muon_lr=0.0: must be > 0"),
        ("muon_momentum", 1.0, "train.muon_momentum=1.0: must be in [0, 1)"),
    ],
)
def test_bad_muon_settings_are_refused(key, value, words):
    cfg = RunConfig(data="d", out="o")
    setattr(cfg.train, key, value)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_muon_steps_equal_a_single_process_reference_under_zero_1_2_3(tmp_path, world):
    report_path = tmp_path / "report.json"
    results = run_ranks(
        [str(REPO / "tests" / "dist_scripts" / "muon_step_check.py"), "1,2,3", str(report_path)],
        world=world,
        timeout=600,
    )
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    for stage, report in json.loads(report_path.read_text()).items():
        assert report["lrs"][-1][0] > 4 * report["lrs"][-1][1] > 0, report["lrs"]  # muon_lr 0.05 vs lr 1e-2
        assert report["steps"][-1]["moved"] > 1e-3, (stage, report["steps"])  # every parameter was stepped
        for step in report["steps"]:
            assert step["max_abs_diff"] <= 1e-5, (stage, step)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_data(tmp_path_factory.mktemp("muon_data"))


STEPS = 12
NO_NOISE = ("model.state_noise_std=0", "model.gate_noise_std=0", f"train.schedule_steps={STEPS}")


def train(data: Path, out: Path, world: int, steps: int, ds: str, resume: bool = False) -> str:
    batch = () if resume else (f"train.grad_accum={2 // world}",)
    args = train_args(data, out, steps, *MUON, *NO_NOISE, *batch, resume=resume, ds_config=ds)
    rcs, job = run_job(args, out.parent / f"logs-{out.name}", world=world, timeout=300)
    assert rcs == [0] * world, job.output()
    return job.output(0)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[int, tuple[float, int]]:
    """The uninterrupted 2-rank ZeRO-3 Muon run."""
    out = tmp_path_factory.mktemp("muon_ref") / "run"
    log = train(data, out, 2, STEPS, "ds_configs/zero3.json")
    assert json.loads((out / "ds_config.json").read_text())["optimizer"]["type"] == "Muon", log
    return per_step(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,worlds", [("zero1", (2, 2, 1)), ("zero3", (1, 2, 2))], ids=["zero1-2-2-1", "zero3-1-2-2"]
)
def test_a_muon_run_resumes_exactly_on_any_world_size(data, reference, tmp_path, capsys, stage, worlds):
    """Trained to step 4, resumed to 8, then to 12, on the numbers of ranks `worlds`: every step's
    loss and samples are the uninterrupted 2-rank run's (Muon's momentum and AdamW's moments
    restored; ZeRO-1 computes the same steps as ZeRO-3, to fp32 round-off). A resume on the same
    ranks loads DeepSpeed's own files; on another, a universal checkpoint, which carries Muon's
    momentum (checkpoint/muon_universal.py; measured: equal losses, and with the momentum zeroed
    instead 4e-3 apart by step 10): ZeRO-1/2 keeps whole matrices' momenta (2 -> 1 here), ZeRO-3
    partitions (1 -> 2). A resume that changes the optimizer is refused before any engine."""
    from commands import grt_in_process

    out, ds = tmp_path / "run", f"ds_configs/{stage}.json"
    train(data, out, worlds[0], 4, ds)
    args = train_args(data, out, STEPS, "train.optimizer=adamw", *NO_NOISE, resume=True, ds_config=ds)
    rc, err = grt_in_process([*args, "--dry-run"], capsys)
    assert rc == 2 and "train.optimizer 'muon' -> 'adamw'" in err and "would change the schedule or optimizer" in err, (
        err
    )
    for before, after, (stop, steps) in zip(worlds, worlds[1:], [(4, 8), (8, STEPS)]):
        log = train(data, out, after, steps, ds, resume=True)
        universal = out / "checkpoints" / f"step{stop:08d}" / "universal"
        assert (f"on {after} rank(s) instead of {before}" in log) == (before != after) == universal.exists(), log
        if before != after:
            zero = universal / "zero"
    assert (zero / "loop.core.0.mlp.c_fc.weight" / "momentum_buffer.pt").is_file(), sorted(zero.iterdir())
    got = per_step(out)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    assert [got[s][1] for s in reference] == [reference[s][1] for s in reference], "a step read other samples"
    worst = max(abs(got[s][0] - reference[s][0]) for s in reference)
    assert worst < 2e-5, {s: (got[s][0], reference[s][0]) for s in reference}
