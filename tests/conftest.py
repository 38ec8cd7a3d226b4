import os
import shutil
from pathlib import Path

import pytest
import shared_artifacts
from dev_extra import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

ARTIFACTS = pytest.StashKey[str]()  # the controller's shared folder (shared_artifacts.py)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GRT_SHARED_DIR", REPO.parent / "shared"))
DEMO_TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"


def pytest_configure(config) -> None:
    """A pytest-xdist worker per core and one more (scripts/test.sh): each one computes with one
    thread. torch's default of a thread per core puts two workers' threads on each core, where OpenMP's waits spin:
    a micro model's training ran 4.5x slower so (301 s against 68 s for 300 steps, two workers busy).
    The controller makes the folder of what the workers share (tests/shared_artifacts.py), and hands
    the units out in the order pytest_collection_modifyitems gives them: pytest-xdist (3.x) would
    otherwise reorder them by their number of tests, which put the few long tests of a unit such as
    test_loop_computes.py (4 tests, 257 s) among the last units, to run while the other worker idled."""
    config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    elif not os.environ.get(shared_artifacts.ROOT_ENV):
        config.stash[ARTIFACTS] = shared_artifacts.make_root()


def pytest_unconfigure(config) -> None:
    root = config.stash.get(ARTIFACTS, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        os.environ.pop(shared_artifacts.ROOT_ENV, None)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def demo_text() -> Path:
    return DEMO_TEXT


@pytest.fixture(scope="session")
def shards(demo_text) -> Path:
    """A tokenizer (vocab 512) and seq-64 shards of the bundled text with a validation
    split, made once per test run with the real `grt data` commands."""
    from commands import data_commands, manifest_of
    from multiproc import grt

    def make(d: Path) -> None:
        for args in data_commands(demo_text, d):
            r = grt(*args)
            assert r.returncode == 0, r.stderr

    return manifest_of(shared_artifacts.made_once("shards", make))


# Modules whose tests must not run beside each other's (one xdist worker runs them in turn):
# namespace clusters and Slurm clusters share /etc/netns and /run/sshd, which the last
# cluster to stop removes.
CLUSTER_MODULES = ("test_launcher_slurm.py", "test_multinode.py", "test_multinode_diagnostics.py", "test_elastic.py")


# The longest units of work, longest first: pytest-xdist hands units out in collection order, so a
# long unit collected last runs alone at the end while the other worker idles (a 15-minute tail).
# Measured with `--durations=0` over the whole suite (each unit's summed test times, 2026-12-03; the
# loop check: ~130 s alone since its block loops twice, 2026-12-05). After them the units with a slow
# test, then the rest. The first units go one to each worker (pytest-xdist gives each node one unit,
# then more only when it has 2 tests or fewer left).
LONGEST_FIRST = (
    "cluster",  # ~420 s
    "tests/faults/test_reliability.py",
    "tests/launch/test_gpu_check.py",
    "tests/model/test_loop_computes.py",
    "tests/training/test_muon.py",
    "tests/faults/test_bad_input_runs.py",
    "tests/training/test_trainer.py",
    "tests/launch/test_launcher_train.py",
    "tests/training/test_watching.py",
    "tests/faults/test_async_save.py",
    "tests/training/test_resume_world_size.py",
    "tests/model/test_baselines.py",
    "tests/data/test_mixture.py",
    "tests/launch/test_launcher_real.py",
    "tests/training/test_comm.py",
    "tests/infer/test_lm_eval.py",
    "tests/faults/test_bad_input.py",
    "tests/training/test_universal_checkpoint.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (--dist loadgroup)
def pytest_collection_modifyitems(items):
    """Each module is one unit of work for pytest-xdist (its module and session fixtures are
    made once, on one worker), the cluster modules together; the longest units first."""
    unit, slow = {}, set()
    for item in items:
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            module = item.nodeid.split("::")[0]
            marker = pytest.mark.xdist_group("cluster" if item.path.name in CLUSTER_MODULES else module)
            item.add_marker(marker)
        unit[item.nodeid] = marker.args[0] if marker.args else marker.kwargs.get("name", "")
        if item.get_closest_marker("slow") is not None:
            slow.add(unit[item.nodeid])
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> tuple[int, bool]:  # stable: otherwise as collected
        name = unit[item.nodeid]
        return order.get(name, len(order)), name not in slow

    items.sort(key=rank)


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # transformers and lm-eval never reach a hub


@pytest.fixture
def offline(monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
