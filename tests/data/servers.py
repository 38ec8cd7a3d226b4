"""Real servers for the remote-shard tests, on 127.0.0.1 only: Debian's nginx (HTTP) and moto's
S3 server mode (tests/moto_s3.py, which the checkpoint mirror's tests use too), each logging the body
bytes of every response it sends, and Python's own HTTP server of ranges for what nginx will not do
(a body cut short)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from moto_s3 import HOST, MotoS3, free_port, log_lines, wait_listening

__all__ = ["HOST", "MotoS3", "Nginx", "RangeServer", "free_port"]


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
        wait_listening(self.port, self.proc, "nginx", self.work / "error.log")

    def stop(self) -> None:
        """Fast shutdown: open connections are dropped."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def requests(self) -> list[list[str]]:
        return log_lines(self.access_log)

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
