"""moto's S3 server mode on 127.0.0.1:PORT, appending `method path status body-bytes` to LOG for
every response (moto's own request log has no byte counts), and answering 503 to the requests that
LOG.faults names (one `METHOD SUBSTRING COUNT` a line: the next COUNT requests of that method whose
path holds SUBSTRING; COUNT -1: every one), read at each request: a dropped upload. Usage:
moto_s3_server.py PORT LOG [BUCKET PREFIX FILE...]: with a bucket, it is made and each FILE put
at PREFIX/NAME before the port listens, so a restarted server (moto keeps its state in memory
only) serves the same objects from its first request."""

import sys
import threading

from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

_lock = threading.Lock()


def counting(app, log_path):
    faults_path = log_path + ".faults"

    def dropped(environ) -> bool:
        """Whether LOG.faults drops this request (a matching line's count taken down by one)."""
        with _lock:
            try:
                lines = [line.split() for line in open(faults_path).read().splitlines() if line.strip()]
            except FileNotFoundError:
                return False
            for i, (method, part, count) in enumerate(lines):
                if method == environ["REQUEST_METHOD"] and part in environ.get("PATH_INFO", "") and count != "0":
                    lines[i][2] = str(int(count) - 1) if count != "-1" else count
                    with open(faults_path, "w") as fh:
                        fh.write("".join(" ".join(f) + "\n" for f in lines))
                    return True
        return False

    def wrapped(environ, start_response):
        if dropped(environ):
            refusal = b"<Error><Code>ServiceUnavailable</Code><Message>dropped by the test</Message></Error>"
            start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
            with _lock, open(log_path, "a") as fh:
                fh.write(f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')} 503 {len(refusal)}\n")
            return [refusal]
        status = []

        def start(code, headers, exc_info=None):
            status.append(code.split()[0])
            return start_response(code, headers, exc_info)

        body = list(app(environ, start))
        sent = sum(len(part) for part in body)
        with _lock, open(log_path, "a") as fh:
            fh.write(f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')} {status[0]} {sent}\n")
        return body

    return wrapped


if __name__ == "__main__":
    port, log = int(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3:
        from pathlib import Path

        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        bucket, prefix = sys.argv[3], sys.argv[4]
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        backend.create_bucket(bucket, "us-east-1")
        for f in map(Path, sys.argv[5:]):
            backend.put_object(bucket, f"{prefix}/{f.name}", f.read_bytes())
    app = counting(DomainDispatcherApplication(create_backend_app), log)
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()
