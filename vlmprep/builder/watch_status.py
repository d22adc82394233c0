"""What `vlmprep watch` says about itself: one Status (the latest version, the objects pending and changed, this run's
counts, the last cycle and its error), written as a JSON file after every change (atomic, its temp file opened
without following a link, a link or FIFO planted at its name refused at start) and served by a stdlib HTTP thread:
`/healthz` (200 while the loop runs and its last cycle succeeded, 503 after a fault) and `/metrics` (Prometheus
text format). Everything taken from a bucket or a file name is escaped before it is shown.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from vlmprep.shards.dataset import write_bytes_atomic
from vlmprep.types import UserError
from vlmprep_schemas.terminal import for_terminal

SHOWN = 20  # pending or changed objects named in the status (the counts are whole)
# The states a watcher is in; /healthz is 503 in the last two (and after a failed cycle, until one succeeds).
STATES = ("starting", "listing", "building", "waiting", "stopping", "stopped", "failed")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Status:
    """The watcher's state, shared by the loop (which updates it) and the HTTP thread (which reads it): a lock
    guards it, and every update rewrites the status file."""

    def __init__(self, *, location: list[str], out: str, status_file: str | None):
        self._lock = threading.Lock()
        self.file = Path(status_file) if status_file else None
        self.data: dict = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _now(),
            "location": list(location),
            "out": out,
            "state": "starting",
            "latest_version": None,
            "dataset": None,
            "pending": {"objects": 0, "records": None, "first": []},
            "changed": {"objects": 0, "first": []},
            "cycles": 0,
            "failures": 0,
            "consecutive_failures": 0,
            "retry_in": None,
            "last_cycle": None,
            "last_error": None,
            "built": {"versions": 0, "records": 0, "samples": 0, "rejects": {}},
            "status_url": None,
        }

    def update(self, **changes) -> None:
        """Set top-level fields, then write the status file."""
        with self._lock:
            self.data.update(changes, updated=_now())
            data = json.dumps(self.data, indent=2, sort_keys=True) + "\n"  # ASCII: control characters as \\u escapes
        if self.file is not None:
            write_bytes_atomic(self.file, data.encode(), tmp_suffix=f".{os.getpid()}.tmp")

    def count_version(self, added: dict) -> None:
        """Add what one committed version added (its totals and rejects) to this run's counts."""
        with self._lock:
            built = self.data["built"]
            built["versions"] += 1
            built["records"] += int(added["totals"].get("records", 0))
            built["samples"] += int(added["totals"].get("samples", 0))
            for reason, n in added["rejects"].items():
                built["rejects"][reason] = built["rejects"].get(reason, 0) + int(n)

    def snapshot(self) -> dict:
        """A copy of the state, for a reader on another thread."""
        with self._lock:
            return json.loads(json.dumps(self.data))

    def healthy(self) -> bool:
        """The loop runs and its last cycle succeeded."""
        return _healthy(self.snapshot())


def check_status_file(path: str | None) -> None:
    """A status file path must be a plain file or nothing yet: a link or FIFO planted there is refused at start (each
    write replaces the name itself, never what it points to)."""
    if path is None:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = Path(path).parent
        if not parent.is_dir():
            raise UserError(
                f"--status-file {path}: no such directory {parent}; make it, or name a file in one"
            ) from None
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a plain file (a FIFO, device or dir)"
        raise UserError(
            f"--status-file {path} is {kind}: refusing to write through it (someone may have planted it); remove it "
            "or name another file"
        )


def _label(value) -> str:
    """A Prometheus label value: escaped for the terminal-safe text, then for the format (backslash, quote, newline)."""
    text = for_terminal(str(value))[:200]
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    lines += [f"# HELP vlmprep_watch_{name} {help_text}", f"# TYPE vlmprep_watch_{name} {kind}"]
    for labels, value in samples:
        shown = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        lines.append(f"vlmprep_watch_{name}{'{' + shown + '}' if shown else ''} {value}")


def metrics_text(d: dict) -> str:
    """A status snapshot in the Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []
    last = d["last_cycle"] or {}
    dataset = d["dataset"] or {}
    built = d["built"]
    gauges = [
        ("up", "1 while the watch loop runs and its last cycle succeeded", int(_healthy(d))),
        ("latest_version", "The dataset's latest committed version (0: none yet)", d["latest_version"] or 0),
        ("dataset_samples", "Samples in the latest version", dataset.get("samples", 0)),
        ("dataset_records", "Records read into the latest version", dataset.get("records", 0)),
        ("pending_objects", "Input objects listed and in no version yet", d["pending"]["objects"]),
        ("changed_objects", "Built input objects whose size or ETag changed since", d["changed"]["objects"]),
        ("consecutive_failures", "Cycles failed in a row (retried with backoff)", d["consecutive_failures"]),
        ("last_cycle_seconds", "Wall time of the last cycle", round(float(last.get("seconds") or 0.0), 3)),
        ("last_cycle_failed", "1 when the last cycle ended in a fault", int(bool(last.get("error")))),
    ]
    for name, text, value in gauges:
        _metric(lines, name, "gauge", text, [({}, value)])
    if d["pending"]["records"] is not None:
        _metric(lines, "pending_records", "gauge", "Records in the pending objects", [({}, d["pending"]["records"])])
    counters = [
        ("versions_committed_total", "Versions this watcher committed", built["versions"]),
        ("records_built_total", "Records this watcher read into committed versions", built["records"]),
        ("samples_built_total", "Samples this watcher committed", built["samples"]),
        ("cycles_total", "Cycles run (listings of the location)", d["cycles"]),
        ("cycle_failures_total", "Cycles that ended in a fault", d["failures"]),
    ]
    for name, text, value in counters:
        _metric(lines, name, "counter", text, [({}, value)])
    rejects = [({"reason": r}, n) for r, n in sorted(built["rejects"].items())]
    _metric(lines, "rejects_total", "counter", "Records rejected in committed versions, by reason", rejects)
    if last.get("error"):
        _metric(lines, "last_error_info", "gauge", "The last cycle's fault", [({"error": last["error"]}, 1)])
    return "\n".join(lines) + "\n"


def _healthy(d: dict) -> bool:
    return d["state"] not in ("stopped", "failed") and d["consecutive_failures"] == 0


def serve(status: Status, host: str, port: int) -> ThreadingHTTPServer:
    """Start the status server (a daemon thread) on host:port (0: any free port): GET /healthz, /metrics. The
    caller shuts it down."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            d = status.snapshot()
            if path == "/healthz":
                ok = _healthy(d)
                why = (d["last_cycle"] or {}).get("error") or d["last_error"] or d["state"]
                body, code, kind = ("ok\n" if ok else f"{for_terminal(why)}\n"), 200 if ok else 503, "text/plain"
            elif path == "/metrics":
                body, code, kind = metrics_text(d), 200, "text/plain; version=0.0.4"
            else:
                body, code, kind = "not found: /healthz or /metrics\n", 404, "text/plain"
            data = body.encode("utf-8", "backslashreplace")
            self.send_response(code)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args) -> None:
            pass  # a probe every few seconds is no news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="vlmprep-watch-status", daemon=True).start()
    return server
