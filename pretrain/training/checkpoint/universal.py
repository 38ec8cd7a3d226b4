"""Resuming a checkpoint on another number of ranks, with DeepSpeed's universal checkpoints.

A ZeRO checkpoint holds one optimizer partition per rank, so DeepSpeed loads it only on the
world size that wrote it. DeepSpeed's `ds_to_universal` rewrites it as one file per parameter
and state (`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), which an engine built with
`"checkpoint": {"load_universal": true}` loads on any number of ranks and any ZeRO stage.

Layout (beside checkpoint/store.py's):
    <out>/checkpoints/step00001000/      the checkpoint, as `checkpoint.save` wrote it
        universal/                       its converted copy: `universal_dir(step_dir)`
            mp_rank_00_model_states.pt   (ZeRO-3: zero_pp_rank_<r>_mp_rank_00_model_states.pt, one per
                                         saved rank) DeepSpeed's model states, copied: the lr scheduler,
                                         global_steps/samples, skipped_steps, client state ("step")
            zero/optimizer_state.pt      the optimizer's param groups (lr, betas, weight_decay, ...)
            zero/<param>/fp32.pt ...     each parameter's fp32 weight, exp_avg, exp_avg_sq, step
                                         (a Muon matrix: momentum_buffer, muon_universal.py)
            SOURCE.json                  what it was made from: written last, before the rename
        .universal.tmp<pid>/             a conversion in progress (never loaded; removed by the next one)
        universal.log                    the last conversion's output
Inside the step directory, the copy is pruned with its checkpoint (checkpoint.save removes old
tags whole) and is found by `engine.load_checkpoint(str(step_dir), tag="universal")`: DeepSpeed
reads `<load_dir>/<tag>/*model_states.pt` and, for a universal load, `<load_dir>/<tag>/zero/`.

How the trainer uses it (every rank runs the same code):
    1. before the engine: `needs_universal(step_dir, world)` (the saved ZeRO partitions are not
       this world's); if so the DeepSpeed config gets `with_universal_load(ds)` (DeepSpeed reads
       `checkpoint.load_universal` in `deepspeed.initialize`, not at load time);
    2. rank 0 alone calls `convert(step_dir)` (a complete copy is reused); every rank then meets
       rank 0 in a collective that carries its outcome (`check_ranks(error)` of
       pretrain/distributed/: str(ConversionError) on rank 0, None elsewhere), so that a failure
       stops every rank with rank 0's line. The others wait in it for the whole conversion: the
       process group's timeout (train.dist_timeout_s) must exceed it (measured below). Then every
       rank checks `is_converted(step_dir)` and they agree once more (`check_ranks`): every rank
       must see the copy, on the filesystem the checkpoint is shared on;
    3. every rank: `client = load(engine, step_dir)`; client["step"] is the saved step. Its
       refusals come before DeepSpeed's collectives and are the same on every rank (same model,
       same copy, agreed in step 2).
Measured on 2 CPU cores (micro GRT, 50 k parameters): a conversion takes 3-6 s, nearly all of it
the converter's start (importing DeepSpeed); a reused copy 0.3 ms.
What DeepSpeed restores: weights, Adam moments and step count, param groups (with `load`'s
repairs), the lr scheduler, global_steps/global_samples/skipped_steps, client state; Muon's
momentum is carried by muon_universal.py (the converter runs its `convert_main`). What it does
not (the caller's): our rank<r>_state.pt (RNG, data-loader position), which exists only for the
saved world's ranks (`checkpoint.load` refuses another world size: its file for a new rank is
missing), and frozen parameters (refused, below). Gradient-accumulation micro-step counters
restart at 0, as after any load (a checkpoint is taken at a step boundary).

Pitfalls found (DeepSpeed 0.19.8, tests/training/test_universal_checkpoint.py), and their workarounds here:
- `universal_checkpoint_info`: ZeRO-1/2 conversion asserts it is in the checkpoint, and DeepSpeed
  writes it only when the module has such an attribute (client_state may not carry it: a
  reserved key) -> `convert` passes `--inject_missing_state` (the version only; it names no
  tensor- or pipeline-parallel patterns, and this project has none).
- ds_to_universal (ZeRO-1/2) walks its input folder recursively: a converted copy inside the
  checkpoint, or a leftover temporary, counts as a second model-parallel rank ("model-state file
  count 2 does not match pp_degree=1 * tp_degree=1") -> it reads a staging folder of links to
  DeepSpeed's own files only (our rank<r>_state.pt, config.json, tokenizer.model and COMPLETE
  never reach it).
- it writes `latest_universal` into its output's parent folder -> the output is in the staging
  folder, which is removed; the load names its tag instead.
- its ZeRO-1/2 path runs a process pool when workers > 1 -> it runs as a child process in its
  own session, killed with its whole group on a timeout or an interrupt, and with
  PR_SET_PDEATHSIG (Linux) so that it dies with a killed trainer; the default is workers=1 (no pool).
- ZeRO-3's universal load copies param group 0's hyperparameters into every group, so the
  no-decay group (norms, biases) gets weight decay (measured: weights 3.9e-3 apart from the
  continued run after one step) -> `load` restores each group's own from zero/optimizer_state.pt.
- ZeRO-3's universal load puts one `step` tensor into the state of every group; torch's AdamW
  increments it in place per group, so with two groups it counts two per step and the bias
  correction goes wrong (measured alone: 7.0e-4 after one step; both: 4.4e-3) -> `load` gives
  each state its own copy. Both need two param groups under ZeRO-3: engine.param_groups reads
  ds_shape for it (under `zero.Init` p.dim() is the flat partition's, 1, which put every
  parameter in the no-decay group, so ZeRO-3 runs had no weight decay and one group).
- frozen parameters: a universal load restores only the optimizer's (trainable) parameters and
  skips the module state, so a frozen one keeps its initial value (measured under ZeRO-1: the
  next loss off by 1.5e-2) -> `load` refuses an engine with frozen parameters (this project's
  models have none).
- tied embeddings (lm_head.weight is wte.weight) are one parameter with one name: one
  zero/wte.weight/, nothing to do. ZeRO's padding (ZeRO-1/2: of each flat partition; ZeRO-3: of
  each parameter, sizes not divisible by the world size) is stripped by the conversion and
  re-added by the load: exact.
- a tag rewritten by a resumed run would leave a stale copy -> SOURCE.json records the
  DeepSpeed version and each source file's size and mtime; a copy that does not match is redone.
- ZeRO stage 0 writes no optimizer partitions and needs no conversion (its state is replicated:
  any world size loads it); `needs_universal` is False for it.
- (for dumps, not the checkpoint) under ZeRO-1/2 `safe_get_full_optimizer_state` fails for
  parameters of every group after the first ("exp_avg not found in optimizer state fragment")
  until a load: DeepSpeed links the moments after the first group's first step only.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grt_common.errors import ConfigError
from pretrain.runs.checkpoint_files import ZERO_PARTITION_RE, UnreadableCheckpoint, ranks_that_wrote, read_config
from pretrain.runs.trusted_files import load_weights_only, read_through_all
from pretrain.training.checkpoint.muon_universal import has_momentum, muon_names, restore

if TYPE_CHECKING:
    import deepspeed

UNIVERSAL_TAG = "universal"  # the tag (a folder inside the step directory) `engine.load_checkpoint` gets
SOURCE_FILE = "SOURCE.json"
LOG_FILE = "universal.log"
STAGING_PREFIX = f".{UNIVERSAL_TAG}.tmp"
CONVERTER = 2  # what the copy holds: 2 adds Muon's momentum (a copy made by another is redone)
# DeepSpeed's own files: model states (ZeRO-3: one per rank) and ZeRO optimizer partitions
DS_FILE_RE = re.compile(r"^[^.].*_(model|optim)_states\.pt$")

# The converter, run as `python -c CHILD <parent pid> <optimizer> <ds_to_universal arguments>`: it dies
# with its parent (PR_SET_PDEATHSIG survives exec; a parent gone before the prctl is caught by getppid).
# ds_to_universal, with a Muon run's momentum carried through it (muon_universal.py).
CHILD = """\
import ctypes, os, signal, sys
parent, optimizer = int(sys.argv.pop(1)), sys.argv.pop(1)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit("ds_to_universal: the converting process is gone")
from pretrain.training.checkpoint.muon_universal import convert_main
convert_main(carry_muon=optimizer == "muon")
"""


class ConversionError(UnreadableCheckpoint):
    """A checkpoint that could not be converted or loaded as a universal checkpoint: one line
    naming it ("universal checkpoint of <step_dir>: <problem>"). An UnreadableCheckpoint, so a
    ConfigError: the trainer reports it as one line (exit 2), and `checkpoint.load_agreed`'s
    precheck may pass over the tag like any unreadable one."""

    def __init__(self, step_dir: Path, problem: str) -> None:
        ConfigError.__init__(self, f"universal checkpoint of {step_dir}: {problem}")
        self.tag, self.problem, self.step_dir = step_dir.name, f"as a universal checkpoint: {problem}", step_dir


def universal_dir(step_dir: Path) -> Path:
    """The converted copy of `step_dir`: `<step_dir>/universal/`, pruned with its checkpoint;
    `engine.load_checkpoint(str(step_dir), tag="universal")` loads it."""
    return Path(step_dir) / UNIVERSAL_TAG


def deepspeed_files(step_dir: Path) -> list[Path]:
    """DeepSpeed's own files of a checkpoint (model and optimizer states): what the conversion
    reads and what the copy's freshness is checked against; none of ours."""
    return sorted(p for p in Path(step_dir).iterdir() if DS_FILE_RE.match(p.name) and p.is_file())


def needs_universal(step_dir: Path, world_size: int) -> bool:
    """Whether resuming `step_dir` on `world_size` ranks needs the universal path: a ZeRO
    checkpoint (its optimizer partitions: ZeRO stage 0 writes none) written by another number of
    ranks (`ranks_that_wrote`). Known before the engine is built, as the DeepSpeed config must be
    (`with_universal_load`)."""
    zero = any(ZERO_PARTITION_RE.match(p.name) for p in Path(step_dir).iterdir())
    return zero and ranks_that_wrote(step_dir) != world_size


def with_universal_load(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The merged DeepSpeed config for an engine that loads a universal checkpoint (a copy;
    DeepSpeed reads the switch when the engine is built). Saving is unaffected."""
    ds = copy.deepcopy(ds_config)
    ds["checkpoint"] = {**(ds.get("checkpoint") or {}), "load_universal": True}
    return ds


def _fingerprint(step_dir: Path) -> dict[str, Any]:
    """What a copy is made from: DeepSpeed's version, our converter's and each source file's size and
    mtime (a rewritten tag, or an upgrade of either, makes an existing copy stale)."""
    import deepspeed

    files = {}
    for p in deepspeed_files(step_dir):
        st = p.stat()
        files[p.name] = [st.st_size, st.st_mtime_ns]
    return {"deepspeed": deepspeed.__version__, "converter": CONVERTER, "files": files}


def is_converted(step_dir: Path) -> bool:
    """Whether `step_dir` has a complete, current converted copy (any rank may ask: the copy
    only ever appears whole, by a rename, with SOURCE.json inside)."""
    try:
        marker = json.loads((universal_dir(step_dir) / SOURCE_FILE).read_text())
        return bool(marker == _fingerprint(step_dir))
    except (OSError, ValueError):
        return False


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the converter and its pool workers (its session's process group), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_line(log_path: Path) -> str:
    """The converter's last line of output (its exception, when it failed), for the error."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300].rstrip() if lines else "no output"


def _run_converter(step_dir: Path, source: Path, output: Path, workers: int, timeout_s: float | None) -> None:
    """ds_to_universal from `source` into `output`, as a child process (see CHILD), its output in
    <step_dir>/universal.log; ConversionError when it fails or runs past `timeout_s`."""
    log_path = step_dir / LOG_FILE
    try:  # what the checkpoint was trained with: Muon's state needs carrying (its config.json)
        optimizer = str(read_config(step_dir).get("train", {}).get("optimizer", "adamw"))
    except UnreadableCheckpoint as err:
        raise ConversionError(step_dir, err.problem) from None
    cmd = [sys.executable, "-c", CHILD, str(os.getpid()), optimizer]
    cmd += ["--input_folder", str(source), "--output_folder", str(output)]
    cmd += ["--num_extract_workers", str(workers), "--num_merge_workers", str(workers), "--inject_missing_state"]
    # on the CPU, whatever the node has: the copy is made from files, and the trainer's GPU stays its own
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise ConversionError(step_dir, f"ds_to_universal ran past {timeout_s:g} s (log: {log_path})") from None
        except BaseException:  # an interrupt: no converter outlives the caller
            _kill_group(proc)
            raise
        if workers > 1:
            _kill_group(proc)  # pool workers it may have left (its group outlives it while they live)
    if code != 0:
        raise ConversionError(
            step_dir, f"ds_to_universal failed with exit {code}: {_last_line(log_path)} (log: {log_path})"
        )


def convert(step_dir: Path, workers: int = 1, timeout_s: float | None = None) -> Path:
    """Convert complete checkpoint `step_dir` once (rank 0 only; the others wait, see the module
    docstring) and return its copy, `universal_dir(step_dir)`: load it with
    `engine.load_checkpoint(str(path.parent), tag=path.name)` (what `load` does).

    A current copy is reused. Otherwise the copy is written into `.universal.tmp<pid>/` and
    renamed into place whole, SOURCE.json inside, so that an interrupted conversion (a kill at any
    moment) leaves no copy or the previous one, never a half-written one; its leftovers are removed
    by the next conversion (one converter per checkpoint at a time: the run directory's lock).
    `workers` > 1 parallelises DeepSpeed's extraction and merge (processes). Raises
    ConversionError (one line naming the checkpoint) when the conversion fails."""
    step_dir = Path(step_dir)
    final = universal_dir(step_dir)
    if is_converted(step_dir):
        return final
    if not (step_dir / "COMPLETE").is_file():
        raise ConversionError(step_dir, "it is not a complete checkpoint (no COMPLETE)")
    try:  # intact and data only: the converter's loads are weights-only too (convert_main)
        read_through_all(step_dir)
    except UnreadableCheckpoint as err:
        raise ConversionError(step_dir, err.problem) from None
    staging = step_dir / f"{STAGING_PREFIX}{os.getpid()}"
    try:
        fingerprint = _fingerprint(step_dir)
        if not any(ZERO_PARTITION_RE.match(name) for name in fingerprint["files"]):
            raise ConversionError(step_dir, "it holds no ZeRO optimizer partitions (ZeRO stage 0 needs no conversion)")
        for p in step_dir.iterdir():
            if p.name.startswith(STAGING_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        source, output = staging / "source", staging / UNIVERSAL_TAG
        source.mkdir(parents=True)
        for name in fingerprint["files"]:
            (source / name).symlink_to((step_dir / name).resolve())
        _run_converter(step_dir, source, output, workers, timeout_s)
        if _fingerprint(step_dir) != fingerprint:
            raise ConversionError(step_dir, "its files changed while it was being converted")
        (output / SOURCE_FILE).write_text(json.dumps(fingerprint) + "\n")
        if final.exists():  # stale: moved aside in one rename, so no moment shows a half-removed copy
            final.rename(staging / "stale")
        output.rename(final)
    except OSError as err:
        raise ConversionError(step_dir, f"could not write its converted copy ({type(err).__name__}: {err})") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def saved_param_groups(step_dir: Path) -> list[dict[str, Any]]:
    """The optimizer's param groups as saved (lr, betas, eps, weight_decay, ... of each group),
    from the copy's zero/optimizer_state.pt."""
    state = load_weights_only(universal_dir(step_dir) / "zero" / "optimizer_state.pt", step_dir.name)
    return list(state["param_groups"])


def load(engine: deepspeed.DeepSpeedEngine, step_dir: Path) -> dict[str, Any]:
    """Load the converted copy of `step_dir` into `engine` (every rank; built with
    `with_universal_load`) and return DeepSpeed's client state (client["step"]: the saved step).
    Repairs what ZeRO-3's universal load gets wrong (each group's hyperparameters, one step
    counter shared by all groups) and refuses an engine with frozen parameters, which it would
    leave at their initial values. Raises ConversionError (before any collective where it can)."""
    step_dir = Path(step_dir)
    if not engine.load_universal_checkpoint():
        raise ConversionError(step_dir, 'the engine was built without "checkpoint": {"load_universal": true}')
    frozen = [name for name, p in engine.module.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConversionError(
            step_dir,
            f"{len(frozen)} frozen parameter(s) ({', '.join(frozen[:3])}) would keep their initial values: a "
            "universal load restores only the optimizer's parameters",
        )
    if not is_converted(step_dir):
        raise ConversionError(step_dir, "it has no complete converted copy on this rank (convert it on rank 0 first)")
    saved = saved_param_groups(step_dir)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer inside ZeRO's wrapper
    if len(saved) != len(base.param_groups):
        raise ConversionError(
            step_dir, f"it was saved with {len(saved)} optimizer param groups, the engine has {len(base.param_groups)}"
        )
    muon = muon_names(engine)
    if not has_momentum(universal_dir(step_dir) / "zero", muon):
        raise ConversionError(step_dir, "its copy holds no Muon momentum for this train.optimizer=muon engine")
    path, client = engine.load_checkpoint(
        str(step_dir), tag=UNIVERSAL_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise ConversionError(step_dir, "DeepSpeed could not load it")
    for group, was in zip(base.param_groups, saved):  # each group's own keys only
        params = group["params"]
        group.clear()
        group.update({**was, "params": params})
    for state in base.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
    if muon:
        restore(engine, universal_dir(step_dir) / "zero")
    return dict(client or {})
