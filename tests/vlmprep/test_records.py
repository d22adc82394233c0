import json

import pytest
import zstandard

from vlmprep.records import InputError, expand_inputs, iter_records, parse_record
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
        ("a.jsonl.zst", 1), ("b.jsonl", 1), ("b.jsonl", 2), ("c.json", 1), ("c.json", 2)]


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
    for r in iter_records([p], max_line_bytes=1000):
        try:
            out.append(("ok", parse_record(r)["id"]))
        except RecordError as e:
            out.append(("bad", e.reason, r.source.line))
    assert out == [("ok", 1), ("bad", "invalid_json", 2), ("bad", "not_an_object", 3), ("bad", "invalid_utf8", 4),
                   ("bad", "line_too_long", 5), ("ok", 2)]


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
