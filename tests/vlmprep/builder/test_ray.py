"""--executor ray on one local cluster per module (ray.init(num_cpus=2)): the same bytes as the local pool for the same
plan, also when a Ray worker is killed mid-task (retried; the task resumes from its journal); ray is never imported
by a local build. The 2-node cluster (`ray start --head` + `ray start --address`) is in test_ray_cluster.py. All but
the import check are `slow` (make-test budget: the cluster's start alone is ~12 s on 2 cores)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.vlmprep.conftest import planned_cfg, tree_hashes
from vlmprep.builder.pipeline import build

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # address="local": a cluster of its own, even where `ray start` runs one on this machine (another test, a user)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # make-test budget: the cluster's start and a 3-task build (~45 s on 2 cores)
@pytest.mark.usefixtures("cluster")
def test_ray_on_a_local_cluster_writes_the_local_pool_bytes(task_traces, local3, tmp_path):
    ref, ref_res = local3
    res = build(planned_cfg(task_traces, tmp_path / "ds", tasks=3, executor="ray"))
    assert tree_hashes(tmp_path / "ds") == tree_hashes(ref)
    assert res.manifest == ref_res.manifest and sorted(res.task_seconds) == [0, 1, 2]


def _busy_ray_workers() -> list:
    import psutil

    # A Ray worker names its process after the function it is running.
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if any("ray::_run_task_on_worker" in c for c in (p.info["cmdline"] or []))
    ]


@pytest.mark.slow  # ~20 s
@pytest.mark.usefixtures("cluster")
def test_a_ray_worker_killed_mid_task_is_retried_and_the_dataset_is_identical(task_traces, local3, tmp_path):
    ref, _ = local3
    out = tmp_path / "ds"
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(res=build(planned_cfg(task_traces, out, tasks=3, executor="ray")))
    )
    t.start()
    killed = None
    deadline = time.monotonic() + 180
    while killed is None and time.monotonic() < deadline and t.is_alive():
        # mid-task: a task has a journal or a shard being written but no task manifest yet
        started = [p for p in (out / "tasks").glob("task-*.journal.json")] if (out / "tasks").exists() else []
        if started or list(out.glob("*.tar.tmp")):
            busy = _busy_ray_workers()
            if busy:
                killed = busy[0].pid
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    t.join(300)
    assert killed is not None, "no Ray worker was caught mid-task"
    assert "res" in result, "the build did not finish after the worker was killed"
    assert tree_hashes(out) == tree_hashes(ref)


def test_a_local_build_never_imports_ray():
    code = (
        "import sys, vlmprep.cli, vlmprep.builder.pipeline, vlmprep.builder.task, vlmprep.builder.workers, "
        "vlmprep.builder.merge, vlmprep.builder.plan; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    code = "import sys, vlmprep.builder.ray_executor; assert 'ray' not in sys.modules"  # imported only when the executor runs
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.slow  # make-test budget: needs the cluster (~20 s with its start)
@pytest.mark.usefixtures("cluster")
def test_a_fault_inside_a_ray_task_comes_back_as_one_line(task_traces, local3, tmp_path):
    import json

    from vlmprep.builder.pipeline import BuildError

    # --strict makes a task's first reject (the broken line traces.jsonl:6, an overlong turn, ...) fatal inside
    # whichever Ray task reads it first: the line is one of the non-strict build's rejects, with its reason.
    with pytest.raises(BuildError) as e:
        build(planned_cfg(task_traces, tmp_path / "ds", tasks=3, executor="ray", strict=True))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Ray task "), msg
    rejects = [json.loads(line) for line in (local3[0] / "rejects.jsonl").read_text().splitlines()]
    said = [
        f"failed: --strict: {r['source']['file']}:{r['source']['line']}: {r['reason']}: "
        for r in rejects
        if r["reason"] != "duplicate_id"
    ]  # found by the merge, never inside a task
    assert any(s in msg for s in said), (msg, said)
