"""What the `vlmprep watch` tests share: the build options they watch with, objects that land in a location (a local
dir or a bucket prefix), a watcher run as its own process, its status file read back, and the exactly-once check: each
object in exactly one version, every version verifying, the versions' added totals summing to the latest's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from typer.testing import CliRunner

from vlmprep.cli import app
from vlmprep_schemas.versions import version_name

FLAGS = ["--processor", "tiny:qwen2-vl", "--seq-len", "2048", "--samples-per-shard", "2"]
FLAGS += ["--chat-template", "qwen2_vl_tools", "--max-reject-fraction", "1", "--min-turn-coverage", "0"]


def traces(k: int, *, n: int = 3, seed: int | None = None) -> bytes:
    """Object k's bytes: n small demo traces (ids o{k}-...) as .jsonl.zst."""
    import tempfile

    from scripts.demo_traces import write_traces

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl.zst"
        write_traces(
            p,
            id_prefix=f"o{k}-",
            n=n,
            seed=k if seed is None else seed,
            width=160,
            height=64,
            min_images=1,
            max_images=2,
        )
        return p.read_bytes()


def land(inbox: Path, k: int, name: str | None = None, **kw) -> Path:
    """Object k lands in a local dir as a file does: written under another name, then renamed into place."""
    path = inbox / (name or f"obj-{k:03d}.jsonl.zst")
    inbox.mkdir(parents=True, exist_ok=True)
    tmp = inbox / f".{path.name}.part"
    tmp.write_bytes(traces(k, **kw))
    os.replace(tmp, path)
    return path


def invoke(*args):
    """The CLI in this process (its output and exit code)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def watch_args(location, out, *more) -> list[str]:
    return ["watch", "--in", str(location), "--out", str(out), *FLAGS, *map(str, more)]


def start(location, out, *more, log: Path, env: dict | None = None) -> subprocess.Popen:
    """`vlmprep watch` as its own long-running process (stdout and stderr to `log`)."""
    with open(log, "ab") as f:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "vlmprep", *watch_args(location, out, *more)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        )


def status(path: Path) -> dict | None:
    """The watcher's status file (None before its first write)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def wait_for(what: Callable[[], object], timeout: float = 120.0, proc: subprocess.Popen | None = None, log=None):
    """what()'s first true value, asked every 20 ms; fails after `timeout` s (or when `proc` ended meanwhile)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the watcher exited ({proc.returncode}): {Path(log).read_text() if log else ''}")
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s" + (f": {Path(log).read_text()}" if log else ""))


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 120.0) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout)


def records(read: Callable[[str], bytes | None]) -> list[dict]:
    """Every committed version's record, in order (a dataset of one version without versions/: its manifest.json)."""
    out, n = [], 1
    while (data := read(version_name(n))) is not None:
        out.append(json.loads(data))
        n += 1
    if not out and (data := read("manifest.json")) is not None:
        out.append(json.loads(data))
    return out


def local_reader(d: Path) -> Callable[[str], bytes | None]:
    return lambda name: (d / name).read_bytes() if (d / name).is_file() else None


def added_inputs(rec: dict) -> list[str]:
    """The input paths a version added (version 1: all of its inputs)."""
    return [i["path"] for i in (rec["version"]["added"]["inputs"] if rec.get("version") else rec["inputs"])]


def removed_of(rec: dict) -> dict:
    """What a version removed (--on-change rebuild): its inputs (old stamps), shards and totals; {} where nothing."""
    return (rec.get("version") or {}).get("removed") or {}


def check_exactly_once(read, objects: list[str], verify: Callable[[int], list]) -> list[dict]:
    """Every object in exactly one version (a rebuilt one: in the version that last built it, which removed it from
    the version before); every version verifies (`verify(n)`: its violations); the versions' added totals less
    their removed totals sum to the latest totals; manifest.json is the latest record. Returns the records."""
    recs = records(read)
    assert recs, "no version committed"
    live: dict[str, int] = {}
    for n, rec in enumerate(recs, 1):
        for p in [i["path"] for i in removed_of(rec).get("inputs", ())]:
            assert live.pop(p, None) is not None, f"version {n} removed {p}, which no version before it holds"
        for p in added_inputs(rec):
            assert p not in live, f"{p} is in versions {live[p]} and {n}"
            live[p] = n
    assert sorted(live) == sorted(objects), f"versions hold {sorted(live)}, landed {sorted(objects)}"
    assert sorted(i["path"] for i in recs[-1]["inputs"]) == sorted(objects)
    for n in range(1, len(recs) + 1):
        assert verify(n) == [], f"version {n} does not verify"
    latest = recs[-1]["totals"]
    added = [rec["version"]["added"]["totals"] if rec.get("version") else rec["totals"] for rec in recs]
    removed = [removed_of(rec).get("totals", {}) for rec in recs]
    for key, value in latest.items():
        total = sum(a.get(key, 0) for a in added) - sum(r.get(key, 0) for r in removed)
        assert total == value, f"totals.{key} does not add up across versions"
    assert json.loads(read("manifest.json")) == recs[-1]
    return recs


def two_watchers(location, out, drop: Callable[[int], str], read, verify, tmp_path: Path) -> None:
    """Two watchers started at once on one dataset: exactly one runs (the other exits 1 in one line naming --out and
    never writes a status), a third is refused while it runs, the one commits each version, SIGTERM ends it with 0,
    and every object is in exactly one version."""
    landed = [drop(0)]
    logs, sts = [tmp_path / f"w{i}.log" for i in (0, 1)], [tmp_path / f"w{i}.json" for i in (0, 1)]
    procs = [
        start(location, out, "--every", "0.2", "--poll", "0.2", "--status-file", sts[i], log=logs[i]) for i in (0, 1)
    ]
    try:
        wait_for(lambda: any(p.poll() is not None for p in procs))
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner = 1 - loser
        assert procs[loser].returncode == 1
        lines = logs[loser].read_text().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}"), lines
        assert "is watched already by" in lines[0] or "another watcher took its lease" in lines[0]
        wait_for(lambda: (status(sts[winner]) or {}).get("latest_version") == 1, proc=procs[winner], log=logs[winner])
        res = invoke(*watch_args(location, out, "--once"))  # a bucket's lease outlived the first (whole) build
        assert res.exit_code == 1 and "is watched already by" in res.output, res.output
        landed.append(drop(1))
        wait_for(lambda: status(sts[winner])["latest_version"] == 2, proc=procs[winner], log=logs[winner])
        assert stop(procs[winner], timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = logs[winner].read_text()
    assert "v1 committed" in text and "v2 committed" in text, text
    assert status(sts[loser]) is None  # the loser never ran a cycle
    check_exactly_once(read, landed, verify)
