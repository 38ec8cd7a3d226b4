"""What every pytest-xdist worker of a test run shares (shards, a trained model): each made once, by
the first worker to ask, under a file lock, in one folder that the run's controller makes before
its workers start (they inherit GRT_TEST_ARTIFACTS) and removes at its end (tests/conftest.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT_ENV = "GRT_TEST_ARTIFACTS"


def make_root() -> str:
    """A new shared folder, named in the environment for the processes started after this."""
    root = tempfile.mkdtemp(prefix="grt-test-artifacts-")
    os.environ[ROOT_ENV] = root
    return root


def root() -> Path:
    """The run's shared folder; outside a pytest run (a helper module used on its own), one of this
    process's own, removed at its exit."""
    if not os.environ.get(ROOT_ENV):
        atexit.register(shutil.rmtree, make_root(), ignore_errors=True)
    return Path(os.environ[ROOT_ENV])


def made_once(name: str, make: Callable[[Path], None]) -> Path:
    """<root>/<name>, made by make(path) by the first worker to ask; the others wait for it."""
    from filelock import FileLock

    path, done = root() / name, root() / f"{name}.done"
    with FileLock(str(root() / f"{name}.lock")):
        if not done.exists():
            if path.exists():  # a make that failed in another test: begin again
                shutil.rmtree(path)
            make(path)
            done.touch()
    return path
