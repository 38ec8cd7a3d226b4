"""DeepSpeed's per-step host reads that a setting removes: a real bf16 `grt train` under ZeRO-2
(the merged config's `bf16.check_grad_overflow: false`, the device-side clip of
deepspeed_internals.install_device_clip) with every host sync counted by its caller
(tests/dist_scripts/count_syncs.py). On the CPU the stream syncs are skipped, so the reads are
what shows; docs/gpu.md lists what is left on CUDA."""

import json
import subprocess
import sys

import pytest
from multiproc import REPO

from pretrain.runs.train_config import TrainConfig
from pretrain.training.engine.ds_config import build_ds_config, load_ds_json

pytestmark = pytest.mark.filterwarnings("ignore")


def test_the_merged_bf16_config_turns_the_overflow_check_off_unless_the_file_says():
    base = load_ds_json(REPO / "ds_configs" / "zero2.json")
    t = TrainConfig(precision="bf16")
    assert build_ds_config(base, t, 1, use_cuda=True)["bf16"]["check_grad_overflow"] is False
    kept = {**base, "bf16": {"check_grad_overflow": True}}
    assert build_ds_config(kept, t, 1, use_cuda=True)["bf16"]["check_grad_overflow"] is True
    assert "check_grad_overflow" not in build_ds_config(base, TrainConfig(precision="fp32"), 1, False)["bf16"]


def test_a_bf16_zero2_step_reads_the_device_once(shards, tmp_path):
    """Per quiet step: the trainer's one read of the control vector, and nothing inside DeepSpeed
    (was 3: the overflow `.item()`, the invalid-norm `bool()`, the clip's `bool()`)."""
    report = tmp_path / "syncs.json"
    args = ["--preset", "micro-grt", "--data", str(shards), "--out", str(tmp_path / "run"), "--steps", "7"]
    args += ["--micro-batch-size", "2", "--ds-config", "ds_configs/zero2.json"]
    for setting in ("train.precision=bf16", "train.log_every=100", "train.eval_every=0", "train.save_every=0"):
        args += ["--set", setting]
    script = str(REPO / "tests" / "dist_scripts" / "count_syncs.py")
    r = subprocess.run([sys.executable, script, str(report), *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    steps = {s["step"]: s for s in json.loads(report.read_text())}
    quiet = [steps[i] for i in range(2, 7)]  # 1: start-up; 7: the last, logged and saved
    assert [s["deepspeed"] for s in quiet] == [0] * 5, steps
    assert [s["project"] for s in quiet] == [1] * 5, steps


def test_the_device_side_clip_scales_as_deepspeeds_and_reads_nothing(monkeypatch):
    """DeepSpeed's ZeRO-1/2 clip and the patched one on the same gradients: the same scale for a
    finite norm above and below the clip; an invalid norm (NaN, inf, DeepSpeed's -1) scales the
    gradients by 0 in both; the patched one never turns a tensor into a host bool."""
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pretrain.training.engine import deepspeed_internals

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "unscale_and_clip_grads", DeepSpeedZeroOptimizer.unscale_and_clip_grads)
    deepspeed_internals.install_device_clip()
    patched = DeepSpeedZeroOptimizer.unscale_and_clip_grads
    original = patched.grt_replaced
    opt = SimpleNamespace(clip_grad=1.0, loss_scale=1.0, device=torch.device("cpu"))
    for norm in (0.5, 3.0, float("nan"), float("inf"), -1.0):
        grads = [torch.full((4,), 2.0) for _ in range(2)]
        original(opt, [grads[0]], torch.tensor(norm))
        reads: list[torch.Tensor] = []
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda t, seen=reads: seen.append(t) or True)
        patched(opt, [grads[1]], torch.tensor(norm))
        monkeypatch.undo()
        assert reads == [] and torch.equal(grads[0], grads[1]), (norm, grads)
    assert DeepSpeedZeroOptimizer.unscale_and_clip_grads is not patched  # undone for the next tests


def test_deepspeeds_mark_of_a_non_finite_norm_stops_the_run():
    """With bf16's overflow check off DeepSpeed applies a non-finite gradient and reports the norm
    as -1: the trainer's check (the next step's control vector, or at once on logging and saving
    steps) must take -1 as non-finite, or a corrupt state would be trained on and saved."""
    from types import SimpleNamespace

    import torch

    from pretrain.training.health import TrainingStopped
    from pretrain.training.step.optimizer_step import StepRunner

    for norm, bad in ((-1.0, True), (float("nan"), True), (0.7, False)):
        engine = SimpleNamespace(get_global_grad_norm=lambda n=norm: n)
        runner = SimpleNamespace(engine=engine, comm=torch.device("cpu"), root=REPO / "no-run")
        runner.stop_on_bad_grad_norm = lambda step, r=runner: StepRunner.stop_on_bad_grad_norm(r, step)
        StepRunner.record_grad_norm(runner)
        assert float(runner.grad_norm_bad) == float(bad)
        if bad:
            with pytest.raises(TrainingStopped, match="non-finite gradient norm at step 5"):
                StepRunner.check_grad_norm(runner, 5)
        else:
            assert StepRunner.check_grad_norm(runner, 5) == pytest.approx(0.7)


def test_a_micro_batch_goes_to_cuda_from_pinned_memory(monkeypatch):
    """On CUDA each tensor is pinned, then copied with non_blocking (queued, no wait for the stream);
    on the CPU nothing is pinned (there is no pinned memory without an accelerator). The copies are
    recorded, not run: this machine has no CUDA."""
    import torch

    from pretrain.training.step.optimizer_step import move

    done = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: getattr(t, "pinned", False))

    def pin(t):
        done.append("pin")
        out = t.clone()
        out.pinned = True
        return out

    def to(t, device, non_blocking=False):
        done.append(("to", torch.device(device).type, getattr(t, "pinned", False), non_blocking))
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = {k: torch.zeros(2, 8, dtype=torch.long) for k in ("input_ids", "targets", "doc_ids")}
    move(batch, torch.device("cuda", 0), doc_mask=True)
    assert done == ["pin", ("to", "cuda", True, True)] * 3, done
    done.clear()
    move(batch, torch.device("cpu"), doc_mask=False)
    assert done == [("to", "cpu", False, True)] * 2, done


def test_the_training_data_comes_from_pinned_loader_workers_on_cuda_by_default(shards, tmp_path):
    """train.num_workers=-1 (the default, kept so in the run's config.json): a rank's loader has 2
    worker processes on CUDA and none on the CPU (a count given stays), and pins their batches on
    CUDA, which `move` then copies as they are (test above). The data's reading and its pinned copy
    leave the step's critical path (docs/gpu.md)."""
    import torch

    from pretrain.presets import get_preset
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.data import RunData
    from pretrain.training.start.plan import plan_start

    cfg = RunConfig(data=str(shards), out=str(tmp_path / "run"), model=get_preset("micro-grt"))
    plan = plan_start(cfg, False, world=1, use_cuda=True)
    assert plan.cfg.train.num_workers == -1

    def loader(device: str, plan=plan):
        made = RunData(plan, rank=0, world=1, device=torch.device(device)).loader
        return made.num_workers, made.pin_memory

    assert loader("cuda") == (2, True) and loader("cpu") == (0, False)
    cfg.train.num_workers = 1
    given = plan_start(cfg, False, world=1, use_cuda=True)
    assert loader("cuda", given) == (1, True) and loader("cpu", given) == (1, False)
