"""The one exit path of every process that started a process group (`exit_process`), and
`run_command`, which takes each command through it (docs/gpu.md says why) and is every
command's error boundary (docs/reliability.md, "One error boundary per command"): a
file-system refusal (a full disk, a read-only or missing parent, a path of the wrong kind)
is one line naming the path, exit 2; Ctrl-C (SIGINT) and SIGTERM are one line naming the signal,
exit 128 + its number (130, 143), after the command undid what it wrote (`Interrupted`); a
`ConfigError` a command let through is its one line, exit 2; `Stopped` (a run stopped with its last
checkpoint intact: a bad-step limit, a failed save, a full disk mid-run) is `stopped: ...`, exit 3.
GRT_DEBUG=1 prints the traceback first."""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from grt_common.errors import ConfigError, Interrupted, Stopped, file_system_problem
from pretrain.distributed.discovery import RendezvousError

DEBUG_ENV = "GRT_DEBUG"  # GRT_DEBUG=1: the boundary prints the traceback before its one line
VERDICTS_ENV = "GRT_RANK_VERDICTS"  # a folder where each rank's exit code is left (`grt launch` reads them)


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
    hides the real exit code from the launcher. Without a process group: returns `code`. Under
    `grt launch` (VERDICTS_ENV set), the rank's code is left in its file first: the launch ends with
    the ranks' verdict, not with the exit code of the launcher between them (torchrun says 1)."""
    leave_verdict(code)
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


def leave_verdict(code: int) -> None:
    folder, rank = os.environ.get(VERDICTS_ENV), os.environ.get("RANK")
    if folder and rank is not None and rank.isdigit():
        try:
            with open(os.path.join(folder, f"rank{rank}"), "w") as fh:
                fh.write(f"{code}\n")
        except OSError:  # the launch's folder gone: its verdict falls back to the launcher's code
            pass


def _exit_code(err: BaseException) -> int:
    if isinstance(err, SystemExit):
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        print(err.code, file=sys.stderr)
        return 1
    traceback.print_exception(err)
    return 1


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextmanager
def _boundary(threads: list[tuple[BaseException, tuple[str, int]]]) -> Iterator[None]:
    """While the command runs: SIGINT and SIGTERM raise `Interrupted` (where Python's own handler
    is in place, in the main thread: a command's own handler, such as training's, replaces it), and a
    thread's error of `boundary_line` (TensorBoard's writer on a full disk) is kept in `threads` with
    its line and code, not
    printed as a traceback: run_command says its one line at the end when the command itself ended
    well; a command that failed said its own line (often the same error raised again, or training
    stopping on it), and one line is what a failure says."""
    previous_hook = threading.excepthook

    def thread_error(args: threading.ExceptHookArgs) -> None:
        err = args.exc_value
        handled = boundary_line(err) if err is not None else None
        if err is None or handled is None:
            previous_hook(args)
            return
        threads.append((err, handled))

    threading.excepthook = thread_error
    main = threading.current_thread() is threading.main_thread()
    # an ignored signal (inherited from a `nohup` or a background job) stays ignored
    own = {
        sig: previous
        for sig, previous in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))
        if main and signal.getsignal(sig) is previous
    }
    for sig in own:
        signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        threading.excepthook = previous_hook
        for sig, previous in own.items():
            if signal.getsignal(sig) is _raise_interrupted:  # not replaced by the command's own
                signal.signal(sig, previous)


def _say(prog: str, line: str, err: BaseException) -> None:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(err)
    print(f"{prog}: {line}", file=sys.stderr, flush=True)


def boundary_line(err: BaseException) -> tuple[str, int] | None:
    """The one line and exit code of an error the boundary handles, None for any other."""
    if isinstance(err, KeyboardInterrupt):
        name = err.signal_name if isinstance(err, Interrupted) else "SIGINT"
        return f"interrupted by {name}", 128 + signal.Signals[name].value
    if isinstance(err, ConfigError):
        return f"error: {err}", 2
    if isinstance(err, Stopped):
        return f"stopped: {err}", 3
    problem = file_system_problem(err)
    return (f"error: {problem}", 2) if problem is not None else None


def run_command(
    main: Callable[[list[str] | None], int | None], argv: list[str] | None = None, prog: str = "grt"
) -> int:
    """Run a command's `main(argv)` as the process entry (the `grt` dispatcher, and every
    `python -m` module that may start a process group): its exit code, exception included,
    goes through exit_process, so no command can forget it. The errors of `boundary_line`
    (and a RendezvousError that a command does not catch itself) become one line, `prog:
    ...`, and their exit code, in-process callers included; any other exception is let
    through without a process group (a bug's traceback), and is exit 1 with one."""
    threads: list[tuple[BaseException, tuple[str, int]]] = []  # the threads' errors of boundary_line
    try:
        with _boundary(threads):
            code = main(argv) or 0
    except RendezvousError as err:  # a command that lets it through (the probe): still one line, exit 2
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except BaseException as err:  # noqa: BLE001 - the process ends here with its exit code
        handled = None if isinstance(err, SystemExit) else boundary_line(err)
        if handled is not None:
            _say(prog, handled[0], err)
            code = handled[1]
        elif not _group_exists():
            raise
        else:
            code = _exit_code(err)
    if code == 0 and threads:  # the command ended well but a thread of it did not: that is its failure
        for failed, (line, _) in threads:
            _say(prog, line, failed)
        _, (_, code) = threads[0]  # the first thread's code
    return exit_process(code)
