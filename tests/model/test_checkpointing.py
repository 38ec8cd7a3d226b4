"""Activation checkpointing: the activation-memory estimate matches what torch allocates,
`auto` picks the least recompute that fits the device memory left, selective checkpointing
gives the reference gradients under real DeepSpeed ZeRO-2 and is refused under ZeRO-3 (the
eager gradients of every mode: tests/model/test_model.py)."""

import json
import weakref

import pytest
import torch
from multiproc import REPO, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pretrain.model import build_model
from pretrain.model_config import ModelConfig
from pretrain.presets import get_preset
from pretrain.runs.train_config import CHECKPOINT_MODES
from pretrain.training.engine.parallelize import (
    AUTO_MODES,
    activation_bytes,
    apply_activation_checkpointing,
    choose_checkpointing,
)

GiB = 2**30


class ActivationPeak(TorchDispatchMode):
    """The peak bytes held by the tensors that ops create while it is active and that are
    freed before it ends (activations and temporaries; not the gradients and other tensors
    that outlive the step). A storage counts from its creation until its Python object,
    which torch keeps while the storage lives, is finalized."""

    def __init__(self):
        super().__init__()
        # (key, bytes > 0 created, < 0 freed); the key of each storage alive now, by its id().
        # A key is a serial, not the id: ids are reused once an object is freed, and a survivor
        # sharing a freed storage's id would drop that storage from the count.
        self.events, self.alive, self.serial = [], {}, 0

    def _free(self, storage_id, key, nbytes):
        if self.alive.get(storage_id) == key:
            del self.alive[storage_id]
        self.events.append((key, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.alive and storage.nbytes() > 0:
                    self.serial += 1
                    self.alive[id(storage)] = self.serial
                    self.events.append((self.serial, storage.nbytes()))
                    weakref.finalize(storage, self._free, id(storage), self.serial, storage.nbytes())
        return out

    def peak(self) -> int:
        survivors, live, peak = set(self.alive.values()), 0, 0
        for key, nbytes in self.events:
            if key not in survivors:
                live += nbytes
                peak = max(peak, live)
        return peak


def tiny(layout="1+2x3+1", d_model=64):
    return ModelConfig(
        variant="grt" if "x" in layout else "dense",
        layout=layout,
        d_model=d_model,
        n_heads=4,
        vocab_size=256,
        max_seq_len=64,
    )


def tiny_baseline(variant, layout="1+1x3+1"):
    """A micro baseline preset at the size of `tiny` (micro-huginn differentiates its last 2 steps)."""
    return get_preset(f"micro-{variant}").replace(layout=layout, d_model=64, n_heads=4, vocab_size=256)


def loss_and_grads(model, idx, depth):
    torch.manual_seed(1)  # the same noise draws: non-reentrant checkpoint replays the RNG state
    loss = model(idx, idx, n_loops=depth).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "cfg,depth",
    [
        (tiny("1+2x4+1", d_model=128), 4),
        (tiny("1+2x4+1", d_model=128), 1),
        (tiny("1+1x8+1"), 8),
        (tiny("6", d_model=128), None),
        (tiny_baseline("ouro"), 3),
        (tiny_baseline("huginn", "1+1x6+1"), 6),
        (tiny_baseline("mor"), 3),
    ],
)
def test_activation_estimate_is_within_1_5x_of_the_measured_peak(cfg, depth):
    """The peak bytes of the tensors a forward and backward create and free (`ActivationPeak`)
    against `activation_bytes`, for every mode; also for the baselines whose loops keep
    other tensors: Ouro decodes every step, Huginn differentiates only its last steps, MoR
    runs each step on a share of the tokens."""
    idx = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    measured = {}
    for mode in CHECKPOINT_MODES:
        torch.manual_seed(0)
        model = apply_activation_checkpointing(build_model(cfg).train(), mode)
        with ActivationPeak() as meter:  # the training forward: the loss without logits (Ouro keeps its own)
            model(idx, idx, n_loops=depth, return_logits=False).loss.backward()
        measured[mode] = meter.peak()
        estimate = activation_bytes(cfg, idx.numel(), depth or 0, mode, 4)
        assert measured[mode] / 1.5 <= estimate <= 1.5 * measured[mode], (mode, measured[mode], estimate)
    assert measured["loop_step"] < measured["selective"] < measured["off"], measured


@pytest.mark.parametrize(
    "free_gib,expected", [(None, "off"), (80, "off"), (10, "off"), (8, "selective"), (5, "loop_step"), (1, "loop_step")]
)
def test_auto_picks_the_least_recompute_that_fits(free_gib, expected):
    """grt-small (1+1x10+1, d 768) at micro-batch 16 x 1024 tokens, bf16, depth up to 10
    (about 7.6, 4.8 and 1.3 GiB: the training loss keeps no [tokens x vocabulary] logits, which were
    7.7 GiB of the 14, 12 and 8 GiB before pretrain/model/loss.py). None: the CPU."""
    cfg = get_preset("grt-small")
    estimates = {m: activation_bytes(cfg, 16 * 1024, 10, m, 2) for m in AUTO_MODES}
    print("\nESTIMATES grt-small 16 x 1024 bf16 depth 10 (GiB):", {m: round(b / GiB, 2) for m, b in estimates.items()})
    assert estimates["loop_step"] < estimates["selective"] < estimates["off"]
    assert choose_checkpointing(estimates, None if free_gib is None else int(free_gib * GiB)) == expected
    deeper = {m: activation_bytes(cfg, 16 * 1024, 40, m, 2) for m in AUTO_MODES}
    assert deeper["off"] > 3 * estimates["off"] / 1.5  # the loop's share grows with the depth


def test_auto_counts_ouros_per_step_heads():
    """Ouro decodes every loop step in training: at grt-small's size, 16 x 1024 tokens, bf16,
    depth 4, each step keeps its logits and fp32 log-softmax (about 6 x V bytes per token,
    18 GiB in all) in every mode. With 24 GiB free the same loop without per-step heads runs
    without checkpointing; Ouro must not."""
    from pretrain.presets import LOOP_ONLY

    loop_only = get_preset("grt-small").replace(**LOOP_ONLY)
    ouro = loop_only.replace(variant="ouro")
    tokens, depth, free = 16 * 1024, 4, 24 * GiB
    plain = {m: activation_bytes(loop_only, tokens, depth, m, 2) for m in AUTO_MODES}
    per_step = {m: activation_bytes(ouro, tokens, depth, m, 2) for m in AUTO_MODES}
    assert choose_checkpointing(plain, free) == "off"
    assert choose_checkpointing(per_step, free) != "off"
    assert per_step["loop_step"] > depth * 6 * ouro.vocab_size * tokens


def test_auto_leaves_room_for_what_the_first_step_allocates():
    """`auto` reads the free memory before the first step: it takes off the full bf16
    gradients under ZeRO-0/1 (ZeRO-2 partitions them) and, under ZeRO-3 with more than one
    rank, the live-parameter budget and the prefetch bucket (at most the model each)."""
    from pretrain.training.engine.activation_checkpointing import allocated_later

    n, z3 = 10**8, {"stage": 3, "stage3_max_live_parameters": 6 * 10**7, "stage3_prefetch_bucket_size": 5 * 10**7}
    assert allocated_later({"zero_optimization": {"stage": 1}}, n, 8, 2) == 2 * n
    assert allocated_later({}, n, 1, 2) == 2 * n  # no ZeRO section: stage 0
    assert allocated_later({"zero_optimization": {"stage": 2}}, n, 8, 2) == 0
    assert allocated_later({"zero_optimization": z3}, n, 1, 2) == 0
    assert allocated_later({"zero_optimization": z3}, n, 8, 2) == 2 * (6 * 10**7 + 5 * 10**7)
    assert allocated_later({"zero_optimization": {"stage": 3}}, n, 8, 2) == 2 * (n + 5 * 10**7)  # defaults


@pytest.mark.slow
def test_selective_checkpointing_gradients_under_zero2_equal_the_reference(tmp_path):
    """Real DeepSpeed ZeRO-2 on 2 ranks, gradient accumulation 2, depths 3, 1, 0, 2, selective
    checkpointing: the full gradients equal a single-process reference without
    checkpointing (loop_step under ZeRO-3: tests/training/test_trainer.py)."""
    report_path = tmp_path / "report.json"
    results = run_ranks(
        [
            str(REPO / "tests" / "dist_scripts" / "grad_check.py"),
            "2",
            "micro-grt",
            str(report_path),
            "3,1,0,2",
            "selective",
        ],
        world=2,
        timeout=300,
    )
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    steps = json.loads(report_path.read_text())["steps"]
    assert [s["depth"] for s in steps] == [3, 1, 0, 2]
    for step in steps:
        for name, g in step["grads"].items():
            assert g["max_abs_diff"] <= 1e-5 + 1e-4 * g["ref_max"], (step["depth"], name, g)


def test_zero3_refuses_selective_checkpointing_and_auto_never_picks_it(shards, tmp_path):
    from multiproc import grt

    from pretrain.training.engine.parallelize import modes_for_stage

    r = grt(
        "train",
        "--preset",
        "micro-grt",
        "--data",
        str(shards),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "1",
        "--ds-config",
        "ds_configs/zero3.json",
        "--set",
        "train.activation_checkpointing=selective",
    )
    assert r.returncode != 0 and not (tmp_path / "run").exists()
    message = r.stderr.strip().splitlines()[-1]
    assert "train.activation_checkpointing='selective' is refused under ZeRO stage 3" in message, r.stderr
    assert "Traceback" not in r.stderr
    assert "selective" not in modes_for_stage(3) and "selective" in modes_for_stage(2)


def test_selective_checkpointing_is_still_wrong_with_deepspeeds_zero3_linear(monkeypatch):
    """Why ZeRO-3 refuses selective checkpointing (`modes_for_stage`): with DeepSpeed's ZeRO-3
    linear in place of F.linear (as `deepspeed.zero.Init` installs it), torch's selective
    checkpointing gives wrong gradients upstream of the recomputed units, without any engine.
    When an upgrade fixes it, this test fails: lift the refusal then."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = build_model(tiny()).train()
    ckpt = apply_activation_checkpointing(build_model(tiny()).train(), "selective")
    ckpt.load_state_dict(plain.state_dict())
    _, reference = loss_and_grads(plain, idx, 3)
    monkeypatch.setattr(F, "linear", zero3_linear_wrap)
    _, grads = loss_and_grads(ckpt, idx, 3)
    wrong = [n for n in reference if not torch.allclose(reference[n], grads[n], rtol=1e-4, atol=1e-6)]
    assert "prelude.0.attn.c_attn.weight" in wrong and not any(n.startswith("coda.") for n in wrong), wrong


@pytest.mark.slow
def test_selective_checkpointing_under_compile_gives_the_eager_gradients():
    """Compiled around the checkpoint (`checkpoint_and_compile`), selective checkpointing's list of kept
    ops applies inside the compiled graph, and the gradients are the uncompiled, unchecked model's."""
    from pretrain.training.engine.parallelize import checkpoint_and_compile

    cfg = ModelConfig(
        layout="1+1x3+1", d_model=32, n_heads=2, vocab_size=97, max_seq_len=16, state_noise_std=0, gate_noise_std=0
    )
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for mode, compiled in (("off", False), ("selective", True)):
        torch.manual_seed(0)
        model = checkpoint_and_compile(build_model(cfg).train(), mode, compiled)
        model(idx, idx, return_logits=False).loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    reference, compiled = results
    for name, g in reference.items():
        assert torch.allclose(compiled[name], g, atol=1e-6, rtol=1e-4), name
