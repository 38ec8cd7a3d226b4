"""DeepSpeed files written for other trainers, merged with the run config by the one rule of
pretrain/training/engine/ds_config.py: "auto" is filled from the run config, a value that disagrees
is refused with one line naming both values. The files are the ones users bring: the Hugging
Face trainer's ZeRO-3 example and a Megatron-DeepSpeed / GPT-NeoX style file."""

import json
import os
import subprocess
import sys

import pytest

from grt_common.errors import ConfigError
from pretrain.runs.train_config import TrainConfig
from pretrain.training.engine.ds_config import build_ds_config, load_ds_json, resolve_ds_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the Hugging Face docs' ZeRO-3 example (scheduler type aside: see test_hf_warmup_lr_is_refused)
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# Megatron-DeepSpeed / GPT-NeoX style: concrete numbers everywhere, fp16 on
MEGATRON = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 8,
    "steps_per_print": 10,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.5e-4, "warmup_num_steps": 2000, "total_num_steps": 20000},
    },
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 12,
    },
    "wall_clock_breakdown": False,
}


def train_config(**changes):
    return TrainConfig(
        **{
            "micro_batch_size": 8,
            "grad_accum": 8,
            "steps": 20000,
            "warmup_steps": 2000,
            "lr": 1.5e-4,
            "min_lr": 1.5e-5,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            **changes,
        }
    )


def test_hf_auto_values_are_filled_from_the_run_config():
    train = train_config(precision="bf16")
    ds = build_ds_config(HF_ZERO3, train, world_size=8, use_cuda=True)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        8,
        8,
        512,
    )
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    # torch's fused AdamW on CUDA too: DeepSpeed's FusedAdam would compile on the GPU (test_optimizer.py)
    assert ds["optimizer"]["params"] == {
        "lr": 1.5e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
        "fused": True,
    }
    sched = ds["scheduler"]["params"]
    assert (sched["total_num_steps"], sched["warmup_num_steps"]) == (20000, 2000)
    assert sched["cos_min_ratio"] == pytest.approx(0.1)
    zero = ds["zero_optimization"]
    # DeepSpeed's own keys left "auto": DeepSpeed's default applies; the rest as written
    assert "reduce_bucket_size" not in zero and "stage3_prefetch_bucket_size" not in zero
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert "auto" not in json.dumps(ds)
    # the same file on a CPU run: fp32, torch's fused AdamW
    cpu = build_ds_config(HF_ZERO3, train_config(), world_size=2, use_cuda=False)
    assert cpu["bf16"]["enabled"] is False and cpu["train_batch_size"] == 128
    assert cpu["optimizer"]["params"] == ds["optimizer"]["params"]


def test_hf_warmup_lr_is_refused():
    """HF's example schedules WarmupLR (constant after warmup): the run config's schedule is
    cosine, so it is refused rather than silently replaced."""
    hf = dict(
        HF_ZERO3,
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
    )
    with pytest.raises(ConfigError) as err:
        build_ds_config(hf, train_config(), world_size=8, use_cuda=True)
    message = str(err.value)
    assert "\n" not in message and '"WarmupLR"' in message and '"WarmupCosineLR"' in message


# the fix that makes each of the Megatron file's disagreeing keys pass
MEGATRON_FIXES = {
    "fp16": {"enabled": False},
    "optimizer": {"type": "Adam", "params": {"lr": 6e-4}},
    "scheduler": {"type": "auto"},
    "gradient_clipping": "auto",
    "train_batch_size": 256,
    "gradient_accumulation_steps": 4,
}


@pytest.mark.parametrize(
    "key, expected",
    [
        ("fp16", ["fp16.enabled=true", "train.precision"]),
        ("optimizer", ["optimizer.params.lr=0.00015", "train.lr = 0.0006"]),
        ("scheduler", ['scheduler.type="WarmupDecayLR"', '"WarmupCosineLR"']),
        ("gradient_clipping", ["gradient_clipping=1.0", "train.grad_clip = 0.5"]),
        ("train_batch_size", ["train_batch_size=512", "ranks 8 = 256"]),
    ],
)
def test_megatron_file_disagreements_are_refused_one_by_one(key, expected):
    """Megatron's optimizer, scheduler, clipping and fp16 never silently win or lose: each
    disagreement is one line naming both values; fixing them all makes the file pass."""
    train = train_config(lr=6e-4, min_lr=6e-5, grad_clip=0.5, precision="bf16", grad_accum=4)
    almost = dict(MEGATRON, **{k: v for k, v in MEGATRON_FIXES.items() if k != key})
    with pytest.raises(ConfigError) as err:
        build_ds_config(almost, train, world_size=8, use_cuda=True)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"DeepSpeed config {key}")
    for text in expected:
        assert text in message, message
    ds = build_ds_config(dict(almost, **{key: MEGATRON_FIXES[key]}), train, world_size=8, use_cuda=True)
    assert ds["optimizer"]["params"]["lr"] == 6e-4 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["train_batch_size"] == 256
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["zero_optimization"]["reduce_bucket_size"] == 5e8


def test_megatron_file_agreeing_with_the_run_config_passes():
    agreeing = dict(
        MEGATRON,
        fp16={"enabled": False},
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 20000, "warmup_num_steps": 2000}},
    )
    ds = build_ds_config(agreeing, train_config(precision="bf16"), world_size=8, use_cuda=True)
    assert ds["train_batch_size"] == 512 and ds["optimizer"]["type"] == "AdamW"
    with pytest.raises(ConfigError, match='optimizer.type="Lamb"'):
        build_ds_config(dict(agreeing, optimizer={"type": "Lamb"}), train_config(precision="bf16"), 8, True)


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("ds_configs/zero3.json", "zero1.json"):
        assert load_ds_json(name)["zero_optimization"]["stage"] in (1, 3)
        assert resolve_ds_path(name).is_absolute()
    (tmp_path / "zero1.json").write_text('{"zero_optimization": {"stage": 2}}')
    assert load_ds_json("zero1.json")["zero_optimization"]["stage"] == 2  # the user's own file wins
    with pytest.raises(ConfigError, match="no such file"):
        load_ds_json("zero9.json")


def test_print_config_shows_the_merged_config_outside_the_checkout(tmp_path):
    """`python <checkout>/pretrain/train.py --print-config` from another directory: the
    default DeepSpeed file is found, Megatron's --deepspeed --deepspeed_config spelling works."""
    (tmp_path / "ds.json").write_text(json.dumps(HF_ZERO3))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    script = os.path.join(ROOT, "pretrain", "train.py")
    base = [
        sys.executable,
        script,
        "--preset",
        "tiny-grt",
        "--data",
        "m.json",
        "--print-config",
        "--micro-batch-size",
        "3",
    ]
    r = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ds_config"] == "ds_configs/zero3.json"
    base[base.index("--print-config")] = "--print-ds-config"
    r = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["zero_optimization"]["stage"] == 3
    r = subprocess.run(
        base + ["--local_rank=0", "--deepspeed", "--deepspeed_config", "ds.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["zero_optimization"]["sub_group_size"] == 1e9


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_comm_is_on_with_several_ranks_only_unless_the_file_says(stage):
    """On one GPU there is nothing to overlap the reduction with, and overlap_comm costs DeepSpeed's
    cuda.synchronize() per backward (ZeRO-2), per bucket (ZeRO-1) or on its reduce stream (ZeRO-3)."""
    shipped = load_ds_json(f"zero{stage}.json")
    assert "overlap_comm" not in shipped["zero_optimization"]
    for world, expected in ((1, False), (2, True), (16, True)):
        merged = build_ds_config(shipped, train_config(), world, use_cuda=True)
        assert merged["zero_optimization"]["overlap_comm"] is expected, (stage, world)
    written = {**shipped, "zero_optimization": {**shipped["zero_optimization"], "overlap_comm": True}}
    assert build_ds_config(written, train_config(), 1, use_cuda=True)["zero_optimization"]["overlap_comm"] is True
