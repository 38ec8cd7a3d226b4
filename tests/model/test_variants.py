"""One home per variant: a variant registered from this file alone (a Variant subclass, the
model class it names, a preset) is listed by `grt presets`, counted by the FLOP formula and
the activation-memory estimate, and trains with its recipe; and every preset trains the same
way under `grt train --preset` as under `grt compare`."""

import json

import pytest
import torch
from test_checkpointing import ActivationPeak
from torch.utils.flop_counter import FlopCounterMode

from grt_common.errors import ConfigError
from pretrain import presets
from pretrain.model import GPT, LoopStep, build_model
from pretrain.model.flops import flops_per_token, train_flops_per_token
from pretrain.model.gpt import MODEL_CLASSES
from pretrain.model.layers import Linear
from pretrain.model_config import ModelConfig
from pretrain.runs.run_config import RunConfig
from pretrain.runs.train_config import CHECKPOINT_MODES
from pretrain.tools.compare import cli as compare
from pretrain.train import build_parser, config_from_args
from pretrain.training.engine.parallelize import activation_bytes, apply_activation_checkpointing
from pretrain.variants import REGISTRY, get_variant
from pretrain.variants.grt import GRT

RECIPE_KEYS = ("depth_sampling", "max_train_depth", "poisson_mean", "poisson_sigma")


class MixedStep(LoopStep):
    """A GRT loop step followed by a d x d mixer of its new state: a term no built-in variant has."""

    def __init__(self, cfg: ModelConfig, out_std: float):
        super().__init__(cfg, out_std)
        self.mixer = Linear(cfg.d_model, cfg.d_model, bias=False, std=out_std)

    def forward(self, s, e, ctx, gate_override=None, terms=None):
        s, g = super().forward(s, e, ctx, gate_override, terms)
        return s + self.mixer(s.to(self.mixer.weight.dtype)).to(s.dtype), g


class MixedGPT(GPT):
    def build_loop(self, cfg: ModelConfig, out_std: float) -> LoopStep:
        return MixedStep(cfg, out_std)


class Mixed(GRT):
    name = "mixed"
    label = "GRT + mixer"
    extra = {"mixer": 1.0}

    def train_recipe(self, cfg):
        return {"depth_sampling": "loguniform", "max_train_depth": 2 * cfg.max_loops}

    def step_extra_flops(self, cfg):
        return super().step_extra_flops(cfg) + 2 * cfg.d_model**2

    def block_extra_bytes(self, cfg, dtype_bytes):
        return 0, 0


@pytest.fixture
def mixed(monkeypatch):
    """The throwaway variant, its model class and its preset, registered for one test (what
    `@register` on Mixed and `@builds("mixed")` on MixedGPT do for good)."""
    monkeypatch.setitem(REGISTRY, "mixed", Mixed())
    monkeypatch.setitem(MODEL_CLASSES, "mixed", MixedGPT)
    cfg = ModelConfig(
        name="micro-mixed", variant="mixed", layout="1+1x3+1", d_model=32, n_heads=2, vocab_size=512, max_seq_len=64
    )
    monkeypatch.setitem(presets.PRESETS, "micro-mixed", cfg)
    return cfg


def test_a_registered_variant_is_listed_counted_and_estimated(mixed, capsys):
    presets.main(["--json"])
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "micro-mixed")
    assert row["variant"] == "mixed" and row["train"] == {"depth_sampling": "loguniform", "max_train_depth": 6}
    model = build_model(mixed.replace(attention="naive")).eval()
    assert type(model) is MixedGPT and row["params"] == sum(p.numel() for p in model.parameters())
    assert row["flops_per_token"] == flops_per_token(mixed)

    idx = torch.randint(0, mixed.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    for depth in (0, 1, 3):  # the formula, with the mixer's 2 d^2 per step, is what torch counts
        with FlopCounterMode(display=False) as counter:
            model(idx, n_loops=depth)
        assert counter.get_total_flops() == flops_per_token(mixed, 32, depth, executed=True) * idx.numel()
    assert train_flops_per_token(mixed, 32, 3) == 3 * flops_per_token(mixed, 32, 3)

    idx = torch.randint(0, mixed.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    for mode in CHECKPOINT_MODES:
        torch.manual_seed(0)
        model = apply_activation_checkpointing(build_model(mixed).train(), mode)
        with ActivationPeak() as meter:
            model(idx, idx, n_loops=3, return_logits=False).loss.backward()
        estimate = activation_bytes(mixed, idx.numel(), 3, mode, 4)
        assert meter.peak() / 1.5 <= estimate <= 1.5 * meter.peak(), (mode, meter.peak(), estimate)


def test_a_registered_variant_checks_its_settings_and_trains_with_its_recipe(mixed, shards):
    with pytest.raises(ConfigError, match="extra key.*mixre.*accepted keys: mixer"):
        mixed.replace(extra={"mixre": 2.0})
    with pytest.raises(ConfigError, match="needs a looped layout"):
        mixed.replace(layout="4")
    with pytest.raises(ConfigError, match="build_model"):  # the GRT's class refuses the variant's config
        GPT(mixed)
    cfg = config_from_args(build_parser().parse_args(["--preset", "micro-mixed", "--data", str(shards)]))
    assert (cfg.train.depth_sampling, cfg.train.max_train_depth) == ("loguniform", 6)


def _trained_by_grt_train(preset: str, manifest, *overrides: str) -> RunConfig:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return config_from_args(build_parser().parse_args(["--preset", preset, "--data", str(manifest), *sets]))


def _trained_by_compare(preset: str, manifest, tmp_path, *args: str) -> list[RunConfig]:
    parsed = compare.build_parser().parse_args(
        ["--configs", preset, "--data", str(manifest), "--out", str(tmp_path), "--tokens", "1e4", *args]
    )
    return [run["cfg"] for run in compare.build_runs(parsed, parsed.tokens)]


@pytest.mark.parametrize("preset", sorted(presets.PRESETS))
def test_grt_train_and_grt_compare_train_a_preset_with_the_same_recipe(preset, shards, tmp_path):
    recipe = get_variant(presets.PRESETS[preset].variant).train_recipe(presets.PRESETS[preset])
    [compared] = _trained_by_compare(preset, shards, tmp_path)
    trained = _trained_by_grt_train(preset, shards)
    assert {k: getattr(trained.train, k) for k in recipe} == recipe
    assert [getattr(trained.train, k) for k in RECIPE_KEYS] == [getattr(compared.train, k) for k in RECIPE_KEYS]


def test_the_recipe_follows_the_model_as_overridden_and_the_users_settings_win(shards, tmp_path):
    """Huginn's Poisson mean follows its R: the layout compare's FLOP matching gives, or --set
    model.layout; --set train.* is applied over the recipe, in both commands."""
    deep = tmp_path / "deep.json"  # a reference twice as deep: matching its FLOPs doubles Huginn's R
    deep.write_text(
        json.dumps({"label": "deep", "model": presets.PRESETS["tiny-grt"].replace(layout="1+2x8+1").to_dict()})
    )
    tiny_grt, huginn = _trained_by_compare(f"{deep},tiny-huginn", shards, tmp_path, "--match", "flops")
    assert huginn.model.max_loops > 4
    trained = _trained_by_grt_train("tiny-huginn", shards, f"model.layout={huginn.model.layout}")
    assert trained.train.poisson_mean == huginn.train.poisson_mean == max(0.5, (huginn.model.max_loops - 1) / 2)
    assert tiny_grt.train.depth_sampling == "uniform"
    [compared] = _trained_by_compare("tiny-huginn", shards, tmp_path, "--set", "train.depth_sampling=uniform")
    trained = _trained_by_grt_train("tiny-huginn", shards, "train.depth_sampling=uniform")
    assert compared.train.depth_sampling == trained.train.depth_sampling == "uniform"


def test_a_json_run_config_naming_a_preset_takes_its_recipe_under_its_own_keys():
    cfg = RunConfig.from_dict({"model": "tiny-huginn", "train": {"poisson_sigma": 0.25}, "data": "m.json"})
    assert (cfg.train.depth_sampling, cfg.train.poisson_mean, cfg.train.poisson_sigma) == ("poisson", 1.5, 0.25)
    saved = RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))  # a saved config reads back as it was
    assert saved.train == cfg.train
