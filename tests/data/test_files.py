"""Written artefacts are complete or absent (grt_common/files.py)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from grt_common.files import atomic_path, atomic_savefig, atomic_write_text  # noqa: E402


def test_a_failed_write_leaves_the_old_file_and_no_debris(tmp_path):
    target = tmp_path / "report.md"
    atomic_write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_savefig_writes_the_format_of_the_final_name(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    atomic_savefig(fig, tmp_path / "loss.png", dpi=50)
    plt.close(fig)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
