"""moto's S3 server mode on 127.0.0.1, for every test that needs an S3 endpoint (the remote shards'
tests/data/test_remote_shards.py, the checkpoint mirror's tests/training/test_checkpoint_mirror.py):
`MotoS3`, and the `moto_s3` fixture. The server itself: tests/data/moto_s3_server.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HOST = "127.0.0.1"  # never any other address
MOTO_SERVER = Path(__file__).parent / "data" / "moto_s3_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text() if log.exists() else ''}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} is not listening on {HOST}:{port} after 30 s")


def log_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class MotoS3:
    """moto's S3 server mode on an ephemeral port, its request log giving body bytes sent; the
    environment that s3fs/boto3 read (endpoint, dummy credentials, region) is set by `env`.
    `seed` (bucket, key prefix, files) is put in before the port listens, at every `start`: a
    restart (`stop`, `start`) serves the same objects on the same port."""

    def __init__(self, work: Path, seed: tuple[str, str, list[Path]] | None = None) -> None:
        pytest.importorskip("s3fs")
        pytest.importorskip("moto.server")
        self.port, self.log, self.work, self.seed = free_port(), work / "s3.log", work, seed
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [str(self.port), str(self.log)]
        if self.seed is not None:
            bucket, prefix, files = self.seed
            args += [bucket, prefix, *map(str, files)]
        with open(self.work / "s3.err", "a") as err:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, str(MOTO_SERVER), *args], stdout=subprocess.DEVNULL, stderr=err
            )
        wait_listening(self.port, self.proc, "moto server", self.work / "s3.err")

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL_S3": f"http://{HOST}:{self.port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def bytes_served(self, method: str = "GET") -> int:
        return sum(int(r[3]) for r in log_lines(self.log) if r[0] == method)

    def clear_log(self) -> None:
        self.log.write_text("")

    def requests(self) -> list[list[str]]:
        """(method, path, status, body bytes) of every response so far."""
        return log_lines(self.log)

    def drop(self, method: str, part: str, count: int = -1) -> None:
        """Answer 503 to the next `count` (-1: every) `method` requests whose path holds `part`."""
        with open(f"{self.log}.faults", "a") as fh:
            fh.write(f"{method} {part} {count}\n")

    def stop(self) -> None:
        """Its connections are dropped, and then refused until `start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture
def moto_s3(tmp_path, monkeypatch):
    """A fresh moto S3 server, its endpoint and dummy credentials in this process's environment
    (and so in the commands it starts); stopped at the end."""
    (tmp_path / "moto").mkdir()
    server = MotoS3(tmp_path / "moto")
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    yield server
    server.stop()
