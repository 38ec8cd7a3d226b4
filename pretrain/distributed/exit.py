"""The one exit path of every process that started a process group (`exit_process`), and
`run_command`, which takes each command through it (docs/gpu.md says why)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from pretrain.distributed.discovery import RendezvousError


def _group_exists() -> bool:
    # without importing torch: `grt presets` and the data commands never load it
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


# Seconds exit_process waits for the process group to shut down (NCCL's destroy can wait
# forever on work still in flight) before it ends the process anyway.
EXIT_GRACE_S = 10.0


def exit_process(code: int) -> int:
    """The one exit path of a process that created a process group: shut the group down
    (waiting at most EXIT_GRACE_S), finalize MPI, flush, and end the process here with
    `code`. At interpreter exit the group's communication threads are still joinable, and
    C++ destroys them ("terminate called without an active exception", exit -6), which
    hides the real exit code from the launcher. Without a process group: returns `code`."""
    import threading

    if not _group_exists():
        return code
    import torch.distributed as dist

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone; the exit code is what matters
            pass

    shutdown = threading.Thread(target=destroy, name="grt-exit", daemon=True)
    shutdown.start()
    shutdown.join(EXIT_GRACE_S)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # mpirun counts a rank that exits without MPI_Finalize as failed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code(err: BaseException) -> int:
    if isinstance(err, SystemExit):
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        print(err.code, file=sys.stderr)
        return 1
    if isinstance(err, KeyboardInterrupt):
        return 130
    traceback.print_exception(err)
    return 1


def run_command(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's `main(argv)` as the process entry (the `grt` dispatcher, and every
    `python -m` module that may start a process group): its exit code, exception included,
    goes through exit_process, so no command can forget it. Without a process group it
    returns the code (or lets the exception through), so in-process callers are unaffected;
    a RendezvousError that a command does not catch itself becomes its one line and exit 2."""
    try:
        code = main(argv) or 0
    except RendezvousError as err:  # a command that lets it through (the probe): still one line, exit 2
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except BaseException as err:  # noqa: BLE001 - the process ends here with its exit code
        if not _group_exists():
            raise
        code = _exit_code(err)
    return exit_process(code)
