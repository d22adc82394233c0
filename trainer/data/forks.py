"""Forks with threads: DataLoader workers are forked from the training process while the shard cache's threads work.
A fork copies every lock as it is at that instant, and a lock another thread held then stays held in the child
forever: a resumed run hung because the fetcher's first torch op held glibc's atexit lock while a worker was forked,
and the worker waited on it in torch.set_num_threads. A ForkGate parks the threads that enter it at their step
boundaries for the length of every fork of the process (os.register_at_fork), so no fork sees one of them mid-step.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Iterator

PARK_WAIT_S = 60.0  # how long a fork waits for the gated threads to park; it goes on after that (every wait ends)


class ForkGate:
    """Threads do their work inside `step()` and call `breathe()` between two parts of a long step (a chunk of a
    fetch or a hash); a fork of the process waits until every thread inside is parked at one of those boundaries,
    and the threads go on once the fork is done. A thread must not wait on another gated thread inside a step (it
    would keep the fork waiting); it breathes while it waits instead."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside: dict[int, int] = {}  # thread ident -> its step depth, for the threads mid-step now
        self._forking = False
        _GATES.add(self)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step of a gated thread: no fork happens until it ends or breathes."""
        me = threading.get_ident()
        with self._cond:
            while self._forking and me not in self._inside:
                self._cond.wait()
            self._inside[me] = self._inside.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._inside[me] -= 1
                if not self._inside[me]:
                    del self._inside[me]
                self._cond.notify_all()

    def breathe(self) -> None:
        """A boundary inside a step: a fork waiting for this thread happens now, before the step goes on."""
        me = threading.get_ident()
        with self._cond:
            if not self._forking or me not in self._inside:
                return
            depth = self._inside.pop(me)
            self._cond.notify_all()
            while self._forking:
                self._cond.wait()
            self._inside[me] = depth

    def _park(self, deadline: float) -> None:
        me = threading.get_ident()  # a gated thread that forks itself (a pipe: fetch) is not waited for
        with self._cond:
            self._forking = True
            while any(t != me for t in self._inside) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def _resume(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def _reset(self) -> None:
        # The child has none of the parent's threads, and this lock may have been copied mid-use.
        self._cond = threading.Condition()
        self._inside, self._forking = {}, False


_GATES: "weakref.WeakSet[ForkGate]" = weakref.WeakSet()


def _before_fork() -> None:
    deadline = time.monotonic() + PARK_WAIT_S
    for gate in list(_GATES):
        gate._park(deadline)


def _after_fork_in_parent() -> None:
    for gate in list(_GATES):
        gate._resume()


def _after_fork_in_child() -> None:
    for gate in list(_GATES):
        gate._reset()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
