"""moto's S3 server mode on 127.0.0.1:PORT, appending `method path status body-bytes` to LOG for
every response (moto's own request log has no byte counts). Usage: moto_s3_server.py PORT LOG"""

import sys
import threading

from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

_lock = threading.Lock()


def counting(app, log_path):
    def wrapped(environ, start_response):
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
    app = counting(DomainDispatcherApplication(create_backend_app), log)
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()
