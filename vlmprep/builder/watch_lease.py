"""One `vlmprep watch` per dataset. A local --out: owner.own_watch's lock, DIR/.vlmprep.watch.lock (the kernel drops
it with its process). An --out in a bucket has no lock, so a watcher holds a lease: the object
.vlmprep.watch.lease-00000N, created exclusively (the store's conditional create, the same one a version's commit
uses), naming its holder, renewed by a thread every quarter of its term. A second watcher is refused while the lease
is live; it takes over one that expired (or whose holder on this host is gone: a kill -9, restarted) by creating the
next number exclusively, so of two that try, one wins. A holder that finds the next number taken has lost its lease
and stops before its next build (a version's commit stays exclusive on its own: the lease only names who builds).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from vlmprep.builder.owner import BusyError, own_watch
from vlmprep.builder.store import Bucket, is_store
from vlmprep.builder.store_versions import check_conditional_writes
from vlmprep.ingest import LocationError
from vlmprep.shards.dataset import WATCH_LEASE
from vlmprep.types import UserError
from vlmprep_schemas.boundary import state_dir

_NAME = re.compile(rf"^{re.escape(WATCH_LEASE)}-([0-9]{{6}})$")
NOTE_BYTES = 1 << 16  # a lease note is a few hundred bytes


class LeaseLost(UserError):
    """Another watcher took this watcher's lease over (it was not renewed in time): this one stops."""


def _start_ticks(pid: int) -> str | None:
    """The start time of process `pid` (Linux: /proc/PID/stat field 22), so a reused pid is not taken for the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _gone(note: dict) -> bool:
    """Whether the holder named in `note` ran on this host and its process is gone (or is another one by now)."""
    if note.get("host") != socket.gethostname() or not isinstance(note.get("pid"), int):
        return False
    ticks = _start_ticks(note["pid"])
    if ticks is None:
        try:
            os.kill(note["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return note.get("start") is not None and ticks != note["start"]


def _who(note: dict) -> str:
    return f"`{note.get('command', '?')}` (pid {note.get('pid')} on {note.get('host')}, since {note.get('since')})"


class Lease:
    """A watcher's lease on a dataset in a bucket: number N (the object WATCH_LEASE-00000N), renewed by a thread."""

    def __init__(self, bucket: Bucket, ttl: float):
        self.bucket, self.ttl, self.number = bucket, ttl, 0
        self.note = {
            "command": " ".join([Path(sys.argv[0]).name or "python", *sys.argv[1:]])[:300],
            "pid": os.getpid(),
            "start": _start_ticks(os.getpid()),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "ttl": ttl,
        }
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _name(self, n: int) -> str:
        return f"{WATCH_LEASE}-{n:06d}"

    def _body(self) -> bytes:
        return json.dumps({**self.note, "renewed": time.time()}, sort_keys=True).encode()

    def acquire(self, say: Callable[[str], None]) -> None:
        """Create lease N+1 over the highest one N where that is free (expired, or its holder gone); BusyError naming
        the live holder otherwise, or where another watcher created N+1 first."""
        have = self.bucket.names()
        numbers = sorted(int(m.group(1)) for k in have if (m := _NAME.match(k)))
        top = numbers[-1] if numbers else 0
        if top:
            note = self._read(self._name(top), have[self._name(top)])
            if (
                note is not None
                and not _gone(note)
                and time.time() - float(note.get("renewed", 0)) <= float(note.get("ttl", self.ttl))
            ):
                raise BusyError(
                    f"--out {self.bucket.url} is watched already by {_who(note)} (its lease {self._name(top)}); one "
                    "watcher per dataset: stop that one first, or wait until its lease expires"
                )
            why = "its process is gone" if note is not None and _gone(note) else "it expired"
            say(f"taking over the lease of {_who(note or {})} on {self.bucket.url} ({why})")
        try:
            self.bucket.create(self._name(top + 1), self._body())
        except FileExistsError:
            raise BusyError(
                f"--out {self.bucket.url}: another watcher took its lease ({self._name(top + 1)}) just now; one "
                "watcher per dataset"
            ) from None
        self.number = top + 1
        self.bucket.remove([self._name(n) for n in numbers])

    def _read(self, name: str, size: int) -> dict | None:
        """A lease note (None where unreadable: treated as expired)."""
        if size > NOTE_BYTES:
            return None
        try:
            note = json.loads(self.bucket.read(name, size) or b"null")
        except (ValueError, LocationError):
            return None
        return note if isinstance(note, dict) else None

    def renew(self) -> None:
        """Write the lease again with the time now; mark it lost where the next number exists (taken over)."""
        if self.bucket.sizes([self._name(self.number + 1)]):
            self.lost.set()
            return
        self.bucket.put_bytes(self._name(self.number), self._body())

    def _renewing(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self.renew()
            except (LocationError, OSError):
                continue  # a store that does not answer now: the next renewal tries again, within the term
            if self.lost.is_set():
                return

    def start(self) -> None:
        """Renew the lease every quarter of its term, on a daemon thread."""
        self._thread = threading.Thread(target=self._renewing, name="vlmprep-watch-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """LeaseLost where another watcher took the lease over."""
        if self.lost.is_set():
            raise LeaseLost(
                f"--out {self.bucket.url}: another watcher took this watcher's lease over (it was not renewed within "
                f"{self.ttl:g} s); this one stops: nothing it had not committed is lost"
            )

    def release(self) -> None:
        """Stop renewing and remove the lease (where it is still this watcher's), so a restart need not wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.lost.is_set():
            with contextlib.suppress(LocationError, OSError):
                self.bucket.remove([self._name(self.number)])


@contextlib.contextmanager
def watching(out: str, *, ttl: float, say: Callable[[str], None]) -> Iterator[Lease | None]:
    """Hold --out for one watcher: the lease of a bucket's (yielded, for its check before each build; the store first
    probed for conditional creates), or a local dir's watch lock (made where absent). BusyError naming the watcher
    that holds it."""
    if is_store(out):
        lease = Lease(Bucket(out), ttl)
        check_conditional_writes(lease.bucket)  # a store that ignores them would let two watchers hold the lease
        lease.acquire(say)
        lease.start()
        try:
            yield lease
        finally:
            lease.release()
        return
    state_dir(out)
    with own_watch(Path(out)):
        yield None
