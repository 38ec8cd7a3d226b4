"""Rank 0's `grt train: ...` line on stderr: what a start passes over or changes, a warning.
(An exception as one line, `one_line`, is the bottom package's: grt_common/errors.py.)"""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """`grt train: message` on stderr, from rank 0 only (every rank starts the same checks)."""
    from pretrain.distributed.discovery import discover  # its package starts torch: not on import

    if discover().rank == 0:
        print(f"grt train: {message}", file=sys.stderr, flush=True)
