"""A loopback HTTP file server for tests: serves a directory with HEAD, GET and single-range `Range: bytes=a-b`
requests (206), logs every request (method, path, range, time) for the tests to count, and can corrupt a file's bytes
on the wire, or misbehave as a hostile server does: ignore Range, send an endless body, a gzip body that decodes to
far more than it sends, or drip one byte at a time; or as a dynamic one does: a chunked body with no length
(optionally gzip-encoded), headers then silence, an ETag per file (and a file replaced just before its next GET), a
403, a directory page of chosen links. Runs in a thread of the test process: `with RangeServer(root) as srv: srv.url`."""

from __future__ import annotations

import gzip
import hashlib
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
        name = self.path.rsplit("/", 1)[-1]
        if (body or name in self.server.redirect or name in self.server.mute) and self._hostile(name):
            return
        if name in self.server.forbidden:
            self.send_error(403)
            return
        if self.path in self.server.pages:  # a directory listing of the test's own links
            page = self.server.pages[self.path].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if body:
                self.wfile.write(page)
            return
        path = self._file()
        if path is None:
            self.send_error(404)
            return
        if body and name in self.server.swap:  # replaced between the reader's check (a HEAD) and its read
            path.write_bytes(self.server.swap.pop(name))
        data = path.read_bytes()
        if path.name in self.server.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        if name in self.server.chunked:
            self._chunked(data, body=body)
            return
        a, z, status = 0, len(data), 200
        m = None if self.server.no_ranges else _RANGE.match(rng or "")
        if m:
            a, z, status = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data)), 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(z - a))
        if status == 206:
            self.send_header("Content-Range", f"bytes {a}-{z - 1}/{len(data)}")
        if self.server.etags:
            self.send_header("ETag", self.server.etag_of(data))
        self.end_headers()
        if body and name in self.server.stall:  # the headers, then nothing
            self.server.closing.wait(60)
            return
        if body:
            try:
                self.wfile.write(data[a:z])
            except (BrokenPipeError, ConnectionResetError):
                pass

    def _chunked(self, data: bytes, *, body: bool) -> None:
        """The whole file, Range ignored, with no Content-Length (Transfer-Encoding: chunked), gzip-encoded where the
        test says, as a dynamic server sends it."""
        gz = self.server.chunked[self.path.rsplit("/", 1)[-1]]
        if gz:
            data = gzip.compress(data)
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        if gz:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        if not body:
            return
        try:
            for i in range(0, len(data), 8192):
                part = data[i : i + 8192]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _hostile(self, name: str) -> bool:
        srv = self.server
        if name in srv.redirect:  # to srv.redirect[name] (a file:// URL, or itself: a loop)
            self.send_response(302)
            self.send_header("Location", srv.redirect[name])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        if name in srv.silent | srv.mute:  # accepts, then says nothing
            srv.closing.wait(10)
            return True
        if not {name} & (srv.endless | srv.gzip.keys() | srv.drip):
            return False
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        try:
            if name in srv.gzip:  # a small body that decodes to srv.gzip[name] bytes of "{"
                data = gzip.compress(b"{" * srv.gzip[name], compresslevel=9)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif name in srv.endless:  # no length, never ends (until the client hangs up)
                self.end_headers()
                block = b"[" * 65536
                while True:
                    self.wfile.write(block)
                    srv.sent += len(block)
            else:  # a byte every 50 ms, forever
                self.end_headers()
                while True:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    srv.sent += 1
                    time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path):
        root = str(root)
        super().__init__(("127.0.0.1", 0), lambda *a, **kw: _Handler(*a, directory=root, **kw))
        self.log: list[tuple] = []
        self.corrupt: set[str] = set()
        self.no_ranges = False  # answer every GET with the whole file (200), as a server without Range support does
        self.endless: set[str] = set()  # file names answered with an endless body
        self.gzip: dict[str, int] = {}  # file name -> decoded bytes of a gzip-encoded body
        self.drip: set[str] = set()  # file names answered a byte at a time
        self.silent: set[str] = set()  # file names whose GET is never answered
        self.mute: set[str] = set()  # file names never answered, a HEAD neither
        self.redirect: dict[str, str] = {}  # file name -> where a 302 sends it
        self.chunked: dict[str, bool] = {}  # file name -> sent chunked with no length (True: gzip-encoded too)
        self.stall: set[str] = set()  # file names whose GET gets its headers, then nothing
        self.etags = False  # send an ETag (of the bytes) with every file
        self.swap: dict[str, bytes] = {}  # file name -> the bytes it is replaced by just before its next GET
        self.forbidden: set[str] = set()  # file names answered 403
        self.pages: dict[str, str] = {}  # request path -> the HTML page served for it (a listing)
        self.sent = 0  # bytes of hostile bodies sent
        self.closing = threading.Event()  # set on exit: a stalled handler returns

    @staticmethod
    def etag_of(data: bytes) -> str:
        """The ETag sent with these bytes (where etags is on)."""
        return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


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
        self.server.closing.set()
        self.server.shutdown()
        self.server.server_close()
