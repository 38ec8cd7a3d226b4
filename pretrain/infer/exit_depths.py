"""The depths a model can exit at: a looped model's loop steps 0..R (beyond R on request), a dense
model's first k layers; shared by `grt eval`, `grt generate` and `grt analyze`."""

from __future__ import annotations

from grt_common.errors import ConfigError
from pretrain.model import GPT


def depth_unit(model: GPT) -> str:
    """What an exit depth counts: a looped model's loop steps, a dense model's layers."""
    return "loop steps" if model.loop is not None else "layers"


def default_depths(model: GPT) -> list[int]:
    """--depths by default: a looped model's 0..R, a dense model's N (the whole model)."""
    return list(range(model.max_loops + 1)) if model.loop is not None else [len(model.prelude)]


def check_depths(model: GPT, depths: list[int], allow_beyond: bool) -> list[int]:
    """The exit depths, refused in one line where the model cannot run them. A looped model's
    depth r is r loop steps (0: the prelude straight to the coda; above the trained R only with
    allow_beyond); a dense model's depth k is its first k layers, then the final norm and head
    (1..N; N: the whole model; `GPT.dense_exit`)."""
    trained = model.max_loops if model.loop is not None else 0
    if model.loop is None:
        n = len(model.prelude)
        bad = [d for d in depths if not 1 <= d <= n]
        if bad:
            raise ConfigError(
                f"--depths {bad}: a dense model's exit depth is the number of layers run, 1..{n} ({n}: the whole model)"
            )
        return depths
    beyond = [d for d in depths if d > trained]
    if beyond and not allow_beyond:
        raise ConfigError(
            f"depth(s) {beyond} exceed the trained maximum of {trained} loop steps; "
            "pass --allow-beyond-trained to run them"
        )
    return depths


# -- a raw text -------------------------------------------------------------------------------
