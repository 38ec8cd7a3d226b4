"""What a file from elsewhere may hold: nothing read from a checkpoint runs.

Every `*.pt` file of a checkpoint, this project's and DeepSpeed's, is unpickled by torch's weights-only
unpickler (tensors, Python's plain containers and numbers, and SAVED_TYPES): every entry point sets
torch's switch for its whole process (`forbid_code_in_files`: DeepSpeed's own loads, which pass
weights_only=False, included), every load runs inside `weights_only_loads` (also where no entry point
set it), and each file is read through before a reader that does not check it loads it
(`read_through`), so that a file holding anything else is refused in one line naming it and the type.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grt_common.errors import one_line
from pretrain.runs.checkpoint_files import UnreadableCheckpoint, error_text

# Nothing read from a checkpoint runs: every `*.pt` is unpickled by torch's weights-only unpickler, which
# builds tensors, Python's plain containers and numbers, and the types below only (what DeepSpeed's and
# this project's files hold: the loss scaler, ZeRO's stage, a ZeRO-1/2 partition's slice addresses, a
# numpy RNG state; numpy 1.x names its array builder numpy.core). A file that needs another is refused.
SAVED_TYPES = {
    "numpy.ndarray": "numpy.ndarray",
    "numpy.dtype": "numpy.dtype",
    "numpy._core.multiarray._reconstruct": "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct": "numpy._core.multiarray._reconstruct",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address": "deepspeed.utils.tensor_fragment.fragment_address",
}
# torch's switch that makes every torch.load weights-only, DeepSpeed's own weights_only=False included
WEIGHTS_ONLY_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def _saved_type(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _allowed_types(deepspeed: bool) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """SAVED_TYPES as torch's allowlist wants them, with numpy's numeric dtype classes (numpy.dtypes.*DType:
    an array's element type); DeepSpeed's only where `deepspeed` (importing it costs seconds and
    prints its accelerator's line: a command that reads only this project's files does not)."""
    import numpy as np

    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]]
    names = [name for name in SAVED_TYPES if deepspeed or not name.startswith("deepspeed.")]
    allowed = [(_saved_type(SAVED_TYPES[name]), name) for name in names]
    dtypes = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}
    return allowed + [(t, f"{t.__module__}.{t.__name__}") for t in dtypes]


def _allow(deepspeed: bool) -> None:
    import torch

    torch.serialization.add_safe_globals(_allowed_types(deepspeed))


def forbid_code_in_files() -> None:
    """Every torch.load of this process and its children from now on is weights-only: torch's
    environment switch, which overrides even DeepSpeed's explicit weights_only=False. Set first by
    every entry point (`grt`, a rank's start, the converter); cheap (torch is not imported). A load
    outside `weights_only_loads` then refuses SAVED_TYPES too: it fails closed."""
    os.environ[WEIGHTS_ONLY_ENV] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # both set: torch refuses every load


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within: every torch.load is weights-only (`forbid_code_in_files`) with SAVED_TYPES allowed,
    also in a process whose entry point did not say so (a test, a library caller); the switch is
    put back after. Every load of a checkpoint, this project's and DeepSpeed's, runs inside one."""
    _allow("deepspeed" in sys.modules)  # DeepSpeed's own loads run where it is imported
    before = os.environ.get(WEIGHTS_ONLY_ENV)
    forbid_code_in_files()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WEIGHTS_ONLY_ENV, None)


def refused_content(err: BaseException) -> str | None:
    """What torch's weights-only unpickler refused, in a few words (the type it names), or None
    where `err` is no such refusal."""
    import pickle

    if not isinstance(err, pickle.UnpicklingError) or "Weights only load failed" not in str(err):
        return None
    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"but got <class '([\w.]+)'>", text)
    if named:
        return f"the type {named.group(1)}"
    why = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    return f"pickle that the weights-only reader refuses ({why.group(1).strip() if why else 'not plain data'})"


def load_weights_only(path: Path, tag: str, *, mmap: bool = False) -> Any:
    """torch.load of one checkpoint file with the weights-only unpickler (`weights_only_loads`):
    UnreadableCheckpoint (one line naming the file and what it holds) for a file that holds
    anything else, or that is cut off or corrupt. mmap: its tensors mapped, not read (a check of
    what the file holds)."""
    import warnings

    import torch

    for attempt in range(2):
        try:
            with weights_only_loads(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's word on a pickle protocol it did not write
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
        except Exception as err:  # torch reports a cut-off or corrupt file as RuntimeError, pickle errors, EOFError
            refused = refused_content(err)
            if refused is None:
                raise UnreadableCheckpoint(tag, f"{path.name} is cut off or corrupt ({one_line(err)[:300]})") from None
            if attempt == 0 and refused.removeprefix("the type ") in SAVED_TYPES:  # DeepSpeed's: allowed, then again
                _allow(deepspeed=True)
                continue
            raise UnreadableCheckpoint(tag, untrusted(path, refused)) from None
    raise AssertionError("unreachable: the second attempt returns or raises")


def read_through(path: Path, tag: str) -> None:
    """Check one `*.pt` file of checkpoint `tag` before anything loads it: a whole zip archive of
    intact members (torch.save's format; a truncated file has lost its central directory, a corrupt
    one fails its CRC, which torch.load does not check) that holds data only (`load_weights_only`,
    its tensors mapped, not read). UnreadableCheckpoint (one line) for the first problem. A file in
    torch's legacy pickle format has no checksums; what it holds is checked all the same."""
    try:
        with open(path, "rb") as fh:
            legacy = fh.read(2) == b"\x80\x02" and not zipfile.is_zipfile(path)
        if not legacy:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            if bad is not None:
                raise UnreadableCheckpoint(tag, f"{path.name} is corrupt (CRC mismatch in {bad})")
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as err:
        raise UnreadableCheckpoint(tag, f"{path.name} is cut off or corrupt ({error_text(err, '')})") from None
    load_weights_only(path, tag, mmap=True)


def state_files(step_dir: Path) -> list[str]:
    """The names of a checkpoint's `*.pt` files (a killed writer's temporaries left out)."""
    from grt_common.files import is_temp

    return sorted(p.name for p in step_dir.iterdir() if p.name.endswith(".pt") and not is_temp(p.name))


def read_through_all(step_dir: Path) -> None:
    """Every `*.pt` file of checkpoint `step_dir` read through (`read_through`), before a reader that
    does not check them (DeepSpeed's zero_to_fp32) loads them. UnreadableCheckpoint (one line)."""
    for name in state_files(step_dir):
        read_through(step_dir / name, step_dir.name)


def untrusted(path: Path, refused: str) -> str:
    """The refusal of a file that holds more than data (`refused`: what), as the checkpoint's problem."""
    return (
        f"{path} holds {refused}, which no checkpoint holds (only tensors, numbers and containers): it "
        "could run code when read, so it was refused and nothing of it was run"
    )
