"""`vlmprep watch` as the long-running process it is (issue 55.4), on a local --out: it serves /healthz and /metrics,
a second watcher is refused in one line naming it, a `build --append` between its cycles commits its own version and
the watcher goes on from it, a location that cannot be listed is a transient fault (retried with backoff, /healthz 503
meanwhile, 200 once it lists again), and SIGTERM mid-cycle ends it with exit 0 after that version committed: nothing
half-visible, every object in exactly one version."""

import shutil
import urllib.error
import urllib.request

from tests.support.watching import (
    FLAGS,
    check_exactly_once,
    invoke,
    land,
    local_reader,
    start,
    status,
    stop,
    two_watchers,
    wait_for,
    watch_args,
)
from tests.vlmprep.builder.test_watch import verifier


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_running_watcher_serves_status_refuses_a_second_and_stops_after_its_cycle(tmp_path):
    inbox, out, st, log = tmp_path / "inbox", tmp_path / "ds", tmp_path / "status.json", tmp_path / "watch.log"
    inbox.mkdir()
    landed = [land(inbox, 0)]
    proc = start(inbox, out, "--every", "0.2", "--poll", "0.2", "--status-port", "0", "--status-file", st, log=log)
    try:
        s = wait_for(
            lambda: (x := status(st)) and x["latest_version"] == 1 and x["state"] == "waiting" and x, proc=proc
        )
        url = s["status_url"]
        assert url.startswith("http://127.0.0.1:") and s["pid"] == proc.pid
        assert _get(f"{url}/healthz") == (200, "ok\n")
        code, metrics = _get(f"{url}/metrics")
        assert code == 200
        for line in (
            "vlmprep_watch_up 1",
            "vlmprep_watch_latest_version 1",
            "vlmprep_watch_versions_committed_total 1",
            "vlmprep_watch_records_built_total 3",
            "vlmprep_watch_samples_built_total 3",
            "vlmprep_watch_pending_objects 0",
            "vlmprep_watch_last_cycle_failed 0",
            "# TYPE vlmprep_watch_rejects_total counter",
        ):
            assert line in metrics.splitlines(), line
        # a second watcher on the dataset: refused in one line naming the first
        res = invoke(*watch_args(inbox, out, "--once"))
        assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
        assert f"--out {out} is watched already by `" in res.output and f"(pid {proc.pid} on " in res.output
        # a build --append between the watcher's cycles commits its own version; the watcher goes on from it
        other = land(tmp_path / "elsewhere", 7)
        res = invoke("build", "--append", "--in", other, "--out", out, *FLAGS, "--no-progress")
        assert res.exit_code == 0 and "appended version v2" in res.output, res.output
        wait_for(lambda: status(st)["latest_version"] == 2, proc=proc)
        # the location gone: a transient fault, retried; /healthz says so, and recovers
        shutil.move(inbox, tmp_path / "away")
        wait_for(lambda: status(st)["consecutive_failures"] >= 1, proc=proc)
        code, why = _get(f"{url}/healthz")
        assert code == 503 and why.startswith(f"input not found: {inbox}"), why
        metrics = _get(f"{url}/metrics")[1]
        assert "vlmprep_watch_up 0" in metrics and "vlmprep_watch_last_cycle_failed 1" in metrics
        assert f'vlmprep_watch_last_error_info{{error="input not found: {inbox}"}} 1' in metrics
        shutil.move(tmp_path / "away", inbox)
        wait_for(lambda: status(st)["consecutive_failures"] == 0, proc=proc)
        assert _get(f"{url}/healthz") == (200, "ok\n")
        # SIGTERM while a cycle builds: that version commits, then exit 0
        landed.append(land(inbox, 1, n=24))
        wait_for(lambda: status(st)["state"] == "building", proc=proc)
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "v3 committed: 1 object, 24 records" in text, text
    assert text.rstrip().endswith("stopped by a signal after the cycle in progress; nothing half-built is visible")
    assert "fault: input not found" in text and "retrying in" in text
    assert status(st)["state"] == "stopped"
    check_exactly_once(local_reader(out), [str(p) for p in landed] + [str(other)], verifier(out))
    assert "nothing new; latest v3" in invoke(*watch_args(inbox, out, "--once")).output


def test_of_two_local_watchers_started_at_once_exactly_one_runs_and_commits(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    two_watchers(inbox, out, lambda k: str(land(inbox, k)), local_reader(out), verifier(out), tmp_path)


def test_a_location_in_a_store_whose_package_is_missing_is_refused_in_one_line(tmp_path):
    res = invoke(*watch_args("gs://bucket/incoming/", tmp_path / "ds", "--once"))
    assert res.exit_code == 1 and res.output.strip() == (
        "error: gs://bucket/incoming/: gs:// for --in needs gcsfs: pip install gcsfs"
    ), res.output
    assert not (tmp_path / "ds").exists()
