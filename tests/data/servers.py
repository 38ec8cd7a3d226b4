"""Real servers for the remote-shard tests, on 127.0.0.1 only: Debian's nginx (HTTP) and moto's
S3 server mode, each logging the body bytes of every response it sends, and Python's own HTTP server
of ranges for what nginx will not do (a body cut short)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"  # never any other address
MOTO_SERVER = Path(__file__).with_name("moto_s3_server.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, what: str, log: Path) -> None:
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


def _log_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Nginx:
    """nginx serving `root` on an ephemeral port. `/denied/` answers 403 and `/busy/` 503; the
    access log has one line per request: method, path, status, body bytes sent, Range header.
    With `tls` (certificate file, key file) it serves HTTPS only."""

    def __init__(self, root: Path, work: Path, tls: tuple[Path, Path] | None = None) -> None:
        if shutil.which("nginx") is None:
            pytest.skip("nginx is not installed (bash scripts/install.sh installs Debian's)")
        self.root, self.work, self.port, self.tls = root, work, free_port(), tls
        self.access_log = work / "access.log"
        self.proc: subprocess.Popen | None = None
        for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (work / d).mkdir(parents=True, exist_ok=True)
        user = "user root;\n" if os.geteuid() == 0 else ""  # its workers must read the test's private temp dirs
        listen = f"{HOST}:{self.port}" + (" ssl" if tls else "")
        certs = f"    ssl_certificate {tls[0]};\n    ssl_certificate_key {tls[1]};\n" if tls else ""
        temps = "".join(f"  {d}_temp_path {work / d};\n" for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (work / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {work / 'nginx.pid'};\nerror_log {work / 'error.log'};\n"
            "events { worker_connections 512; }\nhttp {\n"
            "  log_format bytes '$request_method $uri $status $body_bytes_sent $http_range';\n"
            f"  access_log {self.access_log} bytes;\n{temps}"
            f"  server {{\n    listen {listen};\n{certs}    root {root};\n"
            "    location /denied/ { deny all; }\n    location /busy/ { return 503; }\n  }\n}\n"
        )
        self.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.port}"

    def start(self) -> None:
        conf = self.work / "nginx.conf"
        cmd = ["nginx", "-p", str(self.work), "-e", str(self.work / "error.log"), "-c", str(conf)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        _wait_listening(self.port, self.proc, "nginx", self.work / "error.log")

    def stop(self) -> None:
        """Fast shutdown: open connections are dropped."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def requests(self) -> list[list[str]]:
        return _log_lines(self.access_log)

    def bytes_served(self, prefix: str = "/") -> int:
        return sum(int(r[3]) for r in self.requests() if r[1].startswith(prefix))

    def ranges(self, prefix: str = "/") -> list[tuple[str, int, int]]:
        """(path, first byte, last byte) of every ranged request for a path under `prefix`."""
        out = []
        for r in self.requests():
            if r[1].startswith(prefix) and len(r) > 4 and r[4].startswith("bytes="):
                a, b = r[4][6:].split("-")
                out.append((r[1], int(a), int(b)))
        return out

    def clear_log(self) -> None:
        self.access_log.write_text("")  # nginx appends to the same open file


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
        _wait_listening(self.port, self.proc, "moto server", self.work / "s3.err")

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL_S3": f"http://{HOST}:{self.port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def bytes_served(self, method: str = "GET") -> int:
        return sum(int(r[3]) for r in _log_lines(self.log) if r[0] == method)

    def clear_log(self) -> None:
        self.log.write_text("")

    def stop(self) -> None:
        """Its connections are dropped, and then refused until `start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None


class RangeServer:
    """Python's HTTP/1.0 server of the files under `root` by ranges (206, Content-Range, no
    Content-Length: the body ends when the connection closes), whose first `cuts` answers close
    halfway through the body, as a dropped connection or a proxy would."""

    def __init__(self, root: Path, cuts: int = 0) -> None:
        import http.server

        outer = self
        self.cuts = cuts

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = (root / self.path.lstrip("/")).read_bytes()
                first, last = (int(v) for v in self.headers["Range"].removeprefix("bytes=").split("-"))
                body = data[first : last + 1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{first + len(body) - 1}/{len(data)}")
                self.end_headers()
                if outer.cuts > 0:
                    outer.cuts -= 1
                    body = body[: len(body) // 2]
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
