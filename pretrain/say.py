"""The two kinds of line a command writes on stderr: rank 0's `grt train: ...` line (what a start
passes over or changes, a warning), and an exception as one line (in a refusal, a warning, the
failure every rank reports). Torch-free: the data pipeline's errors are written with it too."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """`grt train: message` on stderr, from rank 0 only (every rank starts the same checks)."""
    from pretrain.distributed.discovery import discover  # its package starts torch: not on import

    if discover().rank == 0:
        print(f"grt train: {message}", file=sys.stderr, flush=True)


def one_line(err: BaseException) -> str:
    """`Type: message`, the message's whitespace folded (a traceback's or a server's text stays one
    line; an empty message is the type's name), at most 1000 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:1000]
