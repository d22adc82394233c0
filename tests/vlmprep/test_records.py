import json

import pytest
import zstandard

from vlmprep.ingest.records import InputError, ReadLimits, expand_inputs, iter_records, parse_record
from vlmprep.types import RecordError


def _lines(recs):
    return b"".join(json.dumps(r).encode() + b"\n" for r in recs)


def test_jsonl_zst_json_and_globs_in_stable_order(tmp_path):
    (tmp_path / "b.jsonl").write_bytes(_lines([{"id": "b1"}, {"id": "b2"}]) + b"\n  \n")
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines([{"id": "a1"}])))
    (tmp_path / "c.json").write_text(json.dumps([{"id": "c1"}, {"id": "c2"}]))
    files = expand_inputs([str(tmp_path / "*.jsonl*"), str(tmp_path / "c.json"), str(tmp_path / "b.jsonl")])
    assert [f.name for f in files] == ["a.jsonl.zst", "b.jsonl", "c.json"]  # de-duplicated
    recs = list(iter_records(files))
    assert [parse_record(r)["id"] for r in recs] == ["a1", "b1", "b2", "c1", "c2"]
    assert [r.position for r in recs] == [0, 1, 2, 3, 4]
    assert [(r.source.file.rsplit("/", 1)[1], r.source.line) for r in recs] == [
        ("a.jsonl.zst", 1),
        ("b.jsonl", 1),
        ("b.jsonl", 2),
        ("c.json", 1),
        ("c.json", 2),
    ]


def test_zst_is_streamed_not_buffered(tmp_path):
    # A multi-frame stream larger than any single read buffer still yields every line.
    p = tmp_path / "big.jsonl.zst"
    with open(p, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
        for i in range(20000):
            w.write(json.dumps({"id": str(i), "pad": "x" * 200}).encode() + b"\n")
    n = sum(1 for _ in iter_records([p]))
    assert n == 20000


def test_bad_lines_become_record_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"id": 1}\n{not json\n[1, 2]\n\xff\xfe\n' + b'{"id": "' + b"y" * 5000 + b'"}\n{"id": 2}\n')
    out = []
    for r in iter_records([p], limits=ReadLimits(max_line_bytes=1000)):
        try:
            out.append(("ok", parse_record(r)["id"]))
        except RecordError as e:
            out.append(("bad", e.reason, r.source.line))
    assert out == [
        ("ok", 1),
        ("bad", "invalid_json", 2),
        ("bad", "not_an_object", 3),
        ("bad", "invalid_utf8", 4),
        ("bad", "line_too_long", 5),
        ("ok", 2),
    ]


def test_truncated_zst_stream_keeps_earlier_lines(tmp_path):
    import random

    rnd = random.Random(0)
    recs = [{"id": str(i), "pad": "%x" % rnd.getrandbits(4000)} for i in range(400)]  # incompressible: many blocks
    data = zstandard.ZstdCompressor().compress(_lines(recs))
    p = tmp_path / "t.jsonl.zst"
    p.write_bytes(data[: len(data) // 2])
    recs = list(iter_records([p]))
    assert recs[-1].error is not None and recs[-1].error.reason == "corrupt_zstd_stream"
    assert len(recs) > 1 and all(r.error is None for r in recs[:-1])


def test_missing_inputs_are_user_errors(tmp_path):
    with pytest.raises(InputError):
        expand_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(InputError):
        expand_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(InputError):
        expand_inputs([str(tmp_path / "x.txt")])


def test_garbage_after_the_last_zst_frame_keeps_every_frame_and_names_the_byte(tmp_path):
    frames = [zstandard.ZstdCompressor().compress(_lines([{"id": f"f{i}"}])) for i in range(3)]
    garbage = b"not zstd at all" * 10
    p = tmp_path / "g.jsonl.zst"
    p.write_bytes(b"".join(frames) + garbage)
    recs = list(iter_records([p]))
    assert [parse_record(r)["id"] for r in recs[:-1]] == ["f0", "f1", "f2"]
    fault = recs[-1]
    at = sum(map(len, frames))
    assert fault.error.reason == "corrupt_zstd_stream" and fault.source.line == 4
    assert f"{p}: " in fault.error.message and f"at byte {at} of {at + len(garbage)}" in fault.error.message
    assert fault.unread_bytes == len(garbage)


def test_garbage_after_a_large_zst_keeps_the_records_of_its_last_mib(tmp_path):
    # Issue 22: the decoded rest of the last 1 MiB read was dropped with the fault (300 of 3000 records).
    import random

    rnd = random.Random(1)
    recs = [{"id": str(i), "pad": "%x" % rnd.getrandbits(2000)} for i in range(3000)]
    p = tmp_path / "big.jsonl.zst"
    with open(p, "wb") as f:
        for i in range(0, 3000, 500):  # several frames, as zstd -T or a concatenation writes
            f.write(zstandard.ZstdCompressor().compress(_lines(recs[i : i + 500])))
        f.write(b"\x00garbage")
    got = list(iter_records([p]))
    assert [parse_record(r)["id"] for r in got[:-1]] == [str(i) for i in range(3000)]
    assert got[-1].error.reason == "corrupt_zstd_stream" and got[-1].unread_bytes == 8


def test_a_cut_off_zst_reads_nothing_past_its_end(tmp_path):
    data = zstandard.ZstdCompressor().compress(_lines([{"id": str(i)} for i in range(50)]))
    p = tmp_path / "t.jsonl.zst"
    p.write_bytes(data[:-5])
    recs = list(iter_records([p]))
    assert recs[-1].error.reason == "corrupt_zstd_stream" and "cut off" in recs[-1].error.message
    assert recs[-1].unread_bytes == 0  # every byte there was decoded; what the cut took is not in the file


def test_a_utf8_bom_starts_a_jsonl_or_zst_file_as_it_starts_a_json_file(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + _lines([{"id": "a1"}, {"id": "a2"}]))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(bom + _lines([{"id": "b1"}])))
    (tmp_path / "c.json").write_bytes(bom + b'[{"id": "c1"}]')
    (tmp_path / "d.jsonl").write_bytes(bom + b"\n" + _lines([{"id": "d1"}]))  # a BOM alone is a blank line
    recs = list(iter_records(expand_inputs([str(tmp_path)])))
    assert [parse_record(r)["id"] for r in recs] == ["a1", "a2", "b1", "c1", "d1"]


def test_input_names_are_paths_below_the_common_parent(tmp_path):
    from vlmprep.ingest.records import input_names

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "traces.jsonl").write_bytes(_lines([{}]))
    files = expand_inputs([str(tmp_path)])
    assert input_names(files) == ["a/traces.jsonl", "b/traces.jsonl"]
    assert input_names(files[:1]) == ["traces.jsonl"]  # one input: its file name
    assert [r.source.input_name for r in iter_records(files)] == ["a/traces.jsonl", "b/traces.jsonl"]


def test_a_json_file_nested_too_deeply_is_one_reject_not_a_crash(tmp_path):
    (tmp_path / "a.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    (tmp_path / "b.jsonl").write_bytes(_lines([{"id": "b1"}]))
    recs = list(iter_records(expand_inputs([str(tmp_path)])))
    assert recs[0].error.reason == "json_too_deep" and "nests 100000 levels deep" in recs[0].error.message
    assert recs[0].unread_bytes == 200_000
    assert [parse_record(r)["id"] for r in recs[1:]] == ["b1"]
