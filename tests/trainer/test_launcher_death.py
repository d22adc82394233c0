"""Ranks end when torchrun does (issue 44): a `kill -9` of the launcher alone (as an OOM killer does) used to leave
both ranks training to the end and writing checkpoints into a run dir a restart is then refused."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import ROOT, read_metrics, trainer_cmd, trainer_env


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_ranks_exit_when_torchrun_is_killed(dataset, tmp_path):
    out = tmp_path / "run"
    args = ["--data", dataset, "--out", out, "--micro-batch-size", 1, "--epochs", 20, "--save-every", 1]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(
            trainer_cmd(args, 2), cwd=ROOT, env=trainer_env(), stdout=log, stderr=log, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not read_metrics(out):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.1)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only
        proc.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "the ranks trained on without their launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
