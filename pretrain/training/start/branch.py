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

How: the start is planned against the source checkpoint first (start/plan.py: the resume rule, and
nothing linked while it refuses); then the branch's `checkpoints/<tag>` is made of hard links to
the source checkpoint's files (copies where the file system has none), built in a temporary
folder and renamed into place, so it is whole or absent, and the branch trains as an ordinary
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

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from data_pipeline.files import atomic_write_text, is_temp
from pretrain.config import ConfigError
from pretrain.errors import UnreadableCheckpoint
from pretrain.runs import checkpoint_files
from pretrain.runs.checkpoint_files import DATA_SKIPS
from pretrain.runs.data_spec import load_manifest
from pretrain.runs.run_config import RunConfig, tokens_per_step
from pretrain.training.engine.lr_schedule import decay_steps

BRANCH_FILE = "branch.json"  # in the branch's run directory: where it branched from
NOT_LINKED = ("wandb.json",)  # the source's W&B run id: a branch is a W&B run of its own
COPY_ENV = "GRT_BRANCH_COPY"  # 1: copy the checkpoint's files instead of hard-linking them


def _say(line: str) -> None:
    from pretrain.distributed import discover

    if discover().rank == 0:
        print(f"grt train: {line}", file=sys.stderr, flush=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def find_source(given: str, out: str | None) -> Path:
    """The checkpoint (absolute tag directory) `--branch-from given` names: a tag directory, a
    `checkpoints/` folder or a run directory (their newest complete checkpoint). Where `out`
    already is a branch of that run (its branch.json; a restart), the tag it was made from.
    ConfigError (one line) when there is none."""
    if not out:
        raise ConfigError("--branch-from needs --out: the branch's own, new run directory")
    p = Path(given).resolve()
    if checkpoint_files.TAG_RE.match(p.name) and p.is_dir():
        if not (p / "COMPLETE").is_file():
            raise ConfigError(f"--branch-from {given}: not a complete checkpoint (no COMPLETE marker)")
        tag_dir: Path | None = p
        root = p.parent
    else:
        root = p if p.name == "checkpoints" else p / "checkpoints"
        if not root.is_dir():
            raise ConfigError(
                f"--branch-from {given}: no run directory, checkpoints folder or checkpoint "
                "(a run directory holds checkpoints/stepNNNNNNNN)"
            )
        tag_dir = None
    recorded = _read_json(Path(out) / BRANCH_FILE)
    if recorded is not None and Path(recorded.get("source_run", "")) == root.parent:
        made_from = Path(recorded.get("checkpoint", ""))
        if tag_dir is not None and tag_dir != made_from:
            raise ConfigError(
                f"--out {out} is a branch of {made_from} ({BRANCH_FILE}), not of {tag_dir}: resume it with "
                f"--branch-from {made_from}, or choose another --out"
            )
        return made_from
    if tag_dir is not None:
        return tag_dir
    latest = checkpoint_files.find_latest(root)
    if latest is None:
        raise ConfigError(f"--branch-from {given}: {root} holds no complete checkpoint")
    return root / latest


def saved_where(cfg: RunConfig, path: Path) -> RunConfig:
    """A run config read from the file `path`: where that is a run's own config.json (its run
    directory's, or one of its checkpoints'), a relative `out` in it names that run directory (it
    was relative to the directory the run was started from, not to this command's). A relative
    DeepSpeed file in any saved config is a shipped one by its name (the run made the caller's own
    absolute, pretrain/train.py callers_paths): that file, whatever this directory holds of that name."""
    from pretrain.training.engine.ds_config import PROJECT_ROOT, SHIPPED_DIR

    folder = Path(os.path.abspath(path)).parent
    run = folder.parent.parent if checkpoint_files.TAG_RE.match(folder.name) else folder
    if cfg.out and not os.path.isabs(cfg.out) and (run / "checkpoints").is_dir():
        cfg.out = str(run)
    names = [base / cfg.ds_config for base in (PROJECT_ROOT, SHIPPED_DIR) if not os.path.isabs(cfg.ds_config)]
    shipped = next((p for p in names if p.is_file()), None)
    if shipped is not None and not (os.path.exists(cfg.ds_config) and os.path.samefile(cfg.ds_config, shipped)):
        cfg.ds_config = str(shipped)
    return cfg


def saved_config(folder: Path, where: str) -> RunConfig:
    """The run config a run saved in `folder` (a checkpoint's, or a run directory's `config.json`):
    the base of a run continued from it (a branch, a resume: pretrain/train.py base_config);
    `where` names it in the one line that refuses an unreadable one."""
    try:
        cfg = RunConfig.from_dict(checkpoint_files.read_config(folder))
    except UnreadableCheckpoint as err:
        raise ConfigError(f"{where}: {folder / 'config.json'}: {err.problem}") from None
    return saved_where(cfg, folder / "config.json")


def source_config(source: Path) -> RunConfig:
    """The run config the checkpoint was trained with: a branch's starting point."""
    return saved_config(source, f"--branch-from {source}")


def base_config(source: Path, out: str) -> RunConfig:
    """A branch's starting run config: the source checkpoint's, or where the source has pruned it
    since the branch was made, the branch's copy of it."""
    for tag_dir in (source, Path(out) / "checkpoints" / source.name):
        if (tag_dir / "COMPLETE").is_file():
            return source_config(tag_dir)
    raise ConfigError(f"--branch-from {source}: no complete checkpoint there")


def given_train_keys(args: argparse.Namespace) -> set[str]:
    """The train keys the command line sets itself (flags and --set), e.g. {"steps", "decay_tokens"}."""
    keys = {k.split("=", 1)[0].removeprefix("train.") for k in args.overrides if k.startswith("train.")}
    return keys | ({"steps"} if args.steps is not None else set())


def configure(cfg: RunConfig, source: Path, given: set[str]) -> RunConfig:
    """Make `cfg` (the source's config with the command line's changes) the branch's: wsd, its
    horizon its own length, that length (unless given) the checkpoint's step + the decay's steps."""
    out, run = Path(cfg.out).resolve(), source.parent.parent
    if out == run or run in out.parents:
        raise ConfigError(
            f"--out {cfg.out}: a branch needs a new run directory, not {run} or a folder inside it "
            "(the source run's files stay untouched)"
        )
    if "schedule" in given and cfg.train.schedule != "wsd":
        raise ConfigError(f"train.schedule={cfg.train.schedule!r}: a decay branch trains the wsd schedule's decay")
    t = cfg.train
    t.schedule = "wsd"
    cfg.branch_from = str(source)
    if "schedule_steps" not in given:
        t.schedule_steps = 0  # the decay ends at the branch's own last step
    if given & {"steps", "tokens"}:
        return cfg
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
    per_step = _tokens_per_step(source, Path(cfg.out), load_manifest(cfg.data).seq_len)
    t.steps = checkpoint_files.step_of(source.name) + decay_steps(t.decay_tokens, per_step)
    t.tokens = 0.0  # the length is train.steps (said by the resume's line, with the decay, once the start is sure)
    return cfg


def _tokens_per_step(source: Path, out: Path, seq_len: int) -> int:
    """The tokens per optimizer step of the source checkpoint's global batch (a resume keeps it): read
    from it, or, where the source has pruned it since, from the branch's own copy or newest checkpoint."""
    root = out / "checkpoints"
    newest = checkpoint_files.find_latest(root)
    for tag_dir in (source, root / source.name, *([root / newest] if newest else [])):
        if (tag_dir / "COMPLETE").is_file():
            return tokens_per_step(
                source_config(tag_dir).train, checkpoint_files.ranks_that_wrote(tag_dir) or 1, seq_len
            )
    raise ConfigError(f"--branch-from {source}: no complete checkpoint there")


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
    recorded = _read_json(Path(cfg.out) / BRANCH_FILE) or {}
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
            out / BRANCH_FILE,
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
        created.append(out / BRANCH_FILE)
    except OSError as err:
        _remove(created)
        raise ConfigError(
            f"--branch-from {source}: could not make {mine} ({type(err).__name__}: {err}); nothing was left in --out"
        ) from None
    if "copies" in how and os.environ.get(COPY_ENV) != "1":
        _say(f"warning: {mine}: the file system refused hard links to {source}'s files: copied them instead")
    return created


def _carry_data_skip(cfg: RunConfig, source: Path) -> list[Path]:
    """Where the source's rollback recorded that a resume from this tag skips data
    (data_skips.json), the branch does the same."""
    skip = (_read_json(source.parent.parent / DATA_SKIPS) or {}).get(source.name)
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
