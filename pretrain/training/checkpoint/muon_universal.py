"""Muon's momentum through a universal checkpoint (checkpoint/universal.py), whose converter and
loaders DeepSpeed wrote for Adam's state alone.

A Muon group's optimizer state, as DeepSpeed 0.19.8 saves it, is `{"momentum_buffer"}`:
- ZeRO-3: one flat tensor laid out as the sub-group's fp32 partition (each parameter's slice on
  this rank, padded), like Adam's exp_avg;
- ZeRO-1/2: the whole of every parameter the rank's partition touches, one after another, in the
  partition's order (Newton-Schulz needs whole matrices; a parameter split between two ranks is
  whole, and the same, on both); with the optimizer offloaded to the CPU, the fp32 partition's
  layout, like ZeRO-3's.
`ds_to_universal` reads exp_avg and exp_avg_sq of every group (KeyError on Muon's), and ZeRO-3's
universal load reads exp_avg.pt and exp_avg_sq.pt of every parameter. So:
- `prepare` (in the converter's process, on its staging copy of the source) gives a Muon group
  Adam's two keys before ds_to_universal runs: in the partition's layout, exp_avg is the momentum
  itself (DeepSpeed's own extraction and merge carry it); in ZeRO-1/2's whole-matrix layout, zeros,
  each parameter's whole momentum written aside; exp_avg_sq is zeros;
- `finish` then writes each Muon parameter's `zero/<name>/momentum_buffer.pt` in the copy, in the
  format of its fp32.pt, and leaves zeros in its exp_avg.pt and exp_avg_sq.pt (read, then dropped);
- `restore` (every rank, after the engine's load) gives each Muon group of the loading engine its
  state back as `{"momentum_buffer"}` in that engine's layout (stage and world size).
`has_momentum` tells a copy made before (without momentum_buffer.pt) from one with it.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pretrain.runs.checkpoint_files import ZERO_PARTITION_RE
from pretrain.runs.trusted_files import forbid_code_in_files, refused_content, weights_only_loads

if TYPE_CHECKING:
    import deepspeed

MOMENTUM = "momentum_buffer"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
PARAM = "param"  # deepspeed.checkpoint.constants.PARAM: the tensor in a universal file's dict


def _is_muon(state: dict[str, Any]) -> bool:
    return MOMENTUM in state and not any(key in state for key in ADAM_KEYS)


def _tensor(saved: Any) -> torch.Tensor:
    """The tensor of a universal file: a dict holding it (ZeRO-1/2's converter) or itself (ZeRO-3's)."""
    return saved[PARAM] if isinstance(saved, dict) else saved


def _model_states(source: Path, rank: int) -> Path:
    """The model-states file that lists rank `rank`'s parameter shapes: ZeRO-3's own one, ZeRO-1/2's
    one for all ranks."""
    files = sorted(source.glob(f"zero_pp_rank_{rank}_mp_rank_*_model_states.pt"))
    files = files or sorted(source.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ValueError(f"no model-states file in {source}")
    return files[0]


@functools.cache  # ZeRO-1/2's one file holds the weights too: read once, not once per rank
def _param_shapes(model_states: Path) -> list[dict[str, Any]]:
    """The saved model's parameter shapes by group."""
    return list(torch.load(model_states, map_location="cpu", weights_only=True)["param_shapes"])


def _aside_zero12(optim: dict[str, Any], shapes: list[dict[str, Any]], aside: Path) -> set[str]:
    """ZeRO-1/2: each Muon group's momentum cut into its parameters' whole momenta (aside/<name>.pt),
    the group's state given Adam's keys as zeros. Returns the parameters' names."""
    names: set[str] = set()
    states = optim["base_optimizer_state"]["state"]
    for group, state in states.items():
        if not _is_muon(state):
            continue
        momentum = state.pop(MOMENTUM).reshape(-1)
        mapping = optim["param_slice_mappings"][group]
        ordered = sorted(mapping, key=lambda name: mapping[name].start)  # the partition's order
        numels = [int(torch.Size(shapes[group][name]).numel()) for name in ordered]
        flat, whole = optim["single_partition_of_fp32_groups"][group], sum(numels)
        names.update(ordered)
        if momentum.numel() != whole and momentum.numel() == flat.numel():
            # CPU offload keeps the momentum as the fp32 partition (its own layout): carried as exp_avg
            state.update(exp_avg=momentum, exp_avg_sq=torch.zeros_like(momentum))
            continue
        if momentum.numel() != whole:
            raise ValueError(f"Muon momentum of group {group} holds {momentum.numel()} values, its parameters {whole}")
        for name, start, numel in zip(ordered, itertools.accumulate([0, *numels]), numels):
            if not (aside / f"{name}.pt").exists():  # one rank's copy: a shared parameter's are the same
                torch.save(momentum[start : start + numel].clone(), aside / f"{name}.pt")
        state.update({key: torch.zeros_like(flat, dtype=torch.float32) for key in ADAM_KEYS})
    return names


def _carry_zero3(optim: dict[str, Any], shapes: list[dict[str, Any]]) -> set[str]:
    """ZeRO-3: each Muon sub-group's momentum carried as its exp_avg (the same layout), exp_avg_sq
    zeros. Returns the parameters' names."""
    names: set[str] = set()
    for group, state in optim["optimizer_state_dict"]["state"].items():
        if _is_muon(state):
            momentum = state.pop(MOMENTUM)
            state.update(exp_avg=momentum, exp_avg_sq=torch.zeros_like(momentum))
            names.update(shapes[group])
    return names


def prepare(source: Path, aside: Path) -> set[str]:
    """Rewrite the converter's source (a folder of links to the checkpoint's files) so that
    ds_to_universal reads a Muon checkpoint: each optimizer file holding Muon's momentum is replaced
    by a rewritten copy (the link, not its target). Returns the Muon parameters' names (none for a
    checkpoint without Muon's state)."""
    names: set[str] = set()
    for path in sorted(source.iterdir()):
        match = ZERO_PARTITION_RE.match(path.name)
        if not match:
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True)
        optim = saved["optimizer_state_dict"]
        stage3 = "fp32_flat_groups" in optim
        states = (optim["optimizer_state_dict"] if stage3 else optim["base_optimizer_state"])["state"]
        if not any(_is_muon(state) for state in states.values()):
            continue
        shapes = _param_shapes(_model_states(source, int(match.group(1))))
        if stage3:
            names |= _carry_zero3(optim, shapes)
        else:
            aside.mkdir(exist_ok=True)
            names |= _aside_zero12(optim, shapes, aside)
        path.unlink()
        torch.save(saved, path)
    return names


def finish(output: Path, aside: Path, names: set[str]) -> None:
    """Write each Muon parameter's momentum_buffer.pt into the converted copy `output` (see the
    module docstring): its whole momentum set aside, or the exp_avg that carried it; its exp_avg.pt
    and exp_avg_sq.pt are left as zeros."""
    for name in sorted(names):
        folder = output / "zero" / name
        if not (aside / f"{name}.pt").exists():
            os.replace(folder / "exp_avg.pt", folder / f"{MOMENTUM}.pt")
            shutil.copyfile(folder / "exp_avg_sq.pt", folder / "exp_avg.pt")
            continue
        like = torch.load(folder / "fp32.pt", map_location="cpu", weights_only=True)
        weight = _tensor(like)
        momentum = torch.load(aside / f"{name}.pt", map_location="cpu", weights_only=True).view(weight.shape)
        torch.save({**like, PARAM: momentum} if isinstance(like, dict) else momentum, folder / f"{MOMENTUM}.pt")


def convert_main(carry_muon: bool) -> None:
    """The converter's process: ds_to_universal (its arguments from sys.argv, as its own), for a
    Muon run's checkpoint with `prepare` before and `finish` after (an AdamW one's optimizer
    partitions are read by ds_to_universal alone, once)."""
    from deepspeed.checkpoint import ds_to_universal

    forbid_code_in_files()  # its pool workers too: nothing read from the checkpoint runs
    args = ds_to_universal.parse_arguments()
    try:
        with weights_only_loads():
            if not carry_muon:
                ds_to_universal.main(args)
                return
            source, output = Path(args.input_folder), Path(args.output_folder)
            aside = source.parent / "muon_momentum"
            names = prepare(source, aside)
            ds_to_universal.main(args)
            finish(output, aside, names)
    except pickle.UnpicklingError as err:  # its last line is the parent's word for the failure
        refused = refused_content(err)
        if refused is None:
            raise
        sys.exit(f"ds_to_universal: a file of {args.input_folder} holds {refused}: refused, nothing of it was run")


def muon_names(engine: deepspeed.DeepSpeedEngine) -> list[str]:
    """The names of the engine's parameters that Muon updates (DeepSpeed's `use_muon` tag, set when
    the engine was built; none for an AdamW engine)."""
    return [name for name, p in engine.module.named_parameters() if getattr(p, "use_muon", False)]


def has_momentum(zero_dir: Path, names: list[str]) -> bool:
    """Whether the copy's `zero/` holds the momentum of every named parameter."""
    return all((zero_dir / name / f"{MOMENTUM}.pt").is_file() for name in names)


def restore(engine: deepspeed.DeepSpeedEngine, zero_dir: Path) -> None:
    """After `engine.load_checkpoint` of a universal copy: each Muon group's state back to
    `{"momentum_buffer"}` in this engine's layout, from the copy's momentum_buffer.pt files
    (DeepSpeed's load left Adam's zeros there, and ZeRO-1/2's a momentum in the fp32 partition's
    layout)."""
    zero = engine.optimizer
    base = zero.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: DeepSpeed's own slicing of each parameter
        for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
            if not zero.sub_groups_using_muon[i]:
                continue
            momentum, offset = torch.zeros_like(flat), 0
            for p in zero.fp16_groups[i]:
                part = zero.load_hp_checkpoint_state(str(zero_dir / zero.param_names[p]), MOMENTUM, param=p)
                momentum.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
            base.state[flat] = {MOMENTUM: momentum}
        return
    for index, group in enumerate(base.param_groups):
        if not group.get("use_muon"):
            continue
        flat = group["params"][0]
        if zero.cpu_offload:  # the fp32 partition's layout, as DeepSpeed's load made it
            base.state[flat] = {MOMENTUM: base.state[flat][MOMENTUM]}
            continue
        files = [zero_dir / zero.param_names[p] / f"{MOMENTUM}.pt" for p in zero.params_in_partition[index]]
        whole = [_tensor(torch.load(f, map_location="cpu", weights_only=True)) for f in files]
        base.state[flat] = {MOMENTUM: torch.cat([m.reshape(-1) for m in whole]).to(flat.device, torch.float32)}
