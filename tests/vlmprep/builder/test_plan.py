"""Task plan (vlmprep/builder/plan.py): every task reads exactly its cut of the input, and the cuts together are the input in
order, for each input kind (plain, single- and multi-frame .zst, .json arrays, blank lines, oversized lines, an
empty file); cuts fall on the record boundary nearest each k/T of the bytes."""

import json
from pathlib import Path

import pytest
import zstandard

from vlmprep.builder.plan import make_plan, plan_digest, task_records
from vlmprep.ingest.records import ReadLimits, Seek, iter_records
from vlmprep.shards.manifest import SavedProcessor

LIMITS = dict(limits=ReadLimits(max_line_bytes=400, max_zstd_window=1 << 27))


def _processor(fingerprint: str = "") -> SavedProcessor:
    return SavedProcessor(spec="", class_name="", fingerprint=fingerprint, dir="processor")


def _lines(n: int, seed: int) -> list[bytes]:
    out = []
    for i in range(n):
        pad = "x" * ((i * 37 + seed * 11) % 90)
        out.append(json.dumps({"id": f"r{seed}-{i}", "messages": [], "pad": pad}).encode() + b"\n")
    return out


def _inputs(d: Path) -> list[Path]:
    a = _lines(9, 1)
    a.insert(3, b"\n")  # blank lines are not records
    a.insert(6, b"  \n")
    a.insert(7, b'{"too": "' + b"y" * 500 + b'"}\n')  # over max_line_bytes: a record that carries an error
    plain = d / "a.jsonl"
    plain.write_bytes(b"".join(a))
    one = d / "b.jsonl.zst"
    one.write_bytes(zstandard.ZstdCompressor().compress(b"".join(_lines(7, 2))))
    frames = d / "c.jsonl.zst"  # several frames, one cut by a frame edge inside a line
    data = b"".join(_lines(11, 3))
    frames.write_bytes(
        b"".join(zstandard.ZstdCompressor().compress(data[i : i + 300]) for i in range(0, len(data), 300))
    )
    arr = d / "d.json"
    arr.write_text(json.dumps([{"id": f"j{i}", "messages": []} for i in range(4)]))
    empty = d / "e.jsonl"
    empty.write_bytes(b"")
    tail = d / "f.jsonl"
    tail.write_bytes(b"".join(_lines(3, 4)))
    garbage = d / "g.jsonl.zst"  # three frames, then bytes that are no frame: a task may start at the garbage
    garbage.write_bytes(b"".join(zstandard.ZstdCompressor().compress(line) for line in _lines(3, 5)) + b"junk" * 9)
    bom = d / "h.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b"".join(_lines(2, 6)))
    return [plain, one, frames, arr, empty, tail, garbage, bom]


def _key(r):
    return (r.position, r.source, r.text, json.dumps(r.data), None if r.error is None else str(r.error), r.unread_bytes)


@pytest.mark.parametrize("tasks", [1, 2, 3, 5, 8, 13, 40, 45, 52])
def test_tasks_read_their_cuts_and_together_the_whole_input_in_order(tmp_path, tasks):
    files = _inputs(tmp_path)
    whole = [_key(r) for r in iter_records(files, **LIMITS)]
    plan = make_plan(config={}, files=files, processor=_processor(), tasks=tasks, **LIMITS)
    assert plan.records == len(whole) == sum(c.records for c in plan.cuts)
    got = []
    for i, cut in enumerate(plan.cuts):
        part = [_key(r) for r in task_records(plan, i, **LIMITS)]
        assert len(part) == cut.records and all(k[0] >= cut.position for k in part)
        got += part
    assert got == whole
    if tasks == 1:
        assert plan.cuts[0].seek == Seek(offset=0, line=0, frame=0, frame_offset=0)


def test_a_task_inside_a_multi_frame_zst_starts_at_its_frame_not_the_file_start(tmp_path):
    files = _inputs(tmp_path)
    plan = make_plan(config={}, files=[files[2]], processor=_processor(), tasks=4, **LIMITS)
    later = [c.seek for c in plan.cuts[1:]]
    # Each frame holds 300 decompressed bytes: a task seeks to the frame holding its first line.
    assert [s.frame_offset for s in later] == [s.offset // 300 * 300 for s in later], later
    assert sum(s.frame > 0 for s in later) >= 2


def test_cuts_take_the_record_boundary_nearest_each_share_of_the_bytes(tmp_path):
    p = tmp_path / "w.jsonl"
    sizes = [100, 100, 100, 700, 100, 100, 100, 100]
    p.write_bytes(b"".join(b"{" + b" " * (s - 3) + b"}\n" for s in sizes))
    plan = make_plan(config={}, files=[p], processor=_processor(), tasks=2, limits=ReadLimits(max_line_bytes=1 << 20))
    # 1400 bytes: the half (700) falls inside the big record (300..1000); the boundary after it is nearer.
    assert [c.records for c in plan.cuts] == [4, 4]
    assert [c.bytes for c in plan.cuts] == [1000, 400]
    many = make_plan(config={}, files=[p], processor=_processor(), tasks=20, limits=ReadLimits(max_line_bytes=1 << 20))
    assert sum(c.records for c in many.cuts) == 8 and sum(c.records == 0 for c in many.cuts) == 12


def test_the_plan_is_a_pure_function_of_inputs_and_options(tmp_path):
    files = _inputs(tmp_path)
    a = make_plan(config={"seq_len": 1}, files=files, processor=_processor("f"), tasks=3, **LIMITS)
    b = make_plan(config={"seq_len": 1}, files=files, processor=_processor("f"), tasks=3, **LIMITS)
    c = make_plan(config={"seq_len": 2}, files=files, processor=_processor("f"), tasks=3, **LIMITS)
    assert plan_digest(a) == plan_digest(b) != plan_digest(c)
