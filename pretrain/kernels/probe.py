"""Which fused paths run in this process: each tried once on a tiny input, before it is used.

The fused paths (the Triton gate, the compiled loss chunk, the GEMMs with an fp32 result, flash-attn)
need more than torch: Triton builds its launcher with a C compiler and Python's headers at first use,
inductor does the same for every compiled kernel, and a kernel may be missing for the GPU or the
torch at hand. A path whose trial fails is turned off for the process with one warning naming what is
missing and what the fallback costs, and the run goes on with the eager path.

Each module registers its own path (`register_fused_path`): its name, what turning it off costs, where it
applies (the static check: CUDA, the package installed) and its trial. `fused_path_works` is the check each
path's dispatch asks; its first call on a device runs the trial (outside any compiled graph: inside
one, an untried path counts as working, as the static check says). `probe_fused_paths` runs every
trial that applies at start-up (the trainer's engine build), so that the trials' device reads happen
once, before the first step, and never in a step.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedPath:
    name: str  # what runs, for the warning: "the fused gate kernel (Triton)"
    cost: str  # what its fallback costs
    applies: Callable[[torch.device], bool]  # the static check: whether the path would run on this device
    trial: Callable[[torch.device], None]  # the path on a tiny input; raises when it cannot run


PATHS: dict[str, FusedPath] = {}
_works: dict[tuple[str, str], bool] = {}  # (path, device) -> the trial's verdict, once per process


def register_fused_path(key: str, path: FusedPath) -> None:
    PATHS[key] = path


def fused_path_works(key: str, device: torch.device) -> bool:
    """Whether path `key` may run on `device`: its trial's verdict, the trial run at the first call."""
    verdict = _works.get((key, _name(device)))
    if verdict is not None:
        return verdict
    if torch.compiler.is_compiling():
        return True  # not tried yet and inside a trace: the static check stands (the trainer tries first)
    return _try(key, device)


def _try(key: str, device: torch.device) -> bool:
    path = PATHS[key]
    try:
        path.trial(device)
        ok = True
    except Exception as error:  # noqa: BLE001 - whatever fails, the path is off and the run goes on
        log.warning(
            "%s is off on %s: its trial on a tiny input failed (%s); missing: %s. Cost: %s",
            path.name,
            device,
            first_line(error),
            missing(error),
            path.cost,
        )
        ok = False
    _works[(key, _name(device))] = ok
    return ok


def _name(device: torch.device) -> str:
    """'cuda' as the tensors' own name for it, 'cuda:N' (the current device): one verdict per GPU."""
    if device.type == "cuda" and device.index is None and not torch.compiler.is_compiling():
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def probe_fused_paths(device: torch.device) -> dict[str, bool]:
    """Every registered path that applies on `device`, tried now (once per process): the verdicts."""
    return {key: fused_path_works(key, device) for key, path in PATHS.items() if path.applies(device)}


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def python_headers() -> str:
    """Where the C builds look for Python.h (Triton's launcher, inductor's CPU kernels)."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    return sysconfig.get_paths(scheme=scheme)["include"]


def missing(error: BaseException) -> str:
    """What the environment lacks, read from the error and the machine (the causes seen: no C
    compiler, no Python headers, no kernel for the GPU); else what failed."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and id(e) not in seen:  # the cause chain: inductor wraps the build's error
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(f"{type(x).__name__}: {x}" for x in chain)
    if "Failed to find C compiler" in text:  # Triton's launcher build
        return "a C compiler (gcc or clang on PATH, or CC naming one)"
    if "Failed to find C++ compiler" in text or "No working C++ compiler" in text:  # Triton's, inductor's
        return "a C++ compiler (g++ or clang++ on PATH, or CXX naming one)"
    for x in chain:
        if isinstance(x, FileNotFoundError) and x.filename and x.filename in {os.environ.get("CC"), "gcc", "cc"}:
            return f"a C compiler (CC={os.environ.get('CC')!r} does not exist)"
    if any(isinstance(x, subprocess.CalledProcessError) for x in chain) or "Python.h" in text:
        if not os.path.isfile(os.path.join(python_headers(), "Python.h")):
            return f"Python's headers (no Python.h in {python_headers()}: the python3-dev package)"
        return "a C build that succeeds (the compiler's own output is above)"
    if "no kernel image" in text or "not compiled for" in text or "sm_" in text:
        return "a kernel built for this GPU"
    if "Could not run" in text and "backend" in text:  # the dispatcher: the op has no kernel on this device
        return "a kernel of this op for this device in this torch"
    return "a working build of this path"
