"""A loopback HTTP file server for tests: serves a directory with HEAD, GET and single-range `Range: bytes=a-b`
requests (206), logs every request (method, path, range, time) for the tests to count, and can corrupt a file's bytes
on the wire. Runs in a thread of the test process: `with RangeServer(root) as srv: srv.url`."""
from __future__ import annotations

import re
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(SimpleHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args) -> None:  # quiet: the requests go to server.log
        pass

    def _file(self) -> Path | None:
        path = Path(self.translate_path(self.path))
        return path if path.is_file() else None

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        rng = self.headers.get("Range")
        self.server.log.append((self.command, self.path, rng, time.time()))
        path = self._file()
        if path is None:
            self.send_error(404)
            return
        data = path.read_bytes()
        if path.name in self.server.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        a, z, status = 0, len(data), 200
        m = _RANGE.match(rng or "")
        if m:
            a, z, status = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data)), 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(z - a))
        if status == 206:
            self.send_header("Content-Range", f"bytes {a}-{z - 1}/{len(data)}")
        self.end_headers()
        if body:
            try:
                self.wfile.write(data[a:z])
            except (BrokenPipeError, ConnectionResetError):
                pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path):
        root = str(root)
        super().__init__(("127.0.0.1", 0), lambda *a, **kw: _Handler(*a, directory=root, **kw))
        self.log: list[tuple] = []
        self.corrupt: set[str] = set()


class RangeServer:
    def __init__(self, root: Path):
        self.server = _Server(Path(root))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def log(self) -> list[tuple]:
        return self.server.log

    def __enter__(self) -> "RangeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

