"""The wheels the GPU check carries (GPU_WHEELS in scripts/gpu_env.sh) are all the GPU machine lacks:
fetched by the docs' own command (for this Python), installed with `--no-index --no-deps` beside
an environment that holds only what the machine has (this machine's copies of those packages,
through a .pth file, in a venv without site packages), then `import deepspeed, webdataset` and
`grt --help` there."""

import importlib.metadata as md
import os
import socket
import subprocess
import sys
import venv

import pytest
from multiproc import REPO
from packaging.requirements import Requirement

# what the GPU machine has of what the project and its wheels import (docs/gpu.md); their own
# dependencies come along. typing_extensions is not among them: its version there may be too old
# for pydantic, so the wheels carry it.
DEVICE_HAS = [
    "torch",
    "triton",
    "numpy",
    "mpi4py",
    "tensorboard",
    "sentencepiece",
    "psutil",
    "py-cpuinfo",
    "msgpack",
    "ninja",
    "einops",
    "tqdm",
    "pyyaml",
    "safetensors",
    "matplotlib",
    "packaging",
]
CARRIED = "typing-extensions"


def _closure(names):
    seen, todo = {}, list(names)
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen or key == CARRIED:
            continue
        seen[key] = dist
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                try:
                    md.distribution(req.name)
                    todo.append(req.name)
                except md.PackageNotFoundError:
                    pass
    return seen.values()


@pytest.fixture(scope="session")
def gpu_wheels(tmp_path_factory):
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        pytest.skip("PyPI unreachable: the wheels cannot be fetched")
    d = tmp_path_factory.mktemp("whl")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = subprocess.run(
        ["bash", "-c", f'. scripts/gpu_env.sh && gpu_env_fetch "{d}" {py}'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.mark.slow
def test_the_carried_wheels_complete_what_the_gpu_machine_has(gpu_wheels, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for dist in _closure(DEVICE_HAS):
        for top in {f.parts[0] for f in dist.files or [] if not f.parts[0].endswith(".data")}:
            src = dist.locate_file(top)
            if src.exists() and not (base / top).exists() and top not in ("..", "bin"):
                (base / top).symlink_to(src)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "device.pth"), "w") as f:
        f.write(f"{base}\n")
    target = tmp_path / "site"
    wheels = sorted(str(p) for p in gpu_wheels.glob("*.whl"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            *wheels,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=f"{target}:{REPO}", CUDA_VISIBLE_DEVICES="")
    check = "import deepspeed, webdataset, pydantic, zstandard; import pretrain.cli; print(deepspeed.__version__)"
    r = subprocess.run([py, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0.19.8" in r.stdout, r.stderr[-3000:]
    r = subprocess.run(
        [py, "-m", "pretrain.cli", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "train" in r.stdout, r.stderr[-3000:]
