"""Hostile and dynamic http(s) servers behind `--in URL` and `--allow-remote` images (issue 53.6, round 5): a body
with no length builds as a stream, every wait ends in one line naming the URL, an object replaced while it is read is
refused naming both stamps, a listing cannot lead outside its prefix, each failure kind has its own wording, and no
credential of an image URL is written anywhere. Against the loopback server of tests/support/range_server.py."""

import contextlib
import io
import json
import threading
from pathlib import Path

import pytest

from tests.support.range_server import RangeServer
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.shards.reader import iter_dataset

RECORDS = [
    {
        "id": f"r{i}",
        "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}],
    }
    for i in range(6)
]


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture
def served(tmp_path) -> Path:
    d = tmp_path / "served"
    (d / "in").mkdir(parents=True)
    (d / "in" / "a.jsonl").write_bytes(_jsonl(RECORDS))
    return d


def _build(inputs, out: Path, **kw):
    kw = {"max_reject_fraction": 1.0, "min_turn_coverage": 0.0, "allow_empty": True, "workers": 1, **kw}
    return build(BuildConfig(inputs=tuple(inputs), out=str(out), progress=False, **kw))


def _ids_and_text(out: Path) -> list:
    return [(s.meta()["id"], s.array("input_ids").tolist()) for s in iter_dataset(out)]


def _rejects(out: Path) -> list[dict]:
    path = out / "rejects.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def _in_time(fn, seconds: float):
    """fn() run in a thread; fails if it has not returned within `seconds` (a wait that never ends)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_jsonl_sent_with_no_length_builds_as_a_stream_and_a_table_is_one_line(served, tmp_path):
    """A dynamic server sends the .jsonl chunked with no Content-Length, plain or gzip-encoded, and ignores Range:
    the build streams it and makes the samples of the same file served with a length, also cut into 2 tasks (the
    second task reads through to its cut). A Parquet file needs its size: one reject naming why, no traceback
    (before: a TypeError traceback from _Guarded.seek)."""
    with RangeServer(served) as srv:
        url = f"{srv.url}/in/a.jsonl"
        _build([url], tmp_path / "plain")
        want = _ids_and_text(tmp_path / "plain")
        for gz in (False, True):
            srv.server.chunked["a.jsonl"] = gz
            for tasks in (1, 2) if not gz else (2,):
                out = tmp_path / f"chunked-{gz}-{tasks}"
                res = _build([url], out, tasks=tasks)
                assert _ids_and_text(out) == want and res.manifest.totals["rejected"] == 0, (gz, tasks)
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{"messages": json.dumps(RECORDS[0]["messages"])}]), served / "t.parquet")
        srv.server.chunked["t.parquet"] = False
        _build([f"{srv.url}/t.parquet"], tmp_path / "table")
    [rej] = _rejects(tmp_path / "table")
    assert rej["reason"] == "unreadable_table" and "no length" in rej["message"], rej
    assert "t.parquet" in rej["message"] and "download it first" in rej["message"]
    assert len(want) == len(RECORDS)


def test_a_server_that_sends_headers_then_nothing_ends_in_one_line_naming_the_url(served, tmp_path, monkeypatch):
    """Headers, then silence: the read waits VLMPREP_HTTP_TIMEOUT seconds (1 here), then the file is one read_error
    reject naming the URL and the bound, and the build ends (before: it waited for ever, silently). A server that
    never answers a listing or a HEAD is one line from the CLI, exit 1."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    monkeypatch.setenv("VLMPREP_HTTP_TIMEOUT", "1")
    with RangeServer(served) as srv:
        srv.server.stall.add("a.jsonl")
        url = f"{srv.url}/in/a.jsonl"
        res = _in_time(lambda: _build([url], tmp_path / "o"), 120)
        srv.server.mute.add("b.jsonl")
        cli = _in_time(
            lambda: CliRunner().invoke(
                app, ["build", "--in", f"{srv.url}/in/b.jsonl", "--out", str(tmp_path / "p"), "--no-progress"]
            ),
            60,
        )
    [rej] = _rejects(tmp_path / "o")
    assert res.manifest.totals["samples"] == 0 and rej["reason"] == "read_error", rej
    assert f"cannot read {url}: no answer for 1 s (VLMPREP_HTTP_TIMEOUT sets the bound)" in rej["message"], rej
    lines = [ln for ln in cli.output.splitlines() if ln.strip()]
    assert cli.exit_code == 1 and len(lines) == 1, cli.output
    assert f"cannot read {srv.url}/in/b.jsonl: no answer for 1 s" in lines[0], lines


def test_an_object_replaced_between_the_tasks_check_and_its_read_is_refused_naming_both_etags(served, tmp_path):
    """The plan stamps the object (ETag); it is replaced (same size, other text) after the task's check and before
    its first GET: the task's read is refused naming both ETags, and no sample of the replacement is written (before:
    it built the replacement with exit 0, the manifest recording the old ETag)."""
    other = _jsonl(
        [
            {**r, "messages": [r["messages"][0], {"role": "assistant", "content": f"ANSWER {r['id'][1:]}!"}]}
            for r in RECORDS
        ]
    )
    original = (served / "in" / "a.jsonl").read_bytes()
    assert len(other) == len(original)
    with RangeServer(served) as srv:
        srv.server.etags = True
        url = f"{srv.url}/in/a.jsonl"
        _build([url], tmp_path / "o", plan_only=True)
        planned = json.loads((tmp_path / "o" / "plan.json").read_text())["inputs"][0]["etag"]
        srv.server.swap["a.jsonl"] = other
        res = _build([url], tmp_path / "o", task_index=0)
        now = srv.server.etag_of(other)
    assert planned == srv.server.etag_of(original) != now
    [rej] = [json.loads(ln) for ln in (tmp_path / "o" / "tasks" / "task-00000.rejects.jsonl").read_text().splitlines()]
    assert res.task.totals["samples"] == 0 and rej["reason"] == "read_error", rej
    assert f"cannot read {url}: it changed" in rej["message"], rej
    assert f"ETag {planned} when" in rej["message"] and f"{now} now" in rej["message"], rej
    assert (served / "in" / "a.jsonl").read_bytes() == other  # the server did serve the replacement


def test_a_listing_link_that_leaves_the_prefix_is_never_followed(served, tmp_path):
    """An index page of --in URL/in/ links ../secret.jsonl, an absolute /secret.jsonl, another server's file, a
    query and itself: only the file under the prefix is built (or planned, from the glob URL/in/*.jsonl) and nothing
    outside it is even asked for (before: ../secret.jsonl was read into the dataset)."""
    (served / "secret.jsonl").write_bytes(_jsonl([{**RECORDS[0], "id": "secret"}]))
    with RangeServer(served) as srv:
        srv.server.pages["/in/"] = (
            '<a href="a.jsonl">a</a> <a href="../secret.jsonl">s</a> <a href="/secret.jsonl">s</a> '
            '<a href="sub/../../secret.jsonl">s</a> <a href="http://example.invalid/in/x.jsonl">x</a> '
            '<a href="?C=N;O=D">sort</a> <a href="./">here</a> <a href="%2e%2e/secret.jsonl">s</a>'
        )
        res = _build([f"{srv.url}/in/"], tmp_path / "o")
        globbed = _build([f"{srv.url}/in/*.jsonl"], tmp_path / "g", plan_only=True)
        asked = {p for _, p, _, _ in srv.log}
    assert [i.path for i in res.manifest.inputs] == [f"{srv.url}/in/a.jsonl"]
    assert [i.path for i in globbed.plan.inputs] == [f"{srv.url}/in/a.jsonl"]
    assert sorted(i for i, _ in _ids_and_text(tmp_path / "o")) == [r["id"] for r in RECORDS]
    assert not [p for p in asked if "secret" in p], asked


def test_each_http_failure_kind_says_what_happened_in_one_line(served, tmp_path):
    """`--in URL` of a 403, a 404, a redirect to file:// and a redirect loop: exit 1, one line each saying which
    (before: "no such object" for all of them)."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    with RangeServer(served) as srv:
        srv.server.forbidden.add("a.jsonl")
        srv.server.redirect["b.jsonl"] = "file:///etc/passwd"
        srv.server.redirect["c.jsonl"] = f"{srv.url}/in/c.jsonl"
        said = {}
        for name in ("a.jsonl", "b.jsonl", "c.jsonl", "none.jsonl"):
            res = CliRunner().invoke(
                app, ["build", "--in", f"{srv.url}/in/{name}", "--out", str(tmp_path / name), "--no-progress"]
            )
            lines = [ln for ln in res.output.splitlines() if ln.strip()]
            assert res.exit_code == 1 and len(lines) == 1 and "Traceback" not in res.output, res.output
            said[name] = lines[0]
    url = f"{srv.url}/in"
    assert said["a.jsonl"] == f"error: cannot read {url}/a.jsonl: access denied (403)"
    assert said["b.jsonl"] == (
        f"error: cannot read {url}/b.jsonl: redirect (302) to file:///etc/passwd refused "
        "(only http(s) redirects are followed)"
    )
    assert said["c.jsonl"] == f"error: cannot read {url}/c.jsonl: too many redirects (302)"
    assert said["none.jsonl"] == f"error: cannot read {url}/none.jsonl: not found (404)"


def test_an_image_urls_credentials_are_written_nowhere(served, tmp_path, capsys):
    """A record's image at http://user:hunter2@host/... with --allow-remote: the record is rejected (a URL's
    credentials are never sent), and neither rejects.jsonl nor the manifest nor anything printed holds the password
    (before: the whole URL was in rejects.jsonl). A 403 image says so."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(buf, "PNG")
    (served / "x.png").write_bytes(buf.getvalue())
    (served / "no.png").write_bytes(buf.getvalue())
    with RangeServer(served) as srv:
        srv.server.forbidden.add("no.png")
        host = srv.url.split("://", 1)[1]
        records = [
            {
                "id": f"r{i}",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
                    {"role": "assistant", "content": "ok"},
                ],
            }
            for i, url in enumerate([f"http://user:hunter2@{host}/x.png", f"{srv.url}/no.png", f"{srv.url}/x.png"])
        ]
        (tmp_path / "in.jsonl").write_bytes(_jsonl(records))
        res = _build([str(tmp_path / "in.jsonl")], tmp_path / "o", allow_remote=True)
    rejects = {r["id"]: r for r in _rejects(tmp_path / "o")}
    assert res.manifest.totals["samples"] == 1 and set(rejects) == {"r0", "r1"}, rejects
    assert "http://***@" in rejects["r0"]["message"] and "credentials" in rejects["r0"]["message"], rejects
    assert f"cannot read {srv.url}/no.png: access denied (403)" in rejects["r1"]["message"], rejects
    written = [p for p in (tmp_path / "o").rglob("*") if p.is_file() and b"hunter2" in p.read_bytes()]
    printed = capsys.readouterr()
    assert not written and "hunter2" not in printed.out + printed.err


def test_an_s3_object_replaced_between_the_tasks_check_and_its_read_is_refused(tmp_path, monkeypatch):
    """The same race in a bucket (moto's S3 server): the object is replaced right after the task's check of the
    plan's stamps; the read that follows is refused naming the change, nothing of the replacement is built (before:
    the replacement was built, the manifest recording the old ETag)."""
    import s3fs

    from tests.trainer.test_remote import s3_server
    from vlmprep.builder import task

    with contextlib.contextmanager(s3_server.__wrapped__)():
        fs = s3fs.S3FileSystem()
        fs.mkdir("race")
        original = _jsonl(RECORDS)
        fs.pipe("race/in/a.jsonl", original)
        _build(["s3://race/in/a.jsonl"], tmp_path / "o", plan_only=True)
        checked = task.check_inputs_unchanged

        def check_then_replace(plan):
            checked(plan)
            fs.pipe("race/in/a.jsonl", original.replace(b"answer", b"ANSWER"))

        monkeypatch.setattr(task, "check_inputs_unchanged", check_then_replace)
        res = _build(["s3://race/in/a.jsonl"], tmp_path / "o", task_index=0)
    [rej] = [json.loads(ln) for ln in (tmp_path / "o" / "tasks" / "task-00000.rejects.jsonl").read_text().splitlines()]
    assert res.task.totals["samples"] == 0 and rej["reason"] == "read_error", rej
    assert "cannot read s3://race/in/a.jsonl: it changed" in rej["message"], rej


def test_the_timeout_reaches_task_processes_started_before_it_was_set():
    """VLMPREP_HTTP_TIMEOUT is handed to each task process as the builder sees it now, as the stores' credentials
    are (a forkserver started by an earlier build would not have it)."""
    import vlmprep.ingest.web as web
    from vlmprep.builder import local_executor

    assert web.TIMEOUT_ENV.startswith(local_executor._STORE_ENV)
