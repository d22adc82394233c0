"""`vlmprep watch` (issue 55.4, docs/datasets-that-grow.md "Watch") in this process, one `--once` cycle at a time: the
first cycle builds the dataset, each later one commits what landed as ONE version, exactly once; a dataset of other
options is refused in one line; a built object that changed is reported with both stamps and never rebuilt (stop:
exit 1; rebuild: test_rebuild.py); an object replaced while its cycle built it is named, its attempt abandoned whole and its
new content built next cycle; --min-records and --every decide when a cycle builds; hostile: a status file that is
a planted link or FIFO, object names with control characters."""

import os

import pytest

from tests.support.planted import finishes, plant
from tests.support.watching import FLAGS, check_exactly_once, invoke, land, local_reader, status, watch_args


def verifier(out, *, quick: bool = False):
    """`vlmprep verify DIR@vN` of a local dataset, as check_exactly_once takes it ([]: it passed)."""

    def verify(n):
        res = invoke("verify", f"{out}@v{n}", *(["--quick"] if quick else []))
        return [] if res.exit_code == 0 else [res.output]

    return verify


def once(inbox, out, *more):
    res = invoke(*watch_args(inbox, out, "--once", *more))
    return res


def test_each_cycle_commits_what_landed_as_one_version_exactly_once(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    res = once(inbox, out)  # an empty location: nothing to build, no dataset made
    assert res.exit_code == 0, res.output
    assert "nothing new; no dataset yet" in res.output and not (out / "manifest.json").exists()
    landed = [land(inbox, 0)]
    res = once(inbox, out, "--status-file", tmp_path / "status.json")
    assert res.exit_code == 0 and "v1 committed: 1 object, 3 records, 3 samples" in res.output, res.output
    st = status(tmp_path / "status.json")
    assert st["state"] == "stopped" and st["latest_version"] == 1 and st["built"]["versions"] == 1
    assert st["pending"]["objects"] == 0 and st["last_cycle"]["committed"] and st["last_cycle"]["error"] is None
    landed += [land(inbox, 1), land(inbox, 2)]
    res = once(inbox, out)
    assert "v2 committed: 2 objects, 6 records, 6 samples, 0 rejected; 0 objects waiting" in res.output, res.output
    res = once(inbox, out)
    assert res.exit_code == 0 and "nothing new; latest v2" in res.output
    recs = check_exactly_once(local_reader(out), [str(p) for p in landed], verifier(out))
    assert len(recs) == 2 and recs[1]["version"]["number"] == 2


def test_a_dataset_of_other_options_is_refused_in_one_line(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    assert once(inbox, out).exit_code == 0
    land(inbox, 1)
    before = (out / "manifest.json").read_bytes()
    res = once(inbox, out, "--seq-len", "1024")
    assert res.exit_code == 1
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error: --append: --seq-len 1024 asked, but") and "--seq-len 2048" in line, res.output
    assert (out / "manifest.json").read_bytes() == before and not (out / "versions" / "v000002.json").exists()


def test_a_changed_object_is_reported_with_both_stamps_and_never_rebuilt(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    a = land(inbox, 0)
    assert once(inbox, out).exit_code == 0
    b = land(inbox, 1)
    assert "v2 committed" in once(inbox, out).output
    was_a, was_b = a.stat(), b.stat()
    a.write_bytes(a.read_bytes() + b"\n")  # version 1 records sizes alone: a new size is seen
    os.utime(b, ns=(was_b.st_atime_ns, was_b.st_mtime_ns + 10**9))  # version 2 records mtimes: the same size is too
    now_a, now_b = a.stat(), b.stat()
    res = once(inbox, out, "--status-file", tmp_path / "st.json")
    assert res.exit_code == 0, res.output
    assert (
        f"{a} changed after it was built (bytes {was_a.st_size} then; bytes {now_a.st_size} now): its samples stay as "
        "built, not rebuilt (--on-change report)"
    ) in res.output
    assert (
        f"{b} changed after it was built (bytes {was_b.st_size}, mtime_ns {was_b.st_mtime_ns} then; "
        f"bytes {now_b.st_size}, mtime_ns {now_b.st_mtime_ns} now)"
    ) in res.output
    assert "nothing new; latest v2" in res.output  # neither rebuilt
    changed = status(tmp_path / "st.json")["changed"]
    assert changed["objects"] == 2
    assert changed["first"][1] == {
        "path": str(b),
        "built": {"bytes": was_b.st_size, "mtime_ns": was_b.st_mtime_ns},
        "now": {"bytes": now_b.st_size, "mtime_ns": now_b.st_mtime_ns},
    }
    res = once(inbox, out, "--on-change", "stop")
    assert res.exit_code == 1 and f"error: {a} changed after it was built" in res.output
    assert sorted(p.name for p in (out / "versions").glob("v*.json")) == ["v000001.json", "v000002.json"]


def test_an_object_replaced_while_its_cycle_builds_is_named_and_built_next_cycle(tmp_path, monkeypatch):
    import vlmprep.builder.pipeline as pipeline

    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    assert once(inbox, out).exit_code == 0
    c = land(inbox, 1)
    real = pipeline.run_task

    def replaced_first(*a, **kw):  # the listing and the plan saw one object; the task reads another
        monkeypatch.setattr(pipeline, "run_task", real)
        land(inbox, 1, n=5, name=c.name)
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "run_task", replaced_first)
    res = once(inbox, out)
    assert res.exit_code == 75, res.output
    assert f"fault: {c} changed after the plan was made" in res.output and "(--once: run again later)" in res.output
    assert not (out / "versions" / "v000002.json").exists()  # nothing of the attempt is visible
    assert (out / "manifest.json").read_bytes() == (out / "versions" / "v000001.json").read_bytes()
    res = once(inbox, out)
    assert "v2 committed: 1 object, 5 records" in res.output, res.output  # the new content, whole
    check_exactly_once(local_reader(out), [str(p) for p in sorted(inbox.glob("*.zst"))], verifier(out))


def test_min_records_waits_for_enough_records_and_every_builds_what_waits(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    res = once(inbox, out, "--min-records", "5")
    assert res.exit_code == 0 and "1 object waiting (3 records), not due yet; no dataset yet" in res.output
    land(inbox, 1)
    res = once(inbox, out, "--min-records", "5")
    assert "v1 committed: 2 objects, 6 records" in res.output, res.output
    land(inbox, 2)
    res = once(inbox, out, "--min-records", "5", "--every", "3600")  # --once: the time trigger counts as due
    assert "v2 committed: 1 object, 3 records" in res.output, res.output


@pytest.mark.parametrize("kind", ["symlink", "FIFO"])
def test_a_status_file_that_is_a_planted_link_or_fifo_is_refused(kind, tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    plant(tmp_path / "status.json", kind, victim)
    res = finishes(lambda: once(inbox, out, "--status-file", tmp_path / "status.json"))
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert f"--status-file {tmp_path / 'status.json'} is" in res.output and "refusing to write through it" in res.output
    assert victim.read_text() == "the user's own file\n" and not out.exists()


def test_object_names_with_control_characters_are_printed_escaped(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    assert once(inbox, out).exit_code == 0
    evil = land(inbox, 1, name="x\x1b]0;owned\x07\x1b[2J.jsonl.zst")
    evil.write_bytes(evil.read_bytes())  # still one object, now built below
    res = once(inbox, out, "--status-file", tmp_path / "st.json")
    assert "v2 committed" in res.output, res.output
    evil.write_bytes(evil.read_bytes() + b"\n")  # changed: its name is printed in the report
    res = once(inbox, out, "--status-file", tmp_path / "st.json")
    assert "\x1b" not in res.output and "\x07" not in res.output
    assert "x\\x1b]0;owned\\x07\\x1b[2J.jsonl.zst changed after it was built" in res.output
    assert "\x1b" not in (tmp_path / "st.json").read_text()  # JSON escapes: \u001b


def test_a_missing_local_location_is_refused_in_one_line(tmp_path):
    res = invoke(*watch_args(tmp_path / "nowhere", tmp_path / "ds", "--once"))
    assert res.exit_code == 1 and res.output.strip() == (
        f"error: --in {tmp_path / 'nowhere'}: no such file or directory; make the directory the traces land in first"
    )


def test_a_build_beside_a_cycle_is_refused_and_a_commit_lost_to_another_is_built_next_cycle(tmp_path, monkeypatch):
    import vlmprep.builder.pipeline as pipeline
    from vlmprep.shards.versions import CommitConflict

    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    assert once(inbox, out).exit_code == 0
    c = land(inbox, 1)
    other = land(tmp_path / "elsewhere", 7)
    real = pipeline.commit_local
    beside = []

    def lost(out_dir, n, data):  # while the cycle holds --out, a build --append is refused; then the race is lost
        monkeypatch.setattr(pipeline, "commit_local", real)
        beside.append(invoke("build", "--append", "--in", other, "--out", out, *FLAGS, "--no-progress"))
        raise CommitConflict(f"{out_dir}: version {n} was committed by another build meanwhile")

    monkeypatch.setattr(pipeline, "commit_local", lost)
    res = once(inbox, out)
    assert res.exit_code == 75 and "fault: " in res.output and "committed by another build meanwhile" in res.output
    assert beside[0].exit_code == 1 and f"--out {out} is in use by" in beside[0].output
    assert not (out / "versions" / "v000002.json").exists()
    res = invoke("build", "--append", "--in", other, "--out", out, *FLAGS, "--no-progress")  # the race's winner
    assert res.exit_code == 0 and "appended version v2" in res.output
    res = once(inbox, out)
    assert "v3 committed: 1 object, 3 records" in res.output, res.output  # its objects, on top of the winner's
    landed = [str(inbox / "obj-000.jsonl.zst"), str(c), str(other)]
    check_exactly_once(local_reader(out), landed, verifier(out))


def test_an_out_inside_the_watched_location_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    for location, out in ((tmp_path / "data", tmp_path / "data" / "ds"), (tmp_path / "ds" / "in", tmp_path / "ds")):
        location.mkdir(parents=True, exist_ok=True)
        res = invoke(*watch_args(location, out, "--once"))
        assert res.exit_code == 1 and res.output.startswith(f"error: --out {out} and --in {location} overlap"), (
            res.output
        )


def test_metrics_are_prometheus_text_and_label_text_is_escaped():
    from vlmprep.builder.watch_status import Status, metrics_text

    s = Status(location=["/in"], out="/ds", status_file=None)
    s.count_version({"totals": {"records": 5, "samples": 7}, "rejects": {"duplicate_id": 2}})
    s.update(
        state="waiting",
        consecutive_failures=1,
        last_cycle={"seconds": 1.25, "error": 'cannot list s3://b/"x"\n\x1b[2J', "committed": False},
    )
    text = metrics_text(s.snapshot())
    lines = text.splitlines()
    assert "vlmprep_watch_up 0" in lines and "vlmprep_watch_samples_built_total 7" in lines
    assert 'vlmprep_watch_rejects_total{reason="duplicate_id"} 2' in lines
    assert 'vlmprep_watch_last_error_info{error="cannot list s3://b/\\"x\\"\\\\n\\\\x1b[2J"} 1' in lines
    assert "\x1b" not in text and all(line.startswith(("# HELP ", "# TYPE ", "vlmprep_watch_")) for line in lines)


@pytest.mark.parametrize("kind", ["symlink", "FIFO"])
def test_a_watch_lock_that_is_a_planted_link_or_fifo_is_refused(kind, tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    inbox.mkdir()
    land(inbox, 0)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    plant(out / ".vlmprep.watch.lock", kind, victim)
    res = finishes(lambda: once(inbox, out))
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
    assert ".vlmprep.watch.lock" in res.output and not (out / "manifest.json").exists()
    assert victim.read_text() == "the user's own file\n"
