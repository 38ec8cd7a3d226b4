"""Resuming on another number of ranks through DeepSpeed's universal checkpoints
(pretrain/training/checkpoint/universal.py), with the real engine on CPU ranks.

For ZeRO-1, 2 and 3: a micro GRT trained 3 steps on 2 ranks is saved (store.save: our
files beside DeepSpeed's), converted and loaded on 1 rank. The weights, Adam moments, optimizer
step counts, param groups and lr scheduler after the load equal a full-state dump taken at the
save, and one more step gives the 2-rank run's loss and state. Under ZeRO-3 the 1-rank run then
saves, and 2 ranks resume it (1 -> 2, the partitioned layout from the all-persistent one). The
model has sizes no world size divides (d_model 33: ZeRO's padding), tied embeddings, and the
two param groups of engine.param_groups (decay / no decay), also under ZeRO-3, whose universal
load gets both groups' hyperparameters and step counters wrong unless universal.load repairs them.

The conversion is atomic and reused: a leftover temporary, a copy without its marker, a stale
copy and a converter killed mid-way are never used, and no converter outlives its caller.

This file is also the rank script: python tests/training/test_universal_checkpoint.py train|resume ...
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

G, B, T, STEPS, DEPTH = 2, 2, 16, 3, 2  # micro-batches per step (over all ranks), batch, seq, steps, loops


# ---------------------------------------------------------------------------------------------
# the rank script
# ---------------------------------------------------------------------------------------------


def _worker(argv: list[str]) -> int:
    """train STAGES OUT: for each ZeRO stage (OUT/zero<stage>/): 3 steps on W ranks, dump, save
    step 3, one more step, dump. resume STAGES OUT TAG [save]: convert (rank 0), load, dump, one
    step, dump; with `save`: save that step, one more step, dump. Dumps (rank 0):
    OUT/zero<stage>/<mode>_w<W>.pt. The stages run one after the other in the same processes
    (ZeRO-3 last), to start DeepSpeed once."""
    sys.path.insert(0, str(REPO))
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from pretrain.distributed import all_reduce, check_ranks, comm_device, exit_process, init_distributed
    from pretrain.model.baselines import noise_off
    from pretrain.presets import get_preset
    from pretrain.runs import checkpoint_files
    from pretrain.runs.run_config import RunConfig
    from pretrain.training.checkpoint import store, universal
    from pretrain.training.engine.build import build_engine
    from pretrain.training.engine.ds_config import build_ds_config, load_ds_json

    mode, stages, base = argv[0], [int(s) for s in argv[1].split(",")], Path(argv[2])
    info = init_distributed(timeout_s=120)
    rank, world = info.rank, info.world_size

    def run(stage: int, out: Path) -> dict:
        cfg = RunConfig(data="unused", ds_config=f"ds_configs/zero{stage}.json")
        cfg.model = noise_off(get_preset("micro-grt")).replace(d_model=33, n_heads=3, vocab_size=101, max_seq_len=T)
        cfg.train.micro_batch_size, cfg.train.grad_accum = B, G // world  # the same global batch on any world
        cfg.train.activation_checkpointing = "off"
        cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, cfg.train.steps = 1e-2, 1e-3, 2, 10
        ds = build_ds_config(load_ds_json(cfg.ds_config), cfg.train, world, False)
        if stage == 3 and world > 1:  # partition every parameter, as a large model's are
            ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        root = out / "checkpoints"

        def train_step(engine, step):
            ga, total = G // world, torch.zeros(1, dtype=torch.float64, device=comm_device())
            for m in range(ga):
                g = torch.Generator().manual_seed(1000 * step + rank * ga + m)
                idx = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
                loss = engine(idx[:, :-1], idx[:, 1:], n_loops=DEPTH, return_logits=False).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach().double().to(total.device)
            return float(all_reduce(total).item()) / G

        def full_state(engine):
            """Every rank (collectives): the full fp32 weights and moments, and the optimizer's
            and scheduler's counters."""
            opt = engine.optimizer
            if stage < 3:  # DeepSpeed links the moments of groups after the first lazily: link them all
                for i, group in enumerate(opt.bit16_groups):
                    flat = opt.single_partition_of_fp32_groups[i]
                    for lp in group:
                        if lp._hp_mapping is not None:
                            lp._hp_mapping.set_optim_state_fragment(flat, opt.optimizer.state[flat])
            state: dict = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
            for name, p in engine.module.named_parameters():
                state["params"][name] = safe_get_full_fp32_param(p).detach().cpu().clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key][name] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
            state["opt_steps"] = [float(s["step"]) for s in opt.optimizer.state.values()]
            state["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            assert len(state["groups"]) == 2  # decay / no decay, also under ZeRO-3 (its load pitfalls need both)
            state["sched"] = engine.lr_scheduler.state_dict()
            state["counters"] = (engine.global_steps, engine.global_samples, engine.skipped_steps)
            return state

        def save(engine, step):
            return store.save(
                engine, root, step, config_json="{}", tokenizer_path=None, loader_state={}, keep=3, rank=rank
            )

        result: dict = {}
        if mode == "train":
            torch.manual_seed(0)
            engine, _ = build_engine(cfg, world, torch.device("cpu"), T, ds)
            result["losses"] = [train_step(engine, s) for s in range(STEPS)]
            result["saved"] = full_state(engine)
            save(engine, STEPS)
            result["next_loss"] = train_step(engine, STEPS)
            result["after"] = full_state(engine)
            return result
        step_dir = root / argv[3]
        result["needs_universal"] = universal.needs_universal(step_dir, world)
        error = None
        if rank == 0:
            t0 = time.monotonic()
            try:
                universal.convert(step_dir)
            except universal.ConversionError as err:
                error = str(err)
            result["convert_s"] = time.monotonic() - t0
        check_ranks(error)  # the others wait here for rank 0's conversion
        check_ranks(None if universal.is_converted(step_dir) else f"rank {rank} does not see {step_dir}'s copy")
        torch.manual_seed(1)  # other initial weights than the saved run's: a missed load shows
        ds = universal.with_universal_load(ds)
        engine, _ = build_engine(cfg, world, torch.device("cpu"), T, ds)
        result["client"] = {k: v for k, v in universal.load(engine, step_dir).items() if k == "step"}
        result["loaded"] = full_state(engine)
        step = checkpoint_files.step_of(step_dir.name)
        result["next_loss"] = train_step(engine, step)
        result["after"] = full_state(engine)
        if len(argv) > 4:
            save(engine, step + 1)
            result["next2_loss"] = train_step(engine, step + 1)
            result["after2"] = full_state(engine)
        return result

    for stage in stages:
        out = base / f"zero{stage}"
        out.mkdir(parents=True, exist_ok=True)
        result = run(stage, out)
        if rank == 0:
            torch.save(result, out / f"{mode}_w{world}.pt")
    return exit_process(0)


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------


def _ranks(args: list[str], world: int) -> None:
    from multiproc import run_ranks

    for r in run_ranks([__file__, *[str(a) for a in args]], world=world, timeout=240):
        assert r.returncode == 0, r.stdout[-6000:]


def _same_state(got: dict, want: dict, atol: float = 0.0) -> dict[str, float]:
    """Assert two full-state dumps agree (tensors within `atol`, counters exactly); the max
    differences."""
    worst = {}
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert got[key].keys() == want[key].keys()
        worst[key] = max((got[key][n] - want[key][n]).abs().max().item() for n in want[key])
        assert worst[key] <= atol, (key, worst[key])
    for key in ("opt_steps", "groups", "sched", "counters"):
        assert got[key] == want[key], (key, got[key], want[key])
    return worst


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The runs of ZeRO-1, 2 and 3 on 2 ranks, saved at step 3: <dir>/zero<stage>/."""
    base = tmp_path_factory.mktemp("universal")
    _ranks(["train", "1,2,3", base], world=2)
    return base


@pytest.fixture(scope="module")
def resumed(trained) -> Path:
    """`trained`, resumed on 1 rank (each stage; ZeRO-3's saving step 4), then ZeRO-3's step 4 on 2."""
    _ranks(["resume", "1,2,3", trained, "step00000003", "save"], world=1)
    _ranks(["resume", "3", trained, "step00000004"], world=2)
    return trained


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_on_another_world_size(resumed, stage):
    from pretrain.training.checkpoint import universal

    out = resumed / f"zero{stage}"
    step_dir = out / "checkpoints" / "step00000003"
    saved = torch.load(out / "train_w2.pt", weights_only=False)
    got = torch.load(out / "resume_w1.pt", weights_only=False)
    assert got["needs_universal"] and got["client"] == {"step": 3}
    # DeepSpeed's files only: none of ours (rank<r>_state.pt, config.json, COMPLETE) went in
    assert {p.name for p in universal.universal_dir(step_dir).iterdir()} == {
        *(p.name for p in step_dir.glob("*_model_states.pt")),
        "zero",
        universal.SOURCE_FILE,
    }
    assert not list(step_dir.glob(".universal.tmp*"))
    _same_state(got["loaded"], saved["saved"])  # bit for bit
    assert abs(got["next_loss"] - saved["next_loss"]) <= 1e-6 * abs(saved["next_loss"])
    worst = _same_state(got["after"], saved["after"], atol=1e-6)
    print(
        f"ZeRO-{stage} 2 -> 1: convert {got['convert_s']:.1f} s, next loss {got['next_loss']!r} vs "
        f"{saved['next_loss']!r}, after one step {worst}"
    )
    if stage == 3:  # 1 -> 2: the checkpoint the 1-rank run saved at step 4, on 2 ranks
        two = torch.load(out / "resume_w2.pt", weights_only=False)
        assert two["needs_universal"] and two["client"] == {"step": 4}
        _same_state(two["loaded"], got["after"])
        assert abs(two["next_loss"] - got["next2_loss"]) <= 1e-6 * abs(got["next2_loss"])
        worst = _same_state(two["after"], got["after2"], atol=1e-6)
        print(
            f"ZeRO-3 1 -> 2: convert {two['convert_s']:.1f} s, next loss {two['next_loss']!r} vs "
            f"{got['next2_loss']!r}, after one step {worst}"
        )


@pytest.fixture
def checkpoint_copy(trained, tmp_path) -> Path:
    """A copy of the ZeRO-1 2-rank checkpoint (mtimes kept), its own to convert."""
    step_dir = tmp_path / "step00000003"
    source = trained / "zero1" / "checkpoints" / "step00000003"
    shutil.copytree(source, step_dir, ignore=shutil.ignore_patterns("universal*"))
    return step_dir


def _converters(step_dir: Path) -> list[int]:
    """Processes whose command line names `step_dir`'s conversion (the converter, its workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(step_dir).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_conversion_is_atomic_and_reused(checkpoint_copy):
    """A converting process SIGKILLed once DeepSpeed's converter is at work takes the converter
    with it and leaves only its temporary; with a copy that lacks its marker beside it, neither
    is used: the next conversion starts over and completes. A complete copy is then reused, and
    stale once its source is rewritten."""
    from pretrain.runs.checkpoint_files import ranks_that_wrote
    from pretrain.training.checkpoint import universal

    step_dir = checkpoint_copy
    final = universal.universal_dir(step_dir)
    assert ranks_that_wrote(step_dir) == 2 and universal.needs_universal(step_dir, 1)
    assert not universal.needs_universal(step_dir, 2) and not universal.is_converted(step_dir)
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from pretrain.training.checkpoint import universal; "
    code += f"universal.convert(__import__('pathlib').Path({str(step_dir)!r}))"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    log = step_dir / universal.LOG_FILE
    try:
        deadline = time.monotonic() + 60
        while not (log.is_file() and b"Extracting" in log.read_bytes()):
            assert parent.poll() is None and time.monotonic() < deadline, "the conversion did not start"
            time.sleep(0.005)
        assert _converters(step_dir), "no converter process"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while _converters(step_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _converters(step_dir), "the converter outlived the process that started it"
    assert list(step_dir.glob(".universal.tmp*")) and not final.exists() and not universal.is_converted(step_dir)
    final.mkdir()  # a copy without its marker (made by hand, or by something else than `convert`)
    (final / "JUNK").write_text("x")
    assert not universal.is_converted(step_dir)
    t0 = time.monotonic()
    assert universal.convert(step_dir) == final
    convert_s = time.monotonic() - t0
    assert universal.is_converted(step_dir) and not (final / "JUNK").exists()
    assert not list(step_dir.glob(".universal.tmp*")) and not _converters(step_dir)
    # a complete copy is reused: nothing is rewritten
    marker = final / universal.SOURCE_FILE
    before = marker.stat().st_mtime_ns, marker.stat().st_ino
    t0 = time.monotonic()
    assert universal.convert(step_dir) == final
    reuse_s = time.monotonic() - t0
    assert (marker.stat().st_mtime_ns, marker.stat().st_ino) == before and reuse_s < 1.0
    # a copy by another version of our converter (before Muon's momentum) is stale too
    made = json.loads(marker.read_text())
    marker.write_text(json.dumps({**made, "converter": made["converter"] - 1}))
    assert not universal.is_converted(step_dir)
    marker.write_text(json.dumps(made))
    # a rewritten source file (a resumed run writing the tag again) makes it stale: not used, redone
    # by the next conversion (as the copy without its marker was: moved aside, replaced)
    os.utime(step_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", ns=(time.time_ns(), time.time_ns()))
    assert not universal.is_converted(step_dir)
    print(f"conversion {convert_s:.2f} s, reuse {reuse_s * 1e3:.1f} ms")


@pytest.mark.slow
def test_failed_conversion_is_one_line_naming_the_checkpoint(checkpoint_copy):
    from grt_common.errors import ConfigError
    from pretrain.training.checkpoint import universal

    step_dir = checkpoint_copy
    part = step_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    intact = part.read_bytes()
    part.write_bytes(intact[:1000])  # cut off: found by the read-through before DeepSpeed's converter starts
    with pytest.raises(universal.ConversionError) as failed:
        universal.convert(step_dir)
    text = str(failed.value)
    assert isinstance(failed.value, ConfigError) and "\n" not in text and str(step_dir) in text, text
    assert part.name in text and "cut off or corrupt" in text and not (step_dir / universal.LOG_FILE).is_file()
    torch.save({"not": torch.zeros(1)}, part)  # readable, data only, but no optimizer state: the converter fails
    with pytest.raises(universal.ConversionError) as failed:
        universal.convert(step_dir)
    text = str(failed.value)
    assert isinstance(failed.value, ConfigError) and "\n" not in text and str(step_dir) in text, text
    assert "ds_to_universal failed" in text and (step_dir / universal.LOG_FILE).is_file()
    assert not universal.universal_dir(step_dir).exists() and not list(step_dir.glob(".universal.tmp*"))
    assert not _converters(step_dir)


def test_config_and_refusals(tmp_path):
    """The DeepSpeed config switch; what convert and load refuse before any work."""
    from types import SimpleNamespace

    from pretrain.runs.checkpoint_files import ranks_that_wrote
    from pretrain.training.checkpoint import universal

    ds = {"zero_optimization": {"stage": 3}, "checkpoint": {"tag_validation": "Warn"}}
    got = universal.with_universal_load(ds)
    assert got["checkpoint"] == {"tag_validation": "Warn", "load_universal": True} and "load_universal" not in str(ds)
    step_dir = tmp_path / "step00000001"
    step_dir.mkdir()
    torch.save({}, step_dir / "mp_rank_00_model_states.pt")  # readable: the refusals below are the converter's own
    assert ranks_that_wrote(step_dir) == 0 and not universal.needs_universal(step_dir, 4)  # ZeRO-0
    with pytest.raises(universal.ConversionError, match="not a complete checkpoint"):
        universal.convert(step_dir)
    (step_dir / "COMPLETE").write_text("1\n")
    with pytest.raises(universal.ConversionError, match="no ZeRO optimizer partitions"):
        universal.convert(step_dir)
    module = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(module=module, load_universal_checkpoint=lambda: False)
    with pytest.raises(universal.ConversionError, match="load_universal"):
        universal.load(engine, step_dir)
    module.bias.requires_grad_(False)
    engine.load_universal_checkpoint = lambda: True
    with pytest.raises(universal.ConversionError, match=r"1 frozen parameter\(s\) \(bias\)"):
        universal.load(engine, step_dir)


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
