"""One owner per dataset dir: an advisory fcntl.flock on DIR/.vlmprep.lock, the holder (command, pid, host, since)
written in it. A whole build and `vlmprep merge` hold it exclusively (a `vlmprep watch` holds DIR/.vlmprep.watch.lock
for its whole run, and the build lock for each cycle's build); `--task-index` runs share it (a Slurm array of
them on one --out is the normal case) and each holds tasks/task-NNNNN.lock alone, so no task runs twice at once. The
kernel drops a lock when its process dies: a lock file left behind by a killed process never blocks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Iterator

from vlmprep.shards.dataset import LOCK_NAME, TASKS_DIR, WATCH_LOCK, task_file
from vlmprep.types import UserError
from vlmprep_schemas.boundary import UnsafeWrite, open_fd_no_follow, read_state, state_dir


class BusyError(UserError):
    """Another process owns the dir (or the task): one line naming it."""


_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _holder_note() -> bytes:
    command = " ".join([Path(sys.argv[0]).name or "python", *sys.argv[1:]])[:300]
    return json.dumps(
        {
            "command": command,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    ).encode()


def _describe(path: Path) -> str:
    """Who holds `path`, as its holder wrote it (the file may be empty for a moment after the holder took it)."""
    try:
        note = json.loads(read_state(path, 4096) or b"{}")
    except (OSError, ValueError):
        note = {}
    if not isinstance(note, dict) or "pid" not in note:
        return "another process"
    return f"`{note.get('command', '?')}` (pid {note['pid']} on {note.get('host', '?')}, since {note.get('since')})"


def _lock(path: Path, *, shared: bool) -> int | None:
    """The fd holding `path` locked, None when another process holds it, -1 where the file system has no locks.
    A holder removes the file on release while it still holds it, so the lock taken here must be on the file that
    is at `path` now, not on one unlinked meanwhile. The dir it is in must be a real one (no link followed)."""
    while True:
        try:
            state_dir(path.parent)
            fd = open_fd_no_follow(path, "lock")
        except UnsafeWrite as e:
            raise UserError(str(e)) from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            os.close(fd)
            if e.errno in _UNSUPPORTED:
                return -1
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _release(path: Path, fd: int) -> None:
    """Remove the lock file if no other process shares it, then unlock."""
    if fd < 0:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last sharer (or the exclusive holder) removes the file
        path.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _held(path: Path, *, shared: bool, refuse: Callable[[str], str]) -> Iterator[None]:
    """`path` locked (shared or alone) while the block runs; BusyError(refuse(the holder described)) if it is taken."""
    fd = _lock(path, shared=shared)
    if fd is None:
        raise BusyError(refuse(_describe(path)))
    if fd >= 0:  # a shared holder only clears the note: no one holds the lock alone while it is shared
        os.ftruncate(fd, 0)
        if not shared:
            os.pwrite(fd, _holder_note(), 0)
    try:
        yield
    finally:
        _release(path, fd)


def _running_tasks(out: Path) -> list[str]:
    """The --task-index runs holding their task's lock now, described."""
    held = []
    for p in sorted((out / TASKS_DIR).glob("task-*.lock")):
        fd = _lock(p, shared=True)
        if fd is None:
            held.append(f"task {int(p.name[5:10])}: {_describe(p)}")
        elif fd >= 0:
            _release(p, fd)
    return held


def own_out(out: Path) -> AbstractContextManager[None]:
    """A whole build or a merge: --out is this process's alone, or BusyError naming who has it."""
    out = Path(out)

    def refuse(who: str) -> str:
        if tasks := _running_tasks(out):
            who = f"--task-index runs ({'; '.join(tasks[:3])}{' ...' if len(tasks) > 3 else ''})"
        return (
            f"--out {out} is in use by {who}; wait for it to end (or stop it), or build into another --out; "
            "two builds writing one dir would corrupt each other's files"
        )

    return _held(out / LOCK_NAME, shared=False, refuse=refuse)


def share_out(out: Path) -> AbstractContextManager[None]:
    """A --task-index run: any number of them share --out, never with a whole build or a merge."""
    out = Path(out)
    end = "which owns the whole dir; wait for it to end (or stop it) before running tasks there"
    return _held(out / LOCK_NAME, shared=True, refuse=lambda who: f"--out {out} is in use by {who}, {end}")


def own_task(out: Path, index: int) -> AbstractContextManager[None]:
    """Task `index` of --out runs in one process at a time (any executor: a pool or Ray worker, a --task-index run)."""
    out, why = Path(out), "two runs of one task would write the same shards: wait for it to end (or stop it)"
    return _held(
        out / task_file(index, ".lock"),
        shared=False,
        refuse=lambda who: f"{out}: task {index} is already running in {who}; {why}",
    )


def own_watch(out: Path) -> AbstractContextManager[None]:
    """A `vlmprep watch` on a local --out: one watcher at a time (its builds take --out's own lock each cycle, so a
    `build --append` runs between cycles, never beside one), or BusyError naming the watcher that has it."""
    out, why = Path(out), "one watcher per dataset: stop that one first, or watch into another --out"
    return _held(out / WATCH_LOCK, shared=False, refuse=lambda who: f"--out {out} is watched already by {who}; {why}")
