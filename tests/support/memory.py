"""Peak resident memory of a command and of every process it starts (the main process, pool workers, a forkserver),
each one's own VmHWM polled while it lives. Not ru_maxrss: Linux carries that across fork+exec, so a child started
by a big process (pytest, a benchmark runner) would report its parent's peak."""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessPeak:
    pid: int
    role: str  # main, worker (forked from main, or a forkserver's child), forkserver, resource_tracker, child
    peak_mb: float  # VmHWM at the last poll, MiB
    rss_file_mb: float  # file-backed pages at that poll (shared libraries: mapped once for every process)


def _status(pid: int) -> dict[str, float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {
                k: int(v.split()[0]) / 1024
                for k, _, v in (line.partition(":") for line in f)
                if k in ("VmHWM", "RssFile")
            }
    except (OSError, ValueError):
        return {}


def _role(proc, main_pid: int, main_cmd: str, roles: dict[int, str]) -> str:
    import psutil

    try:
        cmd = " ".join(proc.cmdline())
        parent = proc.ppid()
    except psutil.Error:
        return "child"
    if proc.pid == main_pid:
        return "main"
    if parent == main_pid and cmd == main_cmd:  # forked from main: a pool worker has main's command line
        return "worker"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    if "forkserver" in cmd:
        return "worker" if roles.get(parent) == "forkserver" else "forkserver"
    return "child"


def peak_rss(
    cmd: list[str], *, env: dict | None = None, cwd=None, timeout: float = 900, interval: float = 0.05
) -> tuple[int, str, list[ProcessPeak]]:
    """Run cmd to its end; returns (exit status, stderr, each process's peak in start order)."""
    import psutil

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        peaks: dict[int, ProcessPeak] = {}
        roles: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                assert time.monotonic() < deadline, f"{cmd[:3]} still running after {timeout} s"
                try:
                    root = psutil.Process(proc.pid)
                    tree = [root] + root.children(recursive=True)
                except psutil.Error:
                    tree = []
                for p in tree:
                    if p.pid not in roles:
                        roles[p.pid] = _role(p, proc.pid, " ".join(cmd), roles)
                    now = _status(p.pid)
                    if now.get("VmHWM") and now["VmHWM"] >= getattr(peaks.get(p.pid), "peak_mb", 0.0):
                        peaks[p.pid] = ProcessPeak(p.pid, roles[p.pid], now["VmHWM"], now.get("RssFile", 0.0))
                time.sleep(interval)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return proc.returncode, err.read(), list(peaks.values())
