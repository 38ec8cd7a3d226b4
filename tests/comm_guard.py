"""Run a `grt` command as if its process group were NCCL on a GPU, on a CPU-only host.

    python tests/comm_guard.py VIOLATIONS_FILE <grt arguments...>
    python tests/comm_guard.py VIOLATIONS_FILE -m <module> <arguments...>   (e.g. launcher.probe)

CI has no GPU, so a collective on a tensor that is not on the communication device (NCCL:
"No backend type associated with device type cpu") would pass every CPU test. Here, once a
process group exists, `pretrain.distributed.comm_device()` answers a device that is not the
CPU, where the model, the data and every tensor made without a device live. Tensors created
on it, or moved to it, are CPU tensors wrapped in `OnCommDevice`, which reports that device
and, like a CUDA tensor, refuses to mix with CPU tensors (0-dim ones excepted, as CUDA does),
to `.numpy()`, and so on. Every collective
reached from project code, through the helpers or straight through torch.distributed,
must get tensors on that device: any other is written to VIOLATIONS_FILE and raised.
The stand-in device is "meta" (the one device besides the CPU that a CPU-only torch can
name on a tensor): code that derives its control tensors' device from comm_device() works,
code that assumes the CPU (or "cuda", or the model's device) fails, as it would under NCCL.
DeepSpeed's own collectives pass: under NCCL their tensors are the model's, on the GPU.
The gloo process group underneath does the real work on the wrapped CPU tensors.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

import pretrain.distributed as pd  # noqa: E402
import pretrain.distributed.collectives as collectives  # noqa: E402

COMM = torch.device("meta")
VIOLATIONS = sys.argv[1]
REAL_COMM_DEVICE = pd.comm_device
REAL_ALL_REDUCE = pd.all_reduce


def _on_comm(device) -> bool:
    return device is not None and not isinstance(device, torch.dtype) and torch.device(device) == COMM


class OnCommDevice(torch.Tensor):
    """A CPU tensor that says it lives on COMM."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # intentionally replaces Tensor's classmethod: no torch-function handling on the wrapper

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=COMM,
            requires_grad=False,
        )
        r.elem = elem
        return r

    def __repr__(self):
        return f"OnCommDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        cpu = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, OnCommDevice) and t.dim() > 0]
        if cpu and func is not torch.ops.aten.copy_.default:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{COMM} and cpu! ({func})"
            )
        originals = {id(t.elem): t for t in leaves if isinstance(t, OnCommDevice)}
        unwrap = lambda t: t.elem if isinstance(t, OnCommDevice) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        to_cpu = (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        )

        def wrap(t):
            if not isinstance(t, torch.Tensor) or to_cpu:
                return t
            if id(t) in originals:
                return originals[id(t)]
            return t if any(t is x for x in leaves) else OnCommDevice(t)

        return tree_map(wrap, out)


def _moved(t: torch.Tensor) -> torch.Tensor:
    return t if isinstance(t, OnCommDevice) else OnCommDevice(t.detach().clone())


class CommDeviceMode(TorchFunctionMode):
    """Factories with device=COMM and moves to COMM make OnCommDevice tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return _moved(args[0])
        if func is torch.Tensor.to:
            rest, options = list(args[1:]), dict(kwargs)
            target = options.pop("device", None)
            for i, a in enumerate(rest):
                if isinstance(a, (str, torch.device)):
                    target = rest.pop(i)
                    break
            if _on_comm(target):
                return _moved(args[0].to(*rest, **options))
            if isinstance(args[0], OnCommDevice) and target is not None:
                return args[0].elem.to(target, *rest, **options).clone()
            return func(*args, **kwargs)
        if func is torch.Tensor.tolist and isinstance(args[0], OnCommDevice):
            return args[0].elem.tolist()
        if _on_comm(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return _moved(func(*args, **kwargs))
        return func(*args, **kwargs)


def violation(what: str, tensors) -> None:
    bad = [str(t.device) for t in tensors if isinstance(t, torch.Tensor) and t.device != COMM]
    if not bad:
        return
    where = "".join(traceback.format_stack(limit=6)[:-2])
    with open(VIOLATIONS, "a") as f:
        f.write(f"{what}: tensor(s) on {', '.join(bad)}, not on the communication device {COMM}\n{where}\n")
    raise RuntimeError(f"comm guard: {what} got a tensor on {bad[0]}, not on the communication device {COMM}")


def comm_device():
    return COMM if dist.is_initialized() else REAL_COMM_DEVICE()


def all_reduce(t, op="sum"):
    if dist.is_initialized():
        violation("pretrain.distributed.all_reduce", [t])
    return REAL_ALL_REDUCE(t, op)


def guard_collective(name: str):
    real = getattr(dist, name)

    def collective(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        leaves, _ = tree_flatten((args, kwargs))
        if not caller.startswith(("deepspeed", "torch")):
            violation(f"torch.distributed.{name} (from {caller})", leaves)
        unwrap = lambda t: t.elem if isinstance(t, OnCommDevice) else t  # noqa: E731
        return real(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    return collective


COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)


def main() -> int:
    open(VIOLATIONS, "w").close()
    # in the package and in the module that defines them (its own callers), before any command module imports them
    for module in (pd, collectives):
        module.comm_device, module.all_reduce = comm_device, all_reduce  # type: ignore[attr-defined]
    for name in COLLECTIVES:
        setattr(dist, name, guard_collective(name))
    if sys.argv[2] == "-m":
        import importlib

        command, argv = importlib.import_module(sys.argv[3]).main, sys.argv[4:]
    else:
        from pretrain.cli import dispatch as command

        argv = sys.argv[2:]
    with CommDeviceMode():
        return pd.run_command(command, argv)


if __name__ == "__main__":
    sys.exit(main())
