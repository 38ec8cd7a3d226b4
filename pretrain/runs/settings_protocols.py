"""What the settings rules (settings_rules.py) read and set of a run config, by name: the parts of
`RunConfig` and `TrainConfig` they use, as protocols, so that the rules import nothing of the run
config (which imports them) and mypy checks those classes against them where they are passed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pretrain.runs.data_spec import DataSpec


class TrainSettings(Protocol):
    """What the rules read of a `TrainConfig` (pretrain/runs/train_config.py) by name; the
    switch and bound rules read a field named in their table (`getattr`)."""

    @property
    def lr(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def decay_tokens(self) -> float: ...
    @property
    def data_stages(self) -> str: ...
    @property
    def profile(self) -> str: ...
    @property
    def profile_ranks(self) -> str: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def allow_batch_change(self) -> bool: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def grad_accum(self) -> int: ...

    grad_clip: float  # set by `switch_defaults`
    schedule: str  # these four by `decay_branch`
    schedule_steps: int
    steps: int
    tokens: float


class RunSettings(Protocol):
    """What the rules read of a `RunConfig` (pretrain/runs/run_config.py)."""

    @property
    def train(self) -> TrainSettings: ...
    @property
    def data_spec(self) -> DataSpec: ...
    @property
    def out(self) -> str: ...

    branch_from: str  # set by `decay_branch`
