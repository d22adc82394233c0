"""What the hostile tests of state and caches plant (docs/untrusted-datasets.md, "Where vlmprep writes"): a link or a
FIFO at a name vlmprep or the trainer writes or reads back, a victim file or dir the link points at, and a way to run
a command so that a FIFO it would wait on fails the test instead of hanging it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

VICTIM_TEXT = "the user's own file\n"


def victim_dir(parent: Path) -> Path:
    """A dir of the user's with one file in it, which a link planted in a cache points at: it must stay as it is."""
    d = parent / "victim"
    d.mkdir()
    (d / "keep.txt").write_text(VICTIM_TEXT)
    return d


def untouched(d: Path) -> bool:
    """Whether victim_dir `d` still holds exactly its one file with its bytes."""
    return sorted(p.name for p in d.iterdir()) == ["keep.txt"] and (d / "keep.txt").read_text() == VICTIM_TEXT


def plant(path: Path, kind: str, target: Path | None = None) -> None:
    """A `kind` ("symlink" to `target`, or "FIFO") at `path`, replacing what is there."""
    if os.path.lexists(path):
        os.unlink(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to(target)


def finishes(work: Callable[[], object], timeout_s: float = 60.0):
    """work()'s value (or its exception, raised here), run on a daemon thread: a regression that opens a FIFO and
    waits on it fails the test after `timeout_s` instead of hanging the suite (the thread is left blocked)."""
    box: dict = {}

    def run():
        try:
            box["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still waiting after {timeout_s} s (on a FIFO?)"
    if "error" in box:
        raise box["error"]
    return box["value"]
