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
