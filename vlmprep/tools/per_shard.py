"""The per-shard work of the commands that read every sample (verify, stats) in --workers processes forked from the
command's own: each shard's result comes back in manifest order, so the output is the same for any count; a progress
bar over shards on a terminal.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator

from vlmprep.jobs import process_pool, progress_bar
from vlmprep.types import UserError

_WORK: tuple[Callable[[Any, int], Any], Any] | None = None  # in a worker process: (fn, job), inherited at the fork


def _take(fn: Callable[[Any, int], Any], job: Any) -> None:
    global _WORK
    _WORK = fn, job


def _run(k: int) -> Any:
    fn, job = _WORK
    return fn(job, k)


def map_shards(
    fn: Callable[[Any, int], Any],
    job: Any,
    n: int,
    *,
    workers: int,
    command: str,
    on_shard: Callable[[int, int], None] | None = None,
) -> Iterator[Any]:
    """fn(job, k) for k in range(n) (shards in manifest order), in order. workers > 1: in that many processes forked
    from this one (vlmprep/jobs.py process_pool), which inherit fn and job (nothing crosses but k and the results; fn's
    result must pickle: plain lists, counters, dataclasses). on_shard(done, n) after each. A worker that dies is one
    line (a UserError)."""
    if workers <= 1 or n <= 1:
        for k in range(n):
            yield fn(job, k)
            if on_shard:
                on_shard(k + 1, n)
        return
    try:
        with process_pool(min(workers, n), mp.get_context("fork"), initializer=_take, initargs=(fn, job)) as pool:
            for k, result in enumerate(pool.map(_run, range(n))):
                yield result
                if on_shard:
                    on_shard(k + 1, n)
    except BrokenProcessPool:
        raise UserError(
            f"a {command} worker process stopped abruptly (killed, out of memory, or crashed): run it "
            f"again with --workers 1 to read the shards in this process"
        ) from None


@contextlib.contextmanager
def shard_progress(title: str, unit: str = "shards") -> Iterator[Callable[[int, int], None]]:
    """A progress bar over a dataset's shards (or other `unit`) on stderr when it is a terminal; yields
    show(done, total). Redrawn on each call, with no refresh thread: worker processes then fork from a process that
    has one thread."""
    from rich.console import Console

    bar = progress_bar(
        f"[bold]{title}", unit, disable=not sys.stderr.isatty(), console=Console(stderr=True), auto_refresh=False
    )
    with bar:
        task = bar.add_task(title, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total, refresh=True)
