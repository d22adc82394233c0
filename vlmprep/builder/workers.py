"""The worker pools of a build: a task's records -> (outcomes, turn accounting) in processes forked from the task's
process once its Renderer is loaded, results handed back in input order (so the output never depends on --workers);
and the tasks of a local plan in forkserver processes, each loading the dataset's saved processor.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator

from vlmprep.config import BuildConfig
from vlmprep.jobs import process_pool
from vlmprep.process import Renderer
from vlmprep.processors.load import load_saved_processor
from vlmprep.types import RawRecord, UserError


class BuildError(UserError):
    """A fatal, user-facing build fault (bad option, --strict reject): one clear line."""


_RENDERER: Renderer | None = None
_CACHED: tuple[tuple, Renderer] | None = None
# Most of a task process's start-up is importing these (torch + torchvision + transformers: ~7 s of CPU). Task
# processes fork from a forkserver that imported them once, instead of each spawned one importing them again.
_WORKER_PRELOAD = [
    "vlmprep.builder.workers",
    "vlmprep.pixels.images",
    "torch",
    "torchvision",
    "transformers.models.auto.processing_auto",
    "transformers.tokenization_mistral_common",
]


def worker_context():
    """The multiprocessing context for the build's pool: forkserver, the server preloading torch and transformers
    once so each worker starts in a fork, not a fresh import."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_WORKER_PRELOAD)  # no effect once the server runs: it already has them
    return ctx


def start_worker_server(workers: int) -> None:
    """With several task processes, start the forkserver's imports now, in the background, so they overlap the main
    process's own set-up (load + save the processor, scan the plan) instead of following it. Does not wait."""
    if workers > 1:
        from multiprocessing import forkserver

        worker_context()
        forkserver.ensure_running()


def renderer_from_saved(cfg: BuildConfig, processor_dir: str | Path) -> Renderer:
    """The one way a worker of any kind (pool, task, Ray) gets ready: the dataset's saved processor dir, which carries
    the chat template and pixel budget that rendered it, so the --chat-template file need not exist where it runs."""
    import torch

    torch.set_num_threads(1)  # one core per worker: N workers scale instead of oversubscribing
    return Renderer(cfg, load_saved_processor(processor_dir), saved=True)


def cached_renderer(cfg: BuildConfig, processor_dir: Path) -> Renderer:
    """renderer_from_saved, kept per process: a pool or Ray worker that runs several tasks of one plan loads the
    processor once."""
    global _CACHED
    key = (str(processor_dir), json.dumps(cfg.to_json(), sort_keys=True))
    if _CACHED is None or _CACHED[0] != key:
        _CACHED = key, renderer_from_saved(cfg, processor_dir)
    return _CACHED[1]


def _init_worker(renderer: Renderer) -> None:
    import torch

    global _RENDERER
    torch.set_num_threads(1)  # one core per worker: N workers scale instead of oversubscribing
    _RENDERER = renderer


def process_record(raw: RawRecord):
    """In a pool worker: one raw record -> its encoded samples or its rejects (the worker's Renderer)."""
    return _RENDERER.process(raw)


def process_records(raws: list[RawRecord]) -> list:
    """In a pool worker: a run of consecutive records -> their results, in order (one hand-off for several)."""
    return [_RENDERER.process(raw) for raw in raws]


@contextlib.contextmanager
def record_workers(cfg: BuildConfig, renderer: Renderer) -> Iterator[ProcessPoolExecutor | None]:
    """cfg.workers processes forked from this one, each with its own copy of `renderer` (None for one worker: records
    are then rendered in this process). Forked after the processor is loaded, a worker is ready at once: no imports,
    no processor load (those cost ~3 s and ~8 s of CPU per worker, while this process waited). Forking is safe here
    on the terms PyTorch's DataLoader workers rely on: a worker keeps one torch thread, and this process starts no
    thread of its own before the fork (the pool forks every worker at its first task, before its manager thread;
    callers open it before the progress bar). Tokenizers' thread pool cannot cross a fork, so it is turned off first
    (its single-text encode does not use it)."""
    if cfg.workers == 1:
        yield None
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with worker_pool(cfg.workers, fork=True, initializer=_init_worker, initargs=(renderer,)) as pool:
        pool.submit(int)  # forks every worker now
        yield pool


def worker_pool(workers: int, *, fork: bool = False, **kw):
    """`workers` processes, forked from this one or from the forkserver (vlmprep/jobs.py process_pool: a dead worker
    fails the pending work, leaving early stops the workers)."""
    return process_pool(workers, mp.get_context("fork") if fork else worker_context(), **kw)


def pool_failure(e: BrokenProcessPool, where: str) -> str:
    """One line for a broken worker pool: what broke, where in the input it was, what to do."""
    cause = [line.strip() for line in str(e.__cause__ or "").splitlines() if line.strip("'\" ")]  # a quoted traceback
    what = (
        f"a worker's result could not be read ({cause[-1]})"
        if cause
        else "a worker process stopped abruptly (killed, out of memory, or crashed)"
    )
    return (
        f"{what} while {where}; finished work is kept: run the same command again to resume, "
        "or with --workers 1 to see the record in this process"
    )


BATCH_RECORDS = 8  # records handed to a worker at once: a short record's own work is a few ms, as is a hand-off,
BATCH_BYTES = 256 << 10  # so short ones travel together; a record of more input bytes than this travels alone


def _batches(records) -> Iterator[list[RawRecord]]:
    batch, size = [], 0
    for raw in records:
        n = raw.size or len(raw.text or b"")
        if batch and (len(batch) >= BATCH_RECORDS or size + n > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(raw)
        size += n
    if batch:
        yield batch


def ordered_results(cfg: BuildConfig, records, renderer: Renderer, pool: ProcessPoolExecutor | None):
    """Yield (position, result) in input order with a bounded read-ahead window (constant memory); pool: the
    record_workers of cfg and renderer."""
    if pool is None:  # in-process, reusing the loaded processor: one copy of the tokenizer in memory
        for raw in records:
            yield raw.position, renderer.process(raw)
        return
    window: collections.deque = collections.deque()  # (positions, source, future) of each batch, oldest first
    try:
        for batch in _batches(records):
            window.append(([r.position for r in batch], batch[0].source, pool.submit(process_records, batch)))
            if len(window) >= cfg.workers * 4:
                yield from zip(window[0][0], window[0][2].result())
                window.popleft()
        while window:
            yield from zip(window[0][0], window[0][2].result())
            window.popleft()
    except BrokenProcessPool as e:
        src = window[0][1] if window else None
        where = f"rendering the records from {src.file}:{src.line} on" if src else "rendering records"
        raise BuildError(pool_failure(e, where)) from None
