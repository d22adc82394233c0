"""What the long commands share (the build, and verify / stats): a process pool that stops its workers when left
early, and the progress bar's look.
"""

from __future__ import annotations

import contextlib
import multiprocessing.context
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator


@contextlib.contextmanager
def process_pool(workers: int, context: multiprocessing.context.BaseContext, **kw) -> Iterator[ProcessPoolExecutor]:
    """`workers` processes of `context`. Unlike multiprocessing.Pool (which silently replaces a dead worker and waits
    forever for its task), the executor fails every pending future with BrokenProcessPool when a worker dies (killed,
    out of memory, crashed) or a result cannot be read. Leaving early (an error, --strict, Ctrl-C) stops the workers
    instead of waiting for their work."""
    pool = ProcessPoolExecutor(workers, mp_context=context, **kw)
    try:
        yield pool
    except BaseException:
        for p in list((getattr(pool, "_processes", None) or {}).values()):  # public terminate_workers: Python 3.14
            p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def progress_bar(title: str, *counts: str, disable: bool, **kw):
    """A rich progress bar: title, bar, done of total, the counts, time elapsed and left (`kw`: rich Progress's
    own, e.g. console, auto_refresh)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(title),
        BarColumn(),
        MofNCompleteColumn(),
        *map(TextColumn, counts),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        disable=disable,
        **kw,
    )
