"""`vlmprep watch` killed with SIGKILL at random points (issue 55.4's acceptance), its own process each time, new
objects landing between the kills, then restarted: every object lands in exactly one version, no version is ever
half-visible (after each kill, the latest record's shards are all there with their sha256s), every version verifies
and the versions' added totals sum to the latest's. A local dir into a local --out (3 kills, and 20) and moto's
S3 server for both the location and --out (20 kills); killed during --on-change rebuild cycles (2 kills, and 10):
exactly one of the parent or the whole rebuild visible, each object's current content once in the latest; all in
`make test-all`, the default suite keeps the watcher's
other process tests (test_watch_service.py, test_watch_store.py)."""

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.support.watching import (
    check_exactly_once,
    invoke,
    land,
    local_reader,
    records,
    start,
    status,
    traces,
    watch_args,
)
from tests.trainer import test_remote
from tests.vlmprep.builder.test_watch import verifier

s3_server = test_remote.s3_server  # moto's S3 server on loopback, module-scoped


def _cycling(st: dict | None, proc) -> bool:
    """Whether the status file is this process's, past its start-up (the processor loaded, cycles running)."""
    return st is not None and st["pid"] == proc.pid and st["state"] != "starting"


@dataclass
class Case:
    """A watched location and dataset: `drop(k)` lands object k (its path back), `whole()` checks the latest committed
    version is whole, `window` s after a watcher's loop began its cycle lists, builds and commits."""

    location: str
    out: str
    drop: Callable[[int], str]
    whole: Callable[[], None]
    window: float
    env: dict | None = None


def kill_at_random_points(case: Case, n_kills: int, seed: int, tmp_path: Path) -> list[str]:
    """Start the watcher, SIGKILL it at a random point (most within its window after its loop began; some during its
    start-up), land 0-2 new objects, again, `n_kills` times; after each kill the latest version must be whole.
    Returns the objects landed."""
    rng = random.Random(seed)
    st, log = tmp_path / "status.json", tmp_path / "watch.log"
    landed = [case.drop(0)]
    for i in range(n_kills):
        for _ in range(rng.choice((0, 1, 1, 2))):
            landed.append(case.drop(len(landed)))
        proc = start(
            case.location, case.out, "--every", "0.1", "--poll", "0.1", "--status-file", st, log=log, env=case.env
        )
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.5, 4.0))  # during the start-up: imports, the lock or lease
        else:
            end = time.monotonic() + 120
            while time.monotonic() < end and proc.poll() is None and not _cycling(status(st), proc):
                time.sleep(0.01)
            time.sleep(rng.uniform(0, case.window))
        assert proc.poll() is None, f"kill {i}: the watcher ended by itself: {log.read_text()[-3000:]}"
        proc.kill()
        proc.wait()
        case.whole()
    return landed


def finish(location, out) -> str:
    """Run `--once` until it finds nothing new (the restart after the last kill)."""
    for _ in range(4):
        res = invoke(*watch_args(location, out, "--once"))
        assert res.exit_code == 0, res.output
        if "nothing new" in res.output:
            return res.output
    raise AssertionError(res.output)


def local_case(n_kills: int, seed: int, tmp_path: Path) -> None:
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()

    def drop(k):
        return str(land(inbox, k, n=4))

    def whole():
        n = len(records(local_reader(out)))
        assert n == 0 or verifier(out, quick=True)(n) == [], f"version {n} is not whole after a kill"

    landed = kill_at_random_points(Case(str(inbox), str(out), drop, whole, 1.0), n_kills, seed, tmp_path)
    finish(inbox, out)
    check_exactly_once(local_reader(out), landed, verifier(out))


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_sigkill_at_random_points_then_restart_builds_every_object_exactly_once(tmp_path):
    local_case(3, 55, tmp_path)


@pytest.mark.slow  # 20 watcher processes, each started, cycling and killed (~4 min on 2 cores)
def test_sigkill_at_20_random_points_local(tmp_path):
    local_case(20, 2055, tmp_path)


@pytest.mark.slow  # 20 watcher processes against moto's S3 server (~6 min on 2 cores)
def test_sigkill_at_20_random_points_in_a_bucket(s3_server, tmp_path, monkeypatch):
    import s3fs

    from vlmprep.shards.remote import fetch_dataset
    from vlmprep.tools.verify import verify_dataset

    monkeypatch.setenv("VLMPREP_STAGE", str(tmp_path / "stage"))
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))
    fs = s3fs.S3FileSystem()
    fs.mkdir("watched")
    location, url = "s3://watched/in/", "s3://watched/ds"

    def drop(k):
        fs.pipe(f"watched/in/obj-{k:03d}.jsonl.zst", traces(k, n=4))
        return f"s3://watched/in/obj-{k:03d}.jsonl.zst"

    def read(name):
        fs.invalidate_cache()
        return fs.cat_file(f"watched/ds/{name}") if fs.exists(f"watched/ds/{name}") else None

    def whole():
        n = len(records(read))
        assert n == 0 or verify_dataset(fetch_dataset(f"{url}@v{n}"), deep=False) == [], f"version {n} is not whole"

    env = {k: os.environ[k] for k in ("VLMPREP_STAGE", "VLMPREP_CACHE")}
    landed = kill_at_random_points(Case(location, url, drop, whole, 3.0, env), 20, 4055, tmp_path)
    finish(location, url)
    check_exactly_once(read, landed, lambda n: verify_dataset(fetch_dataset(f"{url}@v{n}")))


def rebuild_case(n_kills: int, seed: int, tmp_path: Path) -> None:
    """v1 from objects 0 and 1; then, n_kills times, object 0's content changes (and 0-1 objects land), a watcher with
    --on-change rebuild starts and is SIGKILLed at a random point: after each kill the latest version is whole (v1,
    or a whole rebuild); restarted, every object's current content is in exactly one place of the latest version."""
    from tests.vlmprep.builder.test_rebuild import samples

    rng = random.Random(seed)
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    st, log = tmp_path / "status.json", tmp_path / "watch.log"
    landed = [str(land(inbox, 0, n=4)), str(land(inbox, 1, n=4))]
    assert "v1 committed" in invoke(*watch_args(inbox, out, "--once")).output
    v1 = {p.name: p.read_bytes() for p in out.glob("shard-0*")}

    def whole():
        n = len(records(local_reader(out)))
        assert verifier(out, quick=True)(n) == [], f"version {n} is not whole after a kill"

    for i in range(n_kills):
        land(inbox, 0, n=3 + i % 2, seed=100 + i)  # object 0 changes again
        if rng.random() < 0.5:
            landed.append(str(land(inbox, len(landed), n=2)))
        proc = start(
            inbox, out, "--on-change", "rebuild", "--every", "0.1", "--poll", "0.1", "--status-file", st, log=log
        )
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None and not _cycling(status(st), proc):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.4))  # a rebuild cycle of these objects takes ~0.3 s here
        assert proc.poll() is None, f"kill {i}: the watcher ended by itself: {log.read_text()[-3000:]}"
        proc.kill()
        proc.wait()
        whole()
    for _ in range(4):  # restarted: it finishes what is left
        res = invoke(*watch_args(inbox, out, "--once", "--on-change", "rebuild"))
        assert res.exit_code == 0, res.output
        if "nothing new" in res.output:
            break
    assert "nothing new" in res.output, res.output
    recs = check_exactly_once(local_reader(out), landed, verifier(out))
    latest = {i["path"]: i for i in recs[-1]["inputs"]}
    got = samples(out)
    for p in landed:  # each object's current content, once: its entry's stamp and samples are the file's now
        assert latest[p]["bytes"] == Path(p).stat().st_size
        assert sum(1 for m, *_ in got.values() if m["source"]["file"] == p) == latest[p]["totals"]["samples"]
    assert {p.name: p.read_bytes() for p in out.glob("shard-0*")} == v1  # version 1's shards as they were


@pytest.mark.slow  # ~20 s on 2 cores (a build, two watcher processes, the restart): make test-all runs it
def test_sigkill_during_a_rebuild_then_restart_replaces_once(tmp_path):
    rebuild_case(2, 5555, tmp_path)


@pytest.mark.slow  # 10 watcher processes, each killed during a rebuild (~2 min on 2 cores)
def test_sigkill_at_10_random_points_of_rebuilds(tmp_path):
    rebuild_case(10, 2056, tmp_path)
