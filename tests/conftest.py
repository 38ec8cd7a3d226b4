import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GRT_SHARED_DIR", REPO.parent / "shared"))
DEMO_TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def demo_text() -> Path:
    return DEMO_TEXT


@pytest.fixture(scope="session")
def shards(tmp_path_factory, demo_text) -> Path:
    """A tokenizer (vocab 512) and seq-64 shards of the bundled text with a validation
    split, made once per test session with the real `grt data` commands."""
    from multiproc import grt

    d = tmp_path_factory.mktemp("data")
    for args in (
        [
            "data",
            "tokenizer",
            "-i",
            str(demo_text),
            "--txt-mode",
            "paragraph",
            "--vocab-size",
            "512",
            "-o",
            str(d / "tok"),
            "-q",
        ],
        [
            "data",
            "prepare",
            "-i",
            str(demo_text),
            "--txt-mode",
            "paragraph",
            "-t",
            str(d / "tok.model"),
            "-o",
            str(d / "shards"),
            "--seq-len",
            "64",
            "--shard-size-mb",
            "0.1",
            "--val-fraction",
            "0.05",
            "-q",
        ],
    ):
        r = grt(*args)
        assert r.returncode == 0, r.stderr
    return d / "shards" / "manifest.json"


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # transformers and lm-eval never reach a hub


@pytest.fixture
def offline(monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
