"""The comparison baselines (Huginn, RRT, Ouro, MoR) and the ablation-ladder presets: each
method's defining property, ZeRO-2/3 gradients against a single-process reference
(2 ranks), and training + exact resume under ZeRO-3 through `grt train`."""

import json
import math
import shutil

import pytest
import torch
from commands import train_command
from multiproc import REPO, run_ranks

from grt_common.errors import ConfigError
from pretrain.model import GPT, build_model
from pretrain.model.baselines import RRTGPT, HuginnGPT, MoRGPT, OuroGPT, noise_off
from pretrain.model.gpt import lm_loss
from pretrain.presets import PRESETS, get_preset

pytestmark = pytest.mark.filterwarnings("ignore")
VARIANTS = ("huginn", "rrt", "ouro", "mor")


def tokens(b=2, t=24, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t + 1), generator=g)


def xy(b=2, t=24, seed=0):
    data = tokens(b, t, seed=seed)
    return data[:, :-1], data[:, 1:]


def micro(variant, **kw):
    return get_preset(f"micro-{variant}").replace(**kw)


# -- config ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,cls", [("huginn", HuginnGPT), ("rrt", RRTGPT), ("ouro", OuroGPT), ("mor", MoRGPT)])
def test_build_model_builds_each_variant_and_its_config_round_trips(tmp_path, variant, cls):
    cfg = micro(variant)
    assert type(build_model(cfg)) is cls
    with pytest.raises(ConfigError, match="build_model"):  # the GRT class refuses a baseline's config
        GPT(cfg)
    cfg.save(tmp_path / "m.json")
    assert type(cfg).load(tmp_path / "m.json") == cfg


def test_baseline_settings_are_checked():
    with pytest.raises(ConfigError, match="extra key.*lora_rnak.*accepted keys: lora_rank"):
        micro("rrt", extra={"lora_rnak": 2})
    with pytest.raises(ConfigError, match="no GRT gate"):
        micro("ouro", gate=True)
    with pytest.raises(ConfigError, match="reinject_anchor must be True"):
        micro("huginn", reinject_anchor=False)
    with pytest.raises(ConfigError, match=r"extra key\(s\) lora_rank for variant='grt'; accepted keys: backprop_steps"):
        get_preset("micro-grt").replace(extra={"lora_rank": 2})
    with pytest.raises(ConfigError, match="takes no extra settings"):
        get_preset("micro-dense").replace(extra={"backprop_steps": 2})


def test_ladder_presets_switch_one_component_at_a_time():
    keys = ("layout", "state_noise_std", "reinject_anchor", "gate")
    ladder = [
        tuple(getattr(PRESETS[n], k) for k in keys)
        for n in ("ladder-0-loop-only", "ladder-1-prelude-coda", "ladder-2-noise", "ladder-3-reinject", "ladder-4-gate")
    ]
    assert ladder == [
        ("2x5", 0.0, False, False),
        ("1+2x4+1", 0.0, False, False),
        ("1+2x4+1", 0.1, False, False),
        ("1+2x4+1", 0.1, True, False),
        ("1+2x4+1", 0.1, True, True),
    ]
    assert PRESETS["ladder-4-gate"].to_dict() | {"name": ""} == PRESETS["tiny-grt"].to_dict() | {"name": ""}


# -- Huginn --------------------------------------------------------------------------------
def test_huginn_backprop_is_truncated_to_the_last_k_steps():
    model = build_model(micro("huginn", extra={"backprop_steps": 2})).train()
    x, y = xy()
    out = model(x, y, n_loops=5, return_states=True)
    # s_0 (random) and the outputs of steps 1..3 carry no graph; steps 4 and 5 do
    assert [s.requires_grad for s in out.states] == [False, False, False, False, True, True]
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    # with k >= n every step is differentiated
    out = model(x, y, n_loops=2, return_states=True)
    assert [s.requires_grad for s in out.states] == [False, True, True]
    # evaluation runs without truncation (no graph anyway) and gives the same function
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(x, y, n_loops=5).loss)


def test_huginn_initial_state_is_random_truncated_normal_in_training_and_repeatable_in_eval():
    cfg = micro("huginn")
    model = build_model(cfg)
    e = torch.zeros(4, 64, cfg.d_model)
    std = math.sqrt(2 / (5 * cfg.d_model))
    model.train()
    a, b = model.initial_state(e), model.initial_state(e)
    assert not torch.equal(a, b) and a.abs().max() <= 3 * std + 1e-6 and 0.7 * std < a.std() < 1.0 * std
    model.eval()
    assert torch.equal(model.initial_state(e), model.initial_state(e))
    assert torch.equal(build_model(noise_off(cfg)).train().initial_state(e), torch.zeros_like(e))


def test_huginn_core_blocks_are_sandwich_normed():
    model = build_model(micro("huginn"))
    names = {n for n, _ in model.loop.named_parameters()}
    assert {"core.0.ln_attn_out.weight", "core.0.ln_mlp_out.weight"} <= names
    adapter = sum(p.numel() for n, p in model.loop.named_parameters() if not n.startswith("core."))
    assert adapter == 2 * 32 * 32  # Linear(2d -> d) on [s; e], no bias, and no gate


# -- RRT -----------------------------------------------------------------------------------
def test_rrt_adapters_start_as_the_identity_and_differ_per_step_after_training():
    torch.manual_seed(0)
    model = build_model(micro("rrt")).train()
    s = torch.randn(2, 10, 32)
    from pretrain.model.layers import AttentionContext

    ctx = AttentionContext()
    plain = s
    for block in model.loop.core:
        plain = block(plain, ctx)
    for step in range(model.max_loops):  # B = 0: every step is exactly the shared weights
        assert torch.equal(model.loop(s, s, ctx, step)[0], plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(6):
        x, y = xy(seed=i)
        loss = model(x, y, n_loops=3).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    ups = [model.loop.lora[r][0]["mlp_in"].up.weight.detach() for r in range(3)]
    assert all(u.abs().sum() > 0 for u in ups)
    assert not torch.allclose(ups[0], ups[1]) and not torch.allclose(ups[1], ups[2])
    outs = [model.loop(s, s, ctx, r)[0] for r in range(3)]
    assert not torch.allclose(outs[0], outs[1])


def test_rrt_adapters_past_the_sampled_depth_get_a_zero_gradient():
    model = build_model(micro("rrt")).train()
    for p in model.parameters():  # make B nonzero so that a real use would give A a gradient
        torch.nn.init.normal_(p, std=0.05) if p.dim() == 2 else None
    x, y = xy()
    model(x, y, n_loops=1).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if name.startswith(("loop.lora.1.", "loop.lora.2.")):
            assert torch.count_nonzero(p.grad) == 0, name
        if name.startswith("loop.lora.0."):
            assert torch.count_nonzero(p.grad) > 0, name


# -- Ouro ----------------------------------------------------------------------------------
def test_ouro_exit_distribution_sums_to_one_and_the_loss_is_its_expectation_minus_entropy():
    torch.manual_seed(0)
    model = build_model(micro("ouro", extra={"entropy_beta": 0.1})).train()
    x, y = xy()
    out = model(x, y, n_loops=3, return_states=True)
    p = model.last_aux["exit_probs"]
    assert p.shape == (3, *x.shape) and (p >= 0).all()
    assert torch.allclose(p.sum(0), torch.ones_like(p[0]), atol=1e-6)
    lam = torch.rand(4, 2, 5)
    q = OuroGPT.exit_distribution(lam)
    assert torch.allclose(q.sum(0), torch.ones(2, 5)) and torch.allclose(q[0], lam[0])
    from pretrain.model.layers import AttentionContext

    per_token = torch.stack([lm_loss(model.decode(s, AttentionContext()), y, "none") for s in out.states[1:]])
    expected = (p * per_token).sum(0).mean()
    entropy = -(p * p.log()).sum(0).mean()
    assert out.loss.item() == pytest.approx((expected - 0.1 * entropy).item(), rel=1e-5)
    assert model.last_aux["step_losses"].shape == (3,)
    out.loss.backward()
    assert model.exit_gate.weight.grad.abs().sum() > 0


def test_ouro_learned_exit_picks_the_step_where_the_cdf_passes_the_threshold():
    torch.manual_seed(0)
    model = build_model(micro("ouro")).eval()
    x, y = xy()
    with torch.no_grad():
        out = model(x, y, n_loops=3, exit="learned")
        steps = model.last_aux["exit_step"]
        cdf = model.last_aux["exit_probs"].cumsum(0)
        fixed = [model(x, y, n_loops=r).logits for r in (1, 2, 3)]
    assert steps.min() >= 1 and steps.max() <= 3
    first = (cdf >= 0.5 - 1e-6).float().argmax(0) + 1
    assert torch.equal(steps, first)
    for r in (1, 2, 3):  # a token's logits are those of a fixed exit at its step
        mask = steps == r
        assert torch.allclose(out.logits[mask], fixed[r - 1][mask], atol=1e-5)
    # threshold 1: everyone runs every step
    model.cfg.extra["exit_threshold"] = 1.0
    with torch.no_grad():
        model(x, n_loops=3, exit="learned")
    assert (model.last_aux["exit_step"] == 3).all()


# -- MoR -----------------------------------------------------------------------------------
def test_mor_keeps_each_steps_capacity_and_nests_the_selections():
    model = build_model(micro("mor")).train()
    x, y = xy(b=3, t=20)
    out = model(x, y, n_loops=3)
    ks = [math.ceil(20 * share) for share in (3 / 3, 2 / 3, 1 / 3)]
    assert model.last_aux["selected"] == [3 * k for k in ks]
    masks = model.last_aux["selected_masks"]
    assert [m.sum(1).tolist() for m in masks] == [[k] * 3 for k in ks]
    assert (masks[2] <= masks[1]).all() and (masks[1] <= masks[0]).all()  # a token leaves and never returns
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.routers[1].weight.grad.abs().sum() > 0  # the router learns through g and the aux loss


def test_mor_unselected_tokens_keep_their_state_and_causality_holds():
    model = build_model(micro("mor")).eval()
    x, _ = xy(b=1, t=20)
    with torch.no_grad():
        out = model(x, n_loops=3, return_states=True)
        s1, s2 = out.states[1], out.states[2]
        chosen = model.last_aux["selected_masks"][1][0]
        assert torch.equal(s2[0, ~chosen], s1[0, ~chosen]) and not torch.equal(s2[0, chosen], s1[0, chosen])


# -- distributed: ZeRO-2/3 gradients, training and resume -------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_gradients_equal_single_process_reference(tmp_path, stage):
    report_path = tmp_path / "report.json"
    presets = ",".join(f"micro-{v}" for v in VARIANTS)
    results = run_ranks(
        [str(REPO / "tests" / "dist_scripts" / "grad_check.py"), str(stage), presets, str(report_path), "3,1,0,2"],
        world=2,
        timeout=400,
    )
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    reports = json.loads(report_path.read_text())
    for preset, report in reports.items():
        assert [s["depth"] for s in report["steps"]] == [3, 1, 0, 2]
        for step in report["steps"]:
            for name, g in step["grads"].items():
                assert g["max_abs_diff"] <= 1e-5 + 1e-4 * g["ref_max"], (preset, step["depth"], name, g)
            assert step["unused_with_nonzero_grad"] == [], (preset, step["depth"])


def train_args(manifest, out, variant, *extra):
    sets = (
        "train.log_every=1",
        "train.save_every=6",
        "train.eval_every=12",
        "train.eval_batches=2",
        "train.warmup_steps=2",
        "train.lr=1e-2",
    )
    zero3 = str(REPO / "ds_configs" / "zero3.json")
    command = train_command(f"micro-{variant}", manifest, out, 12, 8, zero3, sets, *extra, grad_accum=1)
    return ["-m", "pretrain.cli", *command]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_trains_under_zero3_and_resumes_exactly(shards, tmp_path, variant):
    """One rank keeps this affordable on a CPU (two-rank ZeRO-3 is the gradient check's job)."""
    full = tmp_path / "full"
    (r,) = run_ranks(train_args(shards, full, variant), world=1, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:]
    losses = [x["loss"] for x in records(full / "metrics.jsonl")]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    summary = json.loads((full / "summary.json").read_text())
    # the table by value: the last validation's loss at each depth (metrics.jsonl), depths that differ
    val = next(r["val"] for r in reversed(records(full / "metrics.jsonl")) if "val" in r)
    table = {str(d): val[f"val/loss_depth_{d}"] for d in range(4)}
    assert summary["val_loss_by_depth"] == table and len(set(table.values())) > 1, (summary, val)
    assert all(math.isfinite(v) and v > 0 for v in table.values()), table
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step00000006", resumed / "checkpoints" / "step00000006")
    (resumed / "checkpoints" / "latest").write_text("step00000006\n")
    (r,) = run_ranks(train_args(shards, resumed, variant, "--resume"), world=1, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:]
    again = {x["step"]: x["loss"] for x in records(resumed / "metrics.jsonl")}
    assert sorted(again) == list(range(7, 13))
    assert all(again[s] == losses[s - 1] for s in again), [(s, losses[s - 1], again[s]) for s in again]
