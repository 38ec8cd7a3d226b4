"""One rule for settings (issue #40; docs/reliability.md, "Settings that cannot take effect").

Each setting states, in the table below, what it needs to take effect: a schedule, a feature
switch (declared with its field, train_config.py `option`, and registered here by `switch_rule`),
a range that must fit the run. The config's check refuses, in one line naming the
setting, its value and the way out,

- a setting that cannot take effect (train.decay_tokens under the cosine schedule, a
  train.profile window past the run's last step, a mixture stage past its last token);
- two settings that decide the same thing differently (train.steps and train.tokens);
- any explicit value the start would replace (an explicit train.warmup_steps longer than the
  schedule, which would cut it to its horizon);
- numbers outside what the run can hold (MAX_STEPS, MAX_TOKENS, MAX_SECONDS).

Explicit values are the ones the command line gave (`--set`, `--steps`, ...: `mark_given`);
a preset's, a recipe's or a saved config's values are defaults. An explicit value is never
replaced; a default that does not fit is refused with the way out where that is safe, else
said in one line (`start_notes`): train.warmup_steps' default of 2000 against a shorter run
warms up over the whole run and never decays, and is said so with the way out
(`--set train.warmup_steps=N`); a derived value the user did not set (train.steps from
train.tokens) is said in one line by the start too.

Rules run at one of two places: "config" rules at `RunConfig.validate` (the config alone),
"start" rules at `plan_start` (pretrain/training/start/plan.py), which knows the world size and
the tokens per step, so `grt train`, `--dry-run` and `grt launch` refuse alike. This module
imports nothing of the run config (run_config.py and train_config.py import it, so even a
type-only import would close a circle): a rule reads the config through `RunSettings` and
`TrainSettings` (settings_protocols.py), the parts of `RunConfig` and `TrainConfig` it reads, which
mypy checks those classes against where they are passed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from grt_common.errors import ConfigError
from pretrain.runs.settings_protocols import RunSettings, TrainSettings

MAX_STEPS = 2**40  # train.steps and every step count (warmup, schedule, intervals): ~1.1e12 optimizer steps
MAX_TOKENS = 2.0**63  # train.tokens, train.decay_tokens, a data stage's tokens: an int64 count of tokens
MAX_SECONDS = 7 * 24 * 3600.0  # train.dist_timeout_s: a week (a timedelta past this is a hang, not a timeout)
MAX_BATCH = 2**24  # train.micro_batch_size and train.grad_accum (sequences)


Config = TypeVar("Config")  # mark_given's config, returned as it came


@dataclass(frozen=True)
class RunShape:
    """What the start knows that the config alone does not."""

    world: int  # ranks
    tokens_per_step: int  # of one optimizer step (pretrain/runs/run_config.py tokens_per_step)
    start_step: int = 0  # the step a resume continues from (0: a fresh start)


@dataclass(frozen=True)
class Rule:
    setting: str  # the key it guards, e.g. "train.decay_tokens"
    needs: str  # what the setting needs to take effect, in words
    at: str  # "config" (RunConfig.validate) or "start" (plan_start: the world and the tokens per step)
    check: Callable[[RunSettings, RunShape | None], str | None]  # the refusal's one line, or None


RULES: list[Rule] = []


def rule(
    setting: str, needs: str, at: str = "config"
) -> Callable[[Callable[..., str | None]], Callable[..., str | None]]:
    """Declare a rule of `setting`: the decorated function returns the refusal's one line, or None."""

    def register(check: Callable[..., str | None]) -> Callable[..., str | None]:
        RULES.append(Rule(setting, needs, at, check))
        return check

    return register


GIVEN = "given_keys"  # the attribute of a RunConfig naming the keys its command line set (`mark_given`)


def mark_given(cfg: Config, keys: set[str]) -> Config:
    """Record the dotted keys the command line set itself (`--set model.vocab_size=100`): a value
    the start would change is refused instead (run_config.py `resolve`). Not part of the saved
    config; called again, it adds."""
    setattr(cfg, GIVEN, given_keys(cfg) | frozenset(keys))
    return cfg


ADAMW_GRAD_CLIP = 1.0  # train.grad_clip's default: AdamW's clip of the gradient norm


def switch_defaults(cfg: RunSettings) -> None:
    """A switch that changes what makes sense sets its own default where the command line gave none
    (`mark_given`): train.optimizer=muon takes train.grad_clip=0 (DeepSpeed's Muon clips each
    matrix's orthogonalised update itself; engine/ds_config.py refuses a clip of the gradient beside it)."""
    t = cfg.train
    if t.optimizer == "muon" and not given(cfg, "train.grad_clip") and t.grad_clip == ADAMW_GRAD_CLIP:
        t.grad_clip = 0.0


def decay_branch(cfg: RunSettings, source: Path, step: int, batch: int) -> None:
    """Make `cfg` (the source's config with the command line's changes) a decay branch's from the
    checkpoint `source` of `step`, trained at the global batch `batch` (sequences a step, which a
    resume keeps): wsd, its horizon its own length, that length (unless given) the checkpoint's step
    + the decay's steps of that batch of the data's sequences (pretrain/training/start/branch.py)."""
    given = {key.removeprefix("train.") for key in given_keys(cfg)}
    out, run = Path(cfg.out).resolve(), source.parent.parent
    if out == run or run in out.parents:
        raise ConfigError(
            f"--out {cfg.out}: a branch needs a new run directory, not {run} or a folder inside it "
            "(the source run's files stay untouched)"
        )
    t = cfg.train
    if "schedule" in given and t.schedule != "wsd":
        raise ConfigError(f"train.schedule={t.schedule!r}: a decay branch trains the wsd schedule's decay")
    t.schedule = "wsd"
    cfg.branch_from = str(source)
    if "schedule_steps" not in given:
        t.schedule_steps = 0  # the decay ends at the branch's own last step
    if given & {"steps", "tokens"}:
        return
    if t.decay_tokens <= 0:
        raise ConfigError(
            f"--branch-from {source}: a decay branch needs its decay: --set train.decay_tokens=N (tokens), "
            "or its length (--steps, train.tokens)"
        )
    if t.allow_batch_change:
        raise ConfigError(
            "--branch-from with train.allow_batch_change: the decay's steps follow the global batch, which the "
            "ranks set; give the branch's length (--steps)"
        )
    t.steps = step + decay_steps(t.decay_tokens, batch * cfg.data_spec.load().seq_len)
    t.tokens = 0.0  # the length is train.steps (said by the resume's line, with the decay, once the start is sure)


def given_keys(cfg: object) -> frozenset[str]:
    return getattr(cfg, GIVEN, frozenset())


def given(cfg: object, key: str) -> bool:
    """Whether the command line set `key` ("train.steps") itself (`mark_given`)."""
    return key in given_keys(cfg)


def check_settings(cfg: RunSettings, shape: RunShape | None = None) -> None:
    """Every rule of the place (`shape` None: the config's; else the start's): the first refusal as
    one ConfigError."""
    at = "config" if shape is None else "start"
    for r in RULES:
        if r.at == at:
            message = r.check(cfg, shape)
            if message:
                raise ConfigError(message)


def horizon(t: TrainSettings) -> int:
    """Where the learning-rate schedule ends (train.schedule_steps, else train.steps)."""
    return int(t.schedule_steps or t.steps)


def warmup_num_steps(t: TrainSettings) -> int:
    """DeepSpeed's `warmup_num_steps` of both schedules: train.warmup_steps, at least 1 and at most
    the horizon (DeepSpeed then warms up over at least 2)."""
    return max(1, min(int(t.warmup_steps), horizon(t)))


def decay_steps(decay_tokens: float, tokens_per_step: int) -> int:
    """The steps of a wsd decay of `decay_tokens` tokens: ceil(decay_tokens / tokens_per_step), 0 without."""
    return math.ceil(decay_tokens / tokens_per_step) if decay_tokens > 0 else 0


def global_batch(train: TrainSettings, world: int) -> int:
    """The sequences of one optimizer step: every rank's micro-batches of it."""
    return train.micro_batch_size * train.grad_accum * world


# -- switches: a setting given on the command line needs its feature switched on --------------
def switch_rule(key: str, needs: str, on: Callable[[TrainSettings], bool]) -> None:
    """`key` ("train.wandb_project") given on the command line while `on(cfg.train)` is false is
    refused, naming `needs` ("train.wandb=true"). Declared with the field (train_config.py `option`)."""
    name = key.removeprefix("train.")

    @rule(key, needs)
    def needs_switch(cfg: RunSettings, _: RunShape | None) -> str | None:
        if not given(cfg, key) or on(cfg.train):
            return None
        value = getattr(cfg.train, name)
        return f"{key}={value!r} needs {needs} to take effect; set that too, or leave {key} out"


@rule("train.decay_tokens", "train.schedule=wsd")
def _decay_needs_wsd(cfg: RunSettings, _: RunShape | None) -> str | None:
    """Whether given or saved: under cosine a decay is never applied."""
    t = cfg.train
    if t.decay_tokens > 0 and t.schedule != "wsd":
        return (
            f"train.decay_tokens={t.decay_tokens:g} is only used by the wsd schedule, not train.schedule="
            f"{t.schedule!r}: set train.schedule=wsd, or train.decay_tokens=0"
        )
    return None


# -- one thing decided once --------------------------------------------------------------------
@rule("train.steps", "train.tokens=0 (train.tokens sets the steps)")
def _steps_or_tokens(cfg: RunSettings, _: RunShape | None) -> str | None:
    t = cfg.train
    if given(cfg, "train.steps") and t.tokens > 0:
        return (
            f"train.steps={t.steps} and train.tokens={t.tokens:g} both set the run's length (train.tokens would "
            "replace the steps): give one, --steps N or --set train.tokens=N (train.tokens=0 keeps --steps)"
        )
    return None


# -- numbers the run can hold ------------------------------------------------------------------
BOUNDED: list[tuple[str, float]] = [
    ("steps", MAX_STEPS),
    ("warmup_steps", MAX_STEPS),
    ("schedule_steps", MAX_STEPS),
    ("log_every", MAX_STEPS),
    ("eval_every", MAX_STEPS),
    ("save_every", MAX_STEPS),
    ("eval_tasks_every", MAX_STEPS),
    ("tokens", MAX_TOKENS),
    ("decay_tokens", MAX_TOKENS),
    ("micro_batch_size", MAX_BATCH),
    ("grad_accum", MAX_BATCH),
    ("dist_timeout_s", MAX_SECONDS),
]


def _bound_rule(name: str, limit: float) -> None:
    @rule(f"train.{name}", f"at most {limit:.6g}")
    def bounded(cfg: RunSettings, _: RunShape | None) -> str | None:
        value = getattr(cfg.train, name)
        if isinstance(value, (int, float)) and value > limit:
            return f"train.{name}={value:.6g}: must be at most {limit:.6g} (the largest a run can hold)"
        return None


for _name, _limit in BOUNDED:
    _bound_rule(_name, _limit)


# -- what must fit the run (the start: the tokens per step and the world are known) -------------
@rule("train.tokens", f"a budget of at most {MAX_STEPS} steps", at="start")
def _budget_fits(cfg: RunSettings, shape: RunShape | None) -> str | None:
    t = cfg.train
    if t.steps > MAX_STEPS:
        return (
            f"train.tokens={t.tokens:g}: {t.steps} steps of {shape.tokens_per_step if shape else '?'} tokens, "
            f"more than the {MAX_STEPS} steps a run can hold: give a smaller train.tokens"
        )
    return None


@rule("train.warmup_steps", "at most the schedule's steps (train.schedule_steps or train.steps)", at="start")
def _warmup_fits(cfg: RunSettings, _: RunShape | None) -> str | None:
    """An explicit warmup longer than the schedule, which would cut it to its horizon, is refused (one
    as long as the schedule is taken as given: a warmup over the whole run); a default is said (start_notes)."""
    t = cfg.train
    if given(cfg, "train.warmup_steps") and t.warmup_steps > horizon(t):
        return (
            f"train.warmup_steps={t.warmup_steps} is longer than the schedule's {horizon(t)} steps, which would cut "
            f"it to {horizon(t)}: the learning rate would warm up to the end and never decay; give fewer (e.g. "
            f"train.warmup_steps={max(1, horizon(t) // 10)}) or a longer run"
        )
    return None


@rule("train.decay_tokens", "a wsd decay that leaves the warmup room to reach train.lr", at="start")
def _decay_fits(cfg: RunSettings, shape: RunShape | None) -> str | None:
    t = cfg.train
    if t.schedule != "wsd" or t.decay_tokens <= 0 or shape is None or cfg.branch_from:
        return None  # a decay branch starts its decay at the checkpoint, long after the warmup
    steps, h = decay_steps(t.decay_tokens, shape.tokens_per_step), horizon(t)
    room = h - 1 - max(2, warmup_num_steps(t))  # the scheduler steps between warmup and decay
    if steps > room:
        return (
            f"train.decay_tokens={t.decay_tokens:g}: a decay of {steps} steps ({shape.tokens_per_step} tokens each) "
            f"in a schedule of {h} steps after a warmup of {t.warmup_steps} never lets the learning rate reach "
            f"train.lr={t.lr:g}; give at most {max(0, room) * shape.tokens_per_step} tokens, or a longer run"
        )
    return None


@rule("train.profile", "a window that ends by the run's last step", at="start")
def _profile_fits(cfg: RunSettings, shape: RunShape | None) -> str | None:
    t = cfg.train
    window = profile_window(t.profile) if t.profile else None
    if window is None or shape is None:
        return None
    left = t.steps - shape.start_step  # counted from the process's first step
    if sum(window) > left:
        return (
            f"train.profile={t.profile!r}: the window ends at step {sum(window)} of this process, but it runs "
            f"{left} step(s): the trace would be empty; choose a window of at most {left} steps, or a longer run"
        )
    return None


@rule("train.profile_ranks", "ranks of the run", at="start")
def _profile_ranks_exist(cfg: RunSettings, shape: RunShape | None) -> str | None:
    t = cfg.train
    if not t.profile or t.profile_ranks == "all" or shape is None:
        return None
    missing = [r for r in (int(x) for x in t.profile_ranks.split(",")) if r >= shape.world]
    if missing:
        return (
            f"train.profile_ranks={t.profile_ranks!r}: rank {missing[0]} is not in this run of {shape.world} "
            f"rank(s) (0..{shape.world - 1}), so it traces nothing; name ranks below {shape.world}, or 'all'"
        )
    return None


@rule("train.data_stages", "stages that start before the run's last step", at="start")
def _stages_fit(cfg: RunSettings, shape: RunShape | None) -> str | None:
    from data_pipeline.mixture import parse_stages

    t = cfg.train
    sources = cfg.data_spec.sources if t.data_stages and shape is not None else None
    if sources is None or shape is None:
        return None  # stages of one manifest: refused by plan_stages
    last = (t.steps - 1) * shape.tokens_per_step  # the tokens read before the last step
    for stage in parse_stages(t.data_stages, [s.name for s in sources]):
        if stage.tokens > last:
            return (
                f"train.data_stages: the stage at {stage.tokens:g} tokens starts after the run's last step "
                f"({t.steps} steps of {shape.tokens_per_step} tokens read {last + shape.tokens_per_step:g}), so it "
                "never applies: start it earlier, or train longer"
            )
    return None


def profile_window(text: str) -> tuple[int, int, int] | None:
    """train.profile "wait,warmup,active" as three integers (wait, warmup >= 0, active >= 1), else None."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    wait, warmup, active = (int(p) for p in parts)
    return (wait, warmup, active) if active >= 1 else None


def profile_refusal(text: str) -> str:
    return (
        f"train.profile={text!r}: expected 'wait,warmup,active' steps (e.g. '10,2,3': skip 10 steps, warm up 2, "
        "trace 3), or '' for off"
    )


NOTES: list[Callable[[RunSettings], list[str]]] = []  # more lines of start_notes, declared by their settings' modules


def note(lines: Callable[[RunSettings], list[str]]) -> Callable[[RunSettings], list[str]]:
    """Declare lines the start says of a default derived from the run (depth_settings.py's Poisson mean)."""
    NOTES.append(lines)
    return lines


def start_notes(cfg: RunSettings) -> list[str]:
    """The lines a start says of defaults that do not fit and are kept (the module docstring)."""
    t = cfg.train
    derived = [line for lines in NOTES for line in lines(cfg)]
    if not given(cfg, "train.warmup_steps") and t.warmup_steps >= horizon(t):
        return [
            f"train.warmup_steps={t.warmup_steps} (the default) is not shorter than the schedule's {horizon(t)} "
            "steps: the learning rate warms up over the whole run and never decays; set --set "
            f"train.warmup_steps={max(1, horizon(t) // 10)} (say) for a warmup and a decay",
            *derived,
        ]
    return derived
