"""Decay branches: a new run that starts from a checkpoint of a wsd run and trains its decay
(docs/training.md, "Schedules: cosine and warmup-stable-decay").

    grt train --branch-from runs/stable --out runs/decay-2B --set train.decay_tokens=2e9

`--branch-from` names a run directory (its newest complete checkpoint), its `checkpoints/`
folder, or one `checkpoints/stepNNNNNNNN` directory. The branch's run config is the
checkpoint's own (`config.json`), then the flags and `--set`s on top (`--config-json` instead,
when given); `--out` is required and must be a new run directory, neither the source's nor
inside it. The branch trains with train.schedule=wsd, its horizon its own length
(train.schedule_steps 0), and train.steps = the checkpoint's step + ceil(decay_tokens /
tokens per step) (the checkpoint's global batch x the data's sequence length), said in the
resume's one line with the decay, once the start is sure; `--steps` or `train.tokens` given
instead set the length, the decay being its last decay_tokens. Everything else is the resume
rule (start/resume_check.py): the model, tokenizer, lr, warmup, betas and weight decay stay, the lr at the
checkpoint may not move, the global batch is kept.

The branch's run config (its source, schedule and length) is the command line's, read once
(command_line.py); here, its checkpoint. How: the start is planned against the
source checkpoint first (start/plan.py: the resume rule, and nothing linked while it refuses);
then the branch's `checkpoints/<tag>` is made of hard links to the source checkpoint's files
(copies where the file system has none), built in a temporary folder and renamed into place,
so it is whole or absent, and the branch trains as an ordinary
`--resume` of the new run directory (the trainer's load). The source run directory is only
read: no file in it is written, renamed or removed, and pruning the branch's checkpoints removes
the branch's links only. Nothing writes into a linked file: checkpoint.save writes each tag's
files into a new folder, always of a later step (a resume saves after its first step), rank files
by rename; a universal conversion writes a new `universal/`. The source's W&B id (`wandb.json`)
is not linked: a branch is a new W&B run. `<out>/branch.json` records the source. Every rank of a
launch runs this (the run config carries `branch_from`): the first rename wins, the others find
the tag there; a start with the tag already there (a restart, a requeue) links nothing. A start
refused after the links were made (the trainer's lock or load) removes what the branch created,
leaving --out as it was.

Caveat of hard links: they share the source's bytes, so if the source run ever rewrote that very
tag (only a resume from an older checkpoint of the source, passing over it as unreadable, does),
the branch's copy would change with it; `GRT_BRANCH_COPY=1` copies instead of linking.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grt_common.errors import ConfigError
from grt_common.files import atomic_write_text, is_temp
from pretrain.runs import checkpoint_files
from pretrain.runs.checkpoint_files import DATA_SKIPS
from pretrain.runs.run_config import RunConfig
from pretrain.say import say

NOT_LINKED = ("wandb.json",)  # the source's W&B run id: a branch is a W&B run of its own
COPY_ENV = "GRT_BRANCH_COPY"  # 1: copy the checkpoint's files instead of hard-linking them


def _tag_dir(cfg: RunConfig) -> tuple[Path, Path]:
    """(the source checkpoint, the branch's copy of it)."""
    source = Path(cfg.branch_from)
    return source, Path(cfg.out) / "checkpoints" / source.name


def _made(cfg: RunConfig) -> bool:
    """Whether the branch's run directory already holds the branch (its tag, or checkpoints of its
    own after a branch.json that names this source): a restart links nothing."""
    source, mine = _tag_dir(cfg)
    if (mine / "COMPLETE").is_file():
        return True
    root = mine.parent
    others = checkpoint_files.tag_dirs(root)
    if not others:
        return False
    recorded = checkpoint_files.read_json(Path(cfg.out) / checkpoint_files.BRANCH_FILE) or {}
    if recorded.get("checkpoint") == str(source):
        return True
    raise ConfigError(
        f"--out {cfg.out} already holds checkpoints ({', '.join(others)}) of another run than a branch of "
        f"{source}: choose another --out for the branch"
    )


def unmade_source(cfg: RunConfig) -> Path | None:
    """A decay branch whose checkpoint is not in --out yet: the source checkpoint its start is
    checked against (start/plan.py; None: no branch, or one made already, which resumes as any run)."""
    if not cfg.branch_from or _made(cfg):
        return None
    return Path(cfg.branch_from)


def _link_tree(src: Path, dst: Path, copy_files: bool) -> set[str]:
    """`dst` (new) with every file of `src` hard-linked (copied, with its times, where linking
    fails or `copy_files`), folders recreated; temporaries and the W&B id left out."""
    dst.mkdir()
    how: set[str] = set()
    for p in sorted(src.iterdir()):
        if p.name in NOT_LINKED or is_temp(p.name) or p.name.startswith(".universal.tmp"):
            continue
        if p.is_dir():
            how |= _link_tree(p, dst / p.name, copy_files)
            continue
        try:
            if copy_files:
                raise OSError("copies asked for")
            os.link(p, dst / p.name)
            how.add("hard links")
        except OSError:
            shutil.copy2(p, dst / p.name)
            how.add("copies")
    return how


def _remove(created: list[Path]) -> None:
    """Undo a branch's start: what it created, newest first (a folder only where it is empty now,
    but its own tag folder whole)."""
    for p in reversed(created):
        if p.is_dir() and checkpoint_files.TAG_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir():
            try:
                p.rmdir()
            except OSError:
                pass  # something else is in it now (the launcher's files): kept
        else:
            p.unlink(missing_ok=True)


def _mkdir(path: Path, created: list[Path]) -> None:
    try:
        path.mkdir()
    except FileExistsError:
        return
    created.append(path)


def prepare(cfg: RunConfig) -> list[Path]:
    """Make `<out>/checkpoints/<tag>` of the source's files (once: another rank may have), the start
    checked first (start.plan_start); returns what this process created."""
    if _made(cfg):
        return []
    source, mine = _tag_dir(cfg)
    created: list[Path] = []
    out = Path(cfg.out)
    try:
        for folder in (*reversed(out.absolute().parents), out, mine.parent):
            if not folder.exists():
                _mkdir(folder, created)
        staging = mine.parent / f".{mine.name}.branch{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        how = _link_tree(source, staging, os.environ.get(COPY_ENV) == "1")
        try:
            staging.rename(mine)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (mine / "COMPLETE").is_file():
                raise
            return created  # another rank made it first
        created.append(mine)
        latest = mine.parent / "latest"
        if not latest.exists():
            atomic_write_text(latest, mine.name + "\n")
            created.append(latest)
        created += _carry_data_skip(cfg, source)
        atomic_write_text(
            out / checkpoint_files.BRANCH_FILE,
            json.dumps(
                {
                    "source_run": str(source.parent.parent),
                    "checkpoint": str(source),
                    "tag": source.name,
                    "step": checkpoint_files.step_of(source.name),
                    "files": " and ".join(sorted(how)) or "none",
                    "steps": cfg.train.steps,
                    "decay_tokens": cfg.train.decay_tokens,
                    "decay_shape": cfg.train.decay_shape,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                },
                indent=2,
            )
            + "\n",
        )
        created.append(out / checkpoint_files.BRANCH_FILE)
    except OSError as err:
        _remove(created)
        raise ConfigError(
            f"--branch-from {source}: could not make {mine} ({type(err).__name__}: {err}); nothing was left in --out"
        ) from None
    if "copies" in how and os.environ.get(COPY_ENV) != "1":
        say(f"warning: {mine}: the file system refused hard links to {source}'s files: copied them instead")
    return created


def _carry_data_skip(cfg: RunConfig, source: Path) -> list[Path]:
    """Where the source's rollback recorded that a resume from this tag skips data
    (data_skips.json), the branch does the same."""
    skip = (checkpoint_files.read_json(source.parent.parent / DATA_SKIPS) or {}).get(source.name)
    path = Path(cfg.out) / DATA_SKIPS
    if skip is None or path.exists():
        return []
    atomic_write_text(path, json.dumps({source.name: skip}, indent=2) + "\n")
    return [path]


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@contextmanager
def prepared(cfg: RunConfig) -> Iterator[None]:
    """Around the training of a run: for a branch (cfg.branch_from), its checkpoint made first
    (`prepare`); a start refused (ConfigError) before the trainer wrote its config.json removes
    what the branch created. Nothing for any other run."""
    if not cfg.branch_from:
        yield
        return
    config_json = Path(cfg.out) / "config.json"
    before = _stat(config_json)
    created = prepare(cfg)
    try:
        yield
    except ConfigError:
        if created and _stat(config_json) == before:
            _remove(created)
        raise
