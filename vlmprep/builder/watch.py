"""`vlmprep watch` (docs/datasets-that-grow.md, Watch): a long-running build service over an input location and an
--out dataset. Each cycle lists the location and builds the objects that are in no version yet with ONE build (an
append; the first, where --out holds no dataset, a whole build), so they are committed as one new version. The
version records' inputs are the source of truth: a kill at any point loses nothing and builds nothing twice (the next
start finds the objects still pending, or resumes the interrupted attempt with its own inputs), and a version is
visible whole or not at all (its record's exclusive creation is the commit).

    start: the options and the location checked, the watcher's lock (a lease in a bucket), the status file and port
    each cycle: list --watch_inputs.compare with the latest version--> pending, changed (reported)
                --due (--every elapsed, or --min-records waiting)--> build(append) --> one line, the status
    a transient fault (a listing that fails, a build or a commit beside it, an input replaced mid-build) is retried
    with backoff; any other ends it with exit 1 and one line; SIGTERM/SIGINT end it after the cycle in progress.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from vlmprep.builder.append import check_options
from vlmprep.builder.owner import BusyError
from vlmprep.builder.pipeline import build
from vlmprep.builder.plan import InputChanged
from vlmprep.builder.watch_config import WatchConfig
from vlmprep.builder.watch_inputs import (
    Changed,
    compare,
    count_records,
    forget_attempt,
    globbed,
    interrupted,
    latest_version,
    list_location,
    repair,
    stamp_text,
)
from vlmprep.builder.watch_lease import Lease, watching
from vlmprep.builder.watch_status import SHOWN, Status, check_status_file, serve
from vlmprep.ingest import InputError, LocationError, ReadLimits, is_url, url_fs
from vlmprep.process import Renderer
from vlmprep.processors.load import load_processor
from vlmprep.shards.summary import plural
from vlmprep.shards.versions import CommitConflict, manifest_number
from vlmprep.types import UserError
from vlmprep_schemas.boundary import UnsafeWrite

MAX_BACKOFF = 300.0  # seconds: a transient fault is retried at least this often
EX_TEMPFAIL = 75  # --once ended by a transient fault: run it again later (sysexits.h)
# Faults a later cycle may not meet: a listing or store that did not answer, a build or merge beside this one (the
# --out lock), a version another build committed first, an input replaced while it was built.
TRANSIENT = (LocationError, InputError, BusyError, CommitConflict, InputChanged, ConnectionError, TimeoutError)


def transient(e: BaseException) -> bool:
    """Whether a cycle's fault is retried: the TRANSIENT kinds, and an OSError that is not a refusal of unsafe state
    (a planted link) or a user error."""
    if isinstance(e, TRANSIENT):
        return True
    return isinstance(e, OSError) and not isinstance(e, (UnsafeWrite, UserError))


@dataclass
class Outcome:
    """What a cycle did: `line` (what it says), whether it committed a version, whether more is due at once (a
    resumed attempt built while other objects wait)."""

    line: str
    committed: bool = False
    more: bool = False


class Watcher:
    """One watcher's run: its config, status, lease, and what it reported already."""

    def __init__(self, cfg: WatchConfig, status: Status, lease: Lease | None, echo: Callable[[str], None]):
        self.cfg, self.status, self.lease, self.echo = cfg, status, lease, echo
        self.reported: set[tuple] = set()  # (path, stamp now) of changed objects said once
        self.counts: dict = {}  # records of each pending object, per stamp (--min-records)
        self.stop = threading.Event()
        self.repaired = False

    def say(self, line: str) -> None:
        """One line of the watcher's own (escaped by `echo`)."""
        self.echo(f"vlmprep watch: {line}")

    def report(self, changed: list[Changed]) -> None:
        """Each changed object said once per new stamp; --on-change stop ends the watcher naming the first."""
        for c in changed:
            key = (c.path, tuple(sorted(c.now.items())))
            if key in self.reported:
                continue
            self.reported.add(key)
            text = f"{c.path} changed after it was built ({stamp_text(c.was)} then; {stamp_text(c.now)} now)"
            if self.cfg.on_change == "stop":
                raise UserError(f"{text}; --on-change stop: a built object is never rebuilt in place")
            if self.cfg.on_change == "rebuild":
                self.say(f"{text}: rebuilt into the next version, which replaces its samples (--on-change rebuild)")
            else:
                self.say(f"{text}: its samples stay as built, not rebuilt (--on-change report)")

    def cycle(self, *, due: bool) -> Outcome:
        """List, compare with the latest version and, when due, build what waits as the next version."""
        b = self.cfg.build
        if self.lease is not None:
            self.lease.check()
        self.status.update(state="listing")
        if not self.repaired:  # a kill between a version's record and manifest.json: plain DIR names it again
            repair(b.out, self.say)
            self.repaired = True
        listed = list_location(b.inputs)
        parent = latest_version(b.out)
        if parent is not None:
            check_options(b, parent, b.out)
        pending, changed = compare(listed, parent)
        self.report(changed)
        resume = interrupted(b.out, parent, listed)
        records = None
        if self.cfg.min_records is not None:
            records = count_records(pending, limits=ReadLimits.of(b), cache=self.counts)
        self.status.update(
            latest_version=parent.number if parent else None,
            dataset={k: parent.manifest.totals.get(k, 0) for k in ("records", "samples", "tokens")} if parent else None,
            pending={"objects": len(pending), "records": records, "first": [p.path for p in pending[:SHOWN]]},
            changed={
                "objects": len(changed),
                "first": [{"path": c.path, "built": c.was, "now": c.now} for c in changed[:SHOWN]],
            },
        )
        where = f"latest v{parent.number}" if parent else "no dataset yet"
        rebuild = [c.path for c in changed] if self.cfg.on_change == "rebuild" else []
        if not pending and not rebuild:
            return Outcome(f"nothing new; {where}")
        wanted = self.cfg.min_records is not None and records is not None and records >= self.cfg.min_records
        if resume is None and not (due or wanted):
            shown = f" ({plural(records, 'record')})" if records is not None else ""
            return Outcome(f"{plural(len(pending), 'object')} waiting{shown}, not due yet; {where}")
        if resume is None and parent is None:
            forget_attempt(b.out)  # a first build whose inputs changed since: planned anew
        batch = resume or sorted([p.path for p in pending] + rebuild)
        return self._build(batch, parent is not None, len(pending) + len(rebuild), resume is not None)

    def _build(self, batch: list[str], append: bool, pending: int, resumed: bool) -> Outcome:
        """One build of `batch` into --out: its version committed whole, or nothing of it."""
        self.status.update(state="building")
        rebuild = self.cfg.on_change == "rebuild"
        result = build(dataclasses.replace(self.cfg.build, inputs=tuple(batch), append=append), replace=rebuild)
        added = result.added if append else result.manifest
        if added is None:  # every object of the batch was added by another build meanwhile
            return Outcome(
                f"nothing new (built meanwhile by another build); latest v{manifest_number(result.manifest)}"
            )
        version = manifest_number(result.manifest)
        self.status.count_version({"totals": added.totals, "rejects": added.rejects})
        left = max(pending - len(batch), 0)
        self.status.update(
            latest_version=version,
            dataset={k: result.manifest.totals.get(k, 0) for k in ("records", "samples", "tokens")},
            pending={**self.status.data["pending"], "objects": left, "records": None if left else 0},
        )
        t = added.totals
        gone = (result.manifest.version or {}).get("removed") if append else None
        replaced = (
            f" ({len(gone['inputs'])} rebuilt, {gone['totals'].get('samples', 0)} samples replaced)" if gone else ""
        )
        return Outcome(
            f"v{version} {'resumed and committed' if resumed else 'committed'}: {plural(len(batch), 'object')}"
            f"{replaced}, "
            f"{plural(t.get('records', 0), 'record')}, {plural(t.get('samples', 0), 'sample')}, "
            f"{t.get('rejected', 0)} rejected; {plural(left, 'object')} waiting",
            committed=True,
            more=resumed and left > 0,
        )


def _top(pattern: str) -> str:
    """The dir (or prefix) a pattern lists under: itself, or where its glob begins."""
    cut = min((pattern.find(ch) for ch in "*?[" if ch in pattern), default=len(pattern))
    head = pattern[:cut]
    return head if cut == len(pattern) else head.rsplit("/", 1)[0]


def check_location(patterns: tuple[str, ...], out: str) -> None:
    """At start: a local location must exist (a dir, a file or a glob's dir), a URL's store be reachable by its
    package with no credentials in it, and --out must not be inside what is watched (its rejects*.jsonl would be read
    as inputs) nor hold it: one line naming the fix otherwise."""
    dest = out if is_url(out) else os.path.abspath(out)
    for pat in patterns:
        if is_url(pat):
            url_fs(pat)  # LocationError: a missing package, credentials in the URL
        elif not (os.path.exists(pat) or globbed(pat) and os.path.isdir(_top(pat) or ".")):
            raise InputError(f"--in {pat}: no such file or directory; make the directory the traces land in first")
        top = _top(pat).rstrip("/")
        if any(a == b or a.startswith(b + "/") for a, b in ((dest.rstrip("/"), top), (top, dest.rstrip("/")))):
            raise InputError(
                f"--out {out} and --in {pat} overlap: the dataset's own files (rejects.jsonl ...) would be read as new "
                "inputs, or the inputs written over; watch a location outside the dataset"
            )


def run_watch(cfg: WatchConfig, echo: Callable[[str], None]) -> int:
    """`vlmprep watch`: run cycles until --once's one is done or SIGTERM/SIGINT, under the watcher's lock (a lease in
    a bucket), with the status file and server. Returns the exit code: 0 (done, or stopped by a signal), 75 (--once
    ended by a transient fault); a fault it cannot retry is raised (one line, exit 1), the status saying it too."""
    check_location(cfg.build.inputs, cfg.build.out)
    check_status_file(cfg.status_file)
    status = Status(location=list(cfg.build.inputs), out=cfg.build.out, status_file=cfg.status_file)
    with watching(cfg.build.out, ttl=cfg.lease_seconds, say=lambda line: echo(f"vlmprep watch: {line}")) as lease:
        watcher = Watcher(cfg, status, lease, echo)
        server = serve(status, cfg.status_host, cfg.status_port) if cfg.status_port is not None else None
        if server is not None:
            host, port = server.server_address[:2]
            status.update(status_url=f"http://{host}:{port}")
        # The handler only starts a thread that sets the event: set() takes a lock the interrupted code may hold.
        stopping = lambda *_: threading.Thread(target=watcher.stop.set, daemon=True).start()  # noqa: E731
        old = {s: signal.signal(s, stopping) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            status.update(state="starting")
            watcher.say(
                f"watching {', '.join(cfg.build.inputs)} into {cfg.build.out}"
                + (f"; status on {status.data['status_url']}" if server is not None else "")
            )
            # The processor once now: a bad one ends the watcher at start, and the first cycle builds at once.
            Renderer(cfg.build, load_processor(cfg.build.processor))
            return _loop(watcher)
        except BaseException as e:
            status.update(state="failed", last_error=str(e) or type(e).__name__)
            raise
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            if server is not None:
                server.shutdown()
                server.server_close()


def _loop(w: Watcher) -> int:
    """The cycles: each listing builds what is due; a transient fault waits a backoff (poll x 2^k, at most
    MAX_BACKOFF) and tries again."""
    cfg, status = w.cfg, w.status
    due_at = time.monotonic()  # the first listing builds what waits
    failures, said = 0, None
    while True:
        t0 = time.monotonic()
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            outcome = w.cycle(due=cfg.period is not None and (cfg.once or t0 >= due_at))
        except Exception as e:
            if not transient(e):
                raise
            failures += 1
            wait = min(cfg.tick * 2 ** (failures - 1), MAX_BACKOFF)
            error = str(e) or type(e).__name__
            last = {"started": started, "seconds": time.monotonic() - t0, "committed": False, "error": error}
            status.update(
                state="waiting",
                cycles=status.data["cycles"] + 1,
                failures=status.data["failures"] + 1,
                consecutive_failures=failures,
                retry_in=None if cfg.once else wait,
                last_cycle=last,
                last_error=error,
            )
            if cfg.once:
                w.say(f"fault: {error} (--once: run again later)")
                return EX_TEMPFAIL
            w.say(f"fault: {error}; retrying in {wait:g} s")
            if w.stop.wait(wait):
                break
            continue
        failures = 0
        seconds = time.monotonic() - t0
        if outcome.committed and cfg.period is not None:
            due_at = t0 + cfg.period
        last = {"started": started, "seconds": seconds, "committed": outcome.committed, "error": None}
        status.update(
            state="waiting", cycles=status.data["cycles"] + 1, consecutive_failures=0, retry_in=None, last_cycle=last
        )
        if outcome.committed or outcome.line != said:  # an idle listing says nothing new: one line per change
            w.say(f"{outcome.line} ({seconds:.1f} s)")
            said = outcome.line
        if cfg.once or w.stop.is_set():
            break
        if not outcome.more and w.stop.wait(cfg.tick):
            break
    if w.stop.is_set():
        w.say("stopped by a signal after the cycle in progress; nothing half-built is visible")
    status.update(state="stopped")
    return 0
