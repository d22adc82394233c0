"""File locks the trainer holds: fcntl.flock on a lock file opened without following a symlink, its holder's pid,
host, start time and command written in it, so whoever finds it held can say who holds it (the run dir's, a rank's
shard cache dir's, a shared sample index's while one rank fetches it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from vlmprep_schemas.boundary import open_fd_no_follow, read_state

WAIT_S = 600.0  # how long a lock another process holds is waited for before the run stops naming the holder
NOTE_AFTER_S = 10.0  # how long before the wait is said, once
_HELD: set[int] = set()  # this process's lock fds


def _close_held_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file: were it to keep the fd, the lock would outlive
    # its holder until the last worker is reaped, and a restart right after a kill would find it held.
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def take(path: Path) -> tuple[int, str]:
    """(fd holding an exclusive flock on path, '') or (-1, who holds it); (-1, '') where the file system has no
    locks. The holder removes the file while it still holds it: the lock taken must be on the file at `path` now.
    A symlink or special file at `path` is refused (UnsafeWrite), never locked through."""
    while True:
        fd = open_fd_no_follow(path, "lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return -1, ""
            if not isinstance(e, BlockingIOError):
                raise
            return -1, holder(path)
        try:
            mine = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            mine = False
        if mine:
            note = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300],
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(note).encode(), 0)
            _HELD.add(fd)
            return fd, ""
        os.close(fd)


def holder(path: Path) -> str:
    """Who holds the lock at `path`, as its note says (or 'another process')."""
    try:
        note = json.loads(read_state(path, 4096) or b"{}")  # no link or FIFO at it followed
        return f"pid {note['pid']} on {note['host']}, since {note['since']}: `{note['command']}`"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def unlock(fd: int) -> None:
    """Let a lock go and keep its file (others may be waiting on that very file)."""
    if fd >= 0:
        _HELD.discard(fd)
        os.close(fd)


def release(path: Path, fd: int) -> None:
    """Remove the lock file while still holding it (see take), then let it go."""
    if fd >= 0:
        Path(path).unlink(missing_ok=True)
        _HELD.discard(fd)
        os.close(fd)


def wait_for(
    path: Path,
    what: str,
    *,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    wait_s: float | None = None,
) -> int:
    """Take the lock at `path`, waiting while another process holds it: after NOTE_AFTER_S one line says who, and
    after WAIT_S (or `wait_s`) a TimeoutError names the holder and `what` it guards (a stuck rank of another job, a
    stuck network file system lock). -1 where the file system has no locks."""
    limit = WAIT_S if wait_s is None else wait_s
    t0, said, pause = time.monotonic(), False, 0.05
    while True:
        fd, who = take(path)
        if fd >= 0 or not who:
            return fd
        waited = time.monotonic() - t0
        if waited >= limit:
            raise TimeoutError(
                f"{path} ({what}) has been held for {waited:.0f} s by {who}: if that process is stuck, "
                "stop it or remove the lock file, or pass another --shard-cache"
            )
        if not said and waited >= min(NOTE_AFTER_S, limit / 2):
            say(f"trainer: waiting for {path} ({what}), held by {who}")
            said = True
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
