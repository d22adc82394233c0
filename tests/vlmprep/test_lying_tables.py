"""Inputs that lie (issue 53.6, round 5): Arrow batches whose offsets point past their buffers, a file cut short while
it is read, a message or footer claiming far more than the file holds, JSON nested 200,000 deep, a row of a million
messages, a save_to_disk data file linked out of its dir. Each is refused where it is read, with a reason code, and
the good input beside it still lands (docs/untrusted-datasets.md, Round 5)."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.ingest.records import InputError, expand_inputs
from vlmprep.ingest.tables import iter_table_records
from vlmprep.shards.reader import iter_dataset

ROOT = Path(__file__).resolve().parents[2]
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def _rows(prefix: str, n: int = 3) -> list[dict]:
    return [{"id": f"{prefix}{i}", "messages": json.dumps(TURNS)} for i in range(n)]


def _build(inp: Path, out: Path, **kw):
    opts = dict(processor="tiny:qwen2-vl", progress=False, max_reject_fraction=1.0, min_turn_coverage=0.0)
    return build(BuildConfig(inputs=(str(inp),), out=str(out), **{**opts, **kw}))


def _arrow(path: Path, rows: list[dict], *, stream: bool) -> None:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as f, (pa.ipc.new_stream if stream else pa.ipc.new_file)(f, table.schema) as w:
        w.write_table(table)


def _lying_offsets(path: Path, last: int, *, stream: bool) -> None:
    """Three rows whose ids' string offsets are 0, 2, 4, `last`: the last row's string ends `last` bytes in, past
    the 6-byte data buffer (2*10^9: far outside the file, which a mapped read turned into SIGBUS)."""
    _arrow(path, [{"id": f"x{i}", "messages": json.dumps(TURNS)} for i in range(3)], stream=stream)
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<4i", 0, 2, 4, 6))
    assert at > 0
    data[at : at + 16] = struct.pack("<4i", 0, 2, 4, last)
    path.write_bytes(bytes(data))


def _huge_body(path: Path) -> None:
    """A stream whose record batch message claims a body of 10^12 bytes (the file holds a few hundred)."""
    _arrow(path, _rows("h"), stream=True)
    data = bytearray(path.read_bytes())
    at = 8 + struct.unpack_from("<i", data, 4)[0]  # past the schema message: the batch message
    meta = pa.ipc.read_message(pa.py_buffer(bytes(data[at:])))
    body = struct.pack("<q", meta.body.size)
    start = at + 8
    i = data.find(body, start, start + meta.metadata.size)
    assert i > 0
    data[i : i + 8] = struct.pack("<q", 10**12)
    path.write_bytes(bytes(data))


def _null_rows(path: Path, rows: int) -> None:
    """A stream of one batch of `rows` null rows: no buffers at all, so any row count is a valid batch."""
    table = pa.table({"id": pa.nulls(rows), "messages": pa.nulls(rows)})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)


_BUILD = """
import json, sys
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
res = build(BuildConfig(inputs=(sys.argv[1],), out=sys.argv[2], processor="tiny:qwen2-vl", progress=False,
                        max_reject_fraction=1.0, min_turn_coverage=0.0))
print(json.dumps(res.manifest.rejects))
"""


def test_arrow_batches_that_lie_are_one_reject_each_and_the_good_file_beside_them_lands(tmp_path):
    """Offsets far past the end (a SIGBUS that killed the build, good file and all, before), negative (a
    SystemError traceback), one past (a read of padding), a terabyte body and 10^9 null rows in ~600 bytes: each file
    one unreadable_table naming what lies. In a subprocess, so a signal fails the test instead of killing pytest."""
    d = tmp_path / "in"
    d.mkdir()
    _arrow(d / "good.arrow", _rows("g"), stream=False)
    _lying_offsets(d / "far.arrow", 2_000_000_000, stream=False)
    _lying_offsets(d / "far-stream.arrow", 2_000_000_000, stream=True)
    _lying_offsets(d / "negative.arrow", -2_000_000_000, stream=True)
    _lying_offsets(d / "one-past.arrow", 7, stream=False)
    _huge_body(d / "body.arrow")
    _null_rows(d / "nulls.arrow", 10**9)
    r = subprocess.run(
        [sys.executable, "-c", _BUILD, str(d), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert json.loads(r.stdout.splitlines()[-1]) == {"unreadable_table": 6}
    assert [s.meta()["id"] for s in iter_dataset(tmp_path / "o")] == ["g0", "g1", "g2"]
    why = {
        Path(e["source"]["file"]).name: e["message"]
        for e in map(json.loads, (tmp_path / "o" / "rejects.jsonl").read_text().splitlines())
    }
    assert "offset for slot 3 out of bounds: 2000000000 > 6" in why["far.arrow"]
    assert "offset for slot 3 out of bounds: 2000000000 > 6" in why["far-stream.arrow"]
    assert "non-monotonic offset" in why["negative.arrow"]
    assert "out of bounds: 7 > 6" in why["one-past.arrow"]
    assert "Expected to be able to read 1000000000000 bytes" in why["body.arrow"]
    assert "claims 1000000000 rows in" in why["nulls.arrow"]


_CUT = """
import sys
from pathlib import Path
from vlmprep.ingest.tables import iter_table_records
path = Path(sys.argv[1])
records = iter_table_records(path)
first = next(records)
with open(path, "r+b") as f:  # another process cuts the file short while the build reads it
    f.truncate(path.stat().st_size // 3)
rest = list(records)
print(first.data["id"], len(rest), rest[-1].error.reason, rest[-1].error.message)
"""


@pytest.mark.parametrize("stream", [False, True])
def test_an_arrow_file_cut_short_while_it_is_read_ends_in_a_reject_not_a_sigbus(tmp_path, stream):
    """A mapped file cut short under the reader is a SIGBUS (the process dies, nothing is written); read, it is an
    unreadable_table after the rows read before the cut."""
    path = tmp_path / "t.arrow"
    rows = [{"id": f"r{i}", "messages": json.dumps(TURNS) + " " * 100_000} for i in range(40)]
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as f, (pa.ipc.new_stream if stream else pa.ipc.new_file)(f, table.schema) as w:
        w.write_table(table, max_chunksize=4)
    r = subprocess.run([sys.executable, "-c", _CUT, str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    first, n, reason, message = r.stdout.split(" ", 3)
    assert first == "r0" and reason == "unreadable_table", r.stdout
    assert 0 < int(n) < 40 and "the rows before it were kept" in message


def test_an_arrow_input_in_a_store_claiming_a_terabyte_body_allocates_none_of_it(tmp_path):
    """Read through a store's range reads, a message's claimed body was one read of that size (a MemoryError
    traceback before); each read is now capped at the object's size: one unreadable_table."""
    import fsspec

    from vlmprep.ingest.locations import RemoteFile

    _huge_body(tmp_path / "body.arrow")
    fs = fsspec.filesystem("memory")
    fs.pipe("/lying/body.arrow", (tmp_path / "body.arrow").read_bytes())
    try:
        got = list(iter_table_records(RemoteFile("memory://lying/body.arrow")))
    finally:
        fs.rm("/lying", recursive=True)
    assert len(got) == 1 and got[0].error.reason == "unreadable_table"
    assert "Expected to be able to read 1000000000000 bytes" in got[0].error.message


def _claim_rows(path: Path, rows: int) -> None:
    """Rewrites a Parquet footer so that it, its row group and its column chunk claim `rows` rows (thrift compact:
    each i64 field holding the real count, 300, as the zigzag varint d8 04)."""

    def varint(n: int) -> bytes:
        out = b""
        while n >= 0x80:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])

    data = path.read_bytes()
    n = struct.unpack("<i", data[-8:-4])[0]
    footer = re.sub(rb"([\x16\x26\x36\x46\x56])\xd8\x04", lambda m: m.group(1) + varint(2 * rows), data[-8 - n : -8])
    path.write_bytes(data[: -8 - n] + footer + struct.pack("<i", len(footer)) + b"PAR1")
    assert pq.ParquetFile(path).metadata.num_rows == rows


def test_a_parquet_footer_claiming_more_rows_than_its_bytes_is_one_reject_at_planning(tmp_path):
    """A 2.6 KB file whose footer claims 10^12 rows failed planning with MemoryError (a list per claimed row): the
    claim is checked against the file's bytes when it is opened, for the plan's scan and for the read."""
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(_rows("g")), d / "good.parquet")
    pq.write_table(pa.Table.from_pylist(_rows("x", 300)), d / "lie.parquet")
    _claim_rows(d / "lie.parquet", 10**12)
    assert (d / "lie.parquet").stat().st_size < 4000
    res = _build(d, tmp_path / "o", tasks=2, workers=1)
    assert res.manifest.rejects == {"unreadable_table": 1}
    assert [s.meta()["id"] for s in iter_dataset(tmp_path / "o")] == ["g0", "g1", "g2"]
    reject = json.loads((tmp_path / "o" / "rejects.jsonl").read_text())
    assert "its footer claims 1000000000000 rows in" in reject["message"], reject


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def test_json_nested_deeper_than_the_limit_is_one_reject_before_any_stage_recurses(tmp_path):
    """200,000 levels were an internal_error RecursionError where a JSON string was parsed (a table's messages
    column, tool-call arguments), 900 levels one wherever a stage recursed after the parse: every JSON text of a
    record is now measured as it is parsed (then walked without recursion), against --max-json-depth (64): a .json
    file's record alone is rejected."""
    d = tmp_path / "in"
    d.mkdir()
    ok = {"id": "ok", "messages": TURNS}
    lines = [json.dumps(ok)]
    for n in (900, 200_000):
        lines.append(json.dumps({"id": f"line{n}", "messages": TURNS})[:-1] + ', "extra": ' + _deep(n) + "}")
        call = {"type": "function", "function": {"name": "f", "arguments": '{"a": ' + _deep(n) + "}"}}
        tc = {"role": "assistant", "content": "yo", "tool_calls": [call]}
        lines.append(json.dumps({"id": f"args{n}", "messages": [TURNS[0], tc]}))
    (d / "a.jsonl").write_text("\n".join(lines) + "\n")
    cells = [{"id": "t-ok", "messages": json.dumps(TURNS)}]
    cells += [{"id": f"t{n}", "messages": json.dumps(TURNS)[:-1] + ", " + _deep(n) + "]"} for n in (900, 200_000)]
    pq.write_table(pa.Table.from_pylist(cells), d / "b.parquet")
    deep = json.dumps({"id": "j", "messages": TURNS}).replace('"j"', _deep(900))
    (d / "c.json").write_text("[" + json.dumps({"id": "j-ok", "messages": TURNS}) + ", " + deep + "]")
    (d / "d.json").write_text(json.dumps([{"id": "d-ok", "messages": TURNS}]))
    res = _build(d, tmp_path / "o")
    assert res.manifest.rejects == {"json_too_deep": 7}, res.manifest.rejects
    # the .json file's good record lands beside its deep one
    assert sorted(s.meta()["id"] for s in iter_dataset(tmp_path / "o")) == ["d-ok", "j-ok", "ok", "t-ok"]
    messages = [json.loads(x)["message"] for x in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert all(re.search(r"nests \d+ levels deep > max_json_depth=64", m) for m in messages), messages
    assert "messages[1].tool_calls[0]: arguments nests 200001 levels deep > max_json_depth=64" in messages


def test_the_json_depth_limit_is_an_option_and_refuses_what_it_cannot_hold(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"id": "x", "messages": TURNS, "meta": json.loads(_deep(10))}) + "\n")
    cfg = dict(inputs=(str(p),), processor="tiny:qwen2-vl", progress=False, max_reject_fraction=1.0)
    assert build(BuildConfig(out=str(tmp_path / "a"), **cfg)).manifest.rejects == {}
    res = build(BuildConfig(out=str(tmp_path / "b"), max_json_depth=8, allow_empty=True, min_turn_coverage=0, **cfg))
    assert res.manifest.rejects == {"json_too_deep": 1}
    with pytest.raises(ValueError, match="max_json_depth=1000: must be in 8..256"):
        BuildConfig(out=str(tmp_path / "c"), max_json_depth=1000, **cfg)


def test_a_row_of_a_million_messages_is_refused_before_it_is_converted(tmp_path):
    """An ~8 KB Parquet row of 10^6 messages spent 52 s and ended internal_error: MemoryError. Its list's length is
    read from the column, so the row is never converted: too_many_messages (--max-messages-per-record, 10000); the
    row beside it in the same batch is read as ever."""
    path = tmp_path / "many.parquet"
    many = {"id": "many", "messages": TURNS * 500_000}
    pq.write_table(pa.Table.from_pylist([{"id": "ok", "messages": TURNS}, many]), path, compression="zstd")
    assert path.stat().st_size < 10_000
    got = list(iter_table_records(path))
    assert got[0].data["id"] == "ok" and got[0].error is None
    assert got[1].data is None and got[1].error.reason == "too_many_messages"
    assert got[1].error.message == "1000000 messages > max_messages_per_record=10000"


def test_the_messages_limit_holds_for_every_layout(tmp_path):
    """Over --max-messages-per-record: a JSONL record, a ShareGPT one, a table's messages as a list column and as a
    JSON string, the_cauldron's texts (two messages each); at the limit, each builds."""
    d = tmp_path / "in"
    d.mkdir()
    over, at = TURNS * 3, TURNS * 2  # 6 and 4 messages against a limit of 4
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}] * 3
    records = [
        {"id": "j-over", "messages": over},
        {"id": "j-at", "messages": at},
        {"id": "s", "conversations": sharegpt},
    ]
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(
        pa.Table.from_pylist([{"id": "l-over", "messages": over}, {"id": "l-at", "messages": at}]), d / "b.parquet"
    )
    pq.write_table(
        pa.Table.from_pylist(
            [{"id": "s-over", "messages": json.dumps(over)}, {"id": "s-at", "messages": json.dumps(at)}]
        ),
        d / "c.parquet",
    )
    texts = [{"user": "hi", "assistant": "yo"}]
    pq.write_table(
        pa.Table.from_pylist(
            [{"id": "c-over", "texts": texts * 3, "images": []}, {"id": "c-at", "texts": texts * 2, "images": []}]
        ),
        d / "d.parquet",
    )
    res = _build(d, tmp_path / "o", max_messages_per_record=4)
    assert res.manifest.rejects == {"too_many_messages": 5}, res.manifest.rejects
    assert sorted(s.meta()["id"] for s in iter_dataset(tmp_path / "o")) == ["c-at", "j-at", "l-at", "s-at"]


def test_a_save_to_disk_file_linked_outside_its_dir_is_not_read(tmp_path):
    """A downloaded `save_to_disk` dir whose data file is a symlink to a table elsewhere (someone's private one) was
    built into the shards; found in a dir or a glob, a file must resolve inside it: one line naming the link, before
    anything is read. A link that stays inside, and a file named with its own --in, are read."""
    import datasets

    datasets.Dataset.from_list(_rows("pub", 1)).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(_rows("SECRET", 1)).save_to_disk(str(tmp_path / "private"))
    (data,) = (tmp_path / "saved").glob("*.arrow")
    data.unlink()
    data.symlink_to(next((tmp_path / "private").glob("*.arrow")))
    for given in (tmp_path / "saved", tmp_path / "saved" / "*.arrow"):
        with pytest.raises(InputError, match=rf"^{re.escape(str(data))}: a symlink to .*private.*, outside --in"):
            expand_inputs([str(given)])
    assert expand_inputs([str(data)]) == [data]  # named itself: the user's choice
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.arrow").symlink_to(os.path.relpath(tmp_path / "mine" / "b.arrow", tmp_path / "mine"))
    _arrow(tmp_path / "mine" / "b.arrow", _rows("m", 1), stream=True)
    assert [p.name for p in expand_inputs([str(tmp_path / "mine")])] == ["a.arrow", "b.arrow"]


def test_a_build_refuses_a_linked_save_to_disk_dir_in_one_line(tmp_path):
    import datasets
    from typer.testing import CliRunner

    from vlmprep.cli import app

    datasets.Dataset.from_list(_rows("pub", 1)).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(_rows("SECRET", 1)).save_to_disk(str(tmp_path / "private"))
    (data,) = (tmp_path / "saved").glob("*.arrow")
    data.unlink()
    data.symlink_to(next((tmp_path / "private").glob("*.arrow")))
    r = CliRunner().invoke(
        app,
        [
            "build",
            "--in",
            str(tmp_path / "saved"),
            "--out",
            str(tmp_path / "o"),
            "--processor",
            "tiny:qwen2-vl",
            "--no-progress",
        ],
    )
    assert r.exit_code == 1 and "outside --in" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o" / "manifest.json").exists()
