"""What a build counts (issue 53.5): the manifest's totals.rejected counts rejected records, not the lines of
rejects.jsonl (a turn_too_long line is a lost turn of a record that landed), as the summary and `stats` say, and a
dataset built before (whose totals.rejected counted lines) still reads the same; every rejected record's turns count
as lost, whatever the stage that rejected it and whatever the record's layout."""

import json
import os
from pathlib import Path

import pytest

from tests.trainer.conftest import ROOT
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.shards.manifest import load_manifest
from vlmprep.shards.summary import format_build_summary, rejected_records
from vlmprep.tools.stats import compute_stats
from vlmprep.tools.stats_text import format_stats

REAL = Path(os.environ.get("VLMPREP_REAL_TRACES", ROOT.parent / "shared" / "data" / "real_traces"))


def _cfg(inp: Path, out: Path, **kw) -> BuildConfig:
    return BuildConfig(inputs=(str(inp),), out=str(out), progress=False, **kw)


def test_totals_rejected_counts_records_and_a_dataset_built_before_reads_the_same(tmp_path):
    """SeeAct with tiny:qwen2.5-vl: 3 records, 2 samples, 4 turns too long for --seq-len (one record lost both its
    turns: it landed nothing, but no reason rejects it). totals.rejected is 0 (4 before: the lines), reject_lines 4,
    as the summary, `stats` and the schema say; a manifest as builds wrote it before (totals.rejected = the lines, no
    reject_lines) still gives 0 rejected records, with no mismatch warned."""
    seeact = REAL / "seeact.jsonl"
    if not seeact.is_file():
        pytest.skip(f"real traces not found under {REAL} (VLMPREP_REAL_TRACES names another place)")
    out = tmp_path / "ds"
    res = build(_cfg(seeact, out, processor="tiny:qwen2.5-vl", min_turn_coverage=0))
    t, lines = res.manifest.totals, (out / "rejects.jsonl").read_text().splitlines()
    assert (t["records"], t["samples"], t["rejected"], t["reject_lines"], len(lines)) == (3, 2, 0, 4, 4), t
    assert res.manifest.rejects == {"turn_too_long": 4} and rejected_records(res.manifest) == 0
    assert "rejected          0 of 3 records (0.0%) -> rejects.jsonl" in format_build_summary(res.manifest, out)
    st = compute_stats(out)
    assert st["rejected_records"] == 0 and st["inputs"][0]["rejected"] == 0 and st["mismatches"] == [], st
    assert "rejected           0 of 3 records" in format_stats(st)
    schema = json.loads((ROOT / "schemas" / "manifest.schema.json").read_text())["properties"]["totals"]
    assert schema["properties"]["rejected"]["description"].startswith("records rejected whole, each once")
    assert "lines of rejects.jsonl" in schema["properties"]["reject_lines"]["description"]

    raw = json.loads((out / "manifest.json").read_text())  # as a build before this one wrote it
    for totals in (raw["totals"], raw["inputs"][0]["totals"]):
        totals["rejected"] = totals.pop("reject_lines")
    (out / "manifest.json").write_text(json.dumps(raw))
    old = load_manifest(out)
    assert old.totals["rejected"] == 4 and rejected_records(old) == 0
    assert "rejected          0 of 3 records" in format_build_summary(old, out)
    st = compute_stats(out)
    assert st["inputs"][0]["rejected"] == 0 and st["mismatches"] == [], st
    raw["totals"]["reject_lines"] = 4  # a reader that takes it for the new counting sees the lie
    (out / "manifest.json").write_text(json.dumps(raw))
    assert compute_stats(out)["mismatches"] == ["manifest totals.rejected=4 but the rejects give 0"]


def test_a_duplicate_across_tasks_is_one_rejected_record_and_its_lost_turn_lines_go(tmp_path):
    """Two records with id "a" in two tasks, each losing its middle turn to --seq-len: the merge rejects the second
    once (duplicate_id) and takes its turn_too_long line out. totals.rejected counts that one record, reject_lines the
    lines rejects.jsonl then holds (the first one's lost turn and the duplicate), and the input's totals agree."""

    def turn(i, n):
        return [{"role": "user", "content": f"q{i} " + "x " * n}, {"role": "assistant", "content": f"a{i}"}]

    long = turn(0, 5) + turn(1, 300) + turn(2, 5)
    recs = [{"id": "a", "messages": long}, {"id": "b", "messages": turn(3, 5)}, {"id": "a", "messages": long}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    kw = dict(processor="tiny:qwen2-vl", seq_len=256, tasks=2, max_reject_fraction=1, min_turn_coverage=0)
    res = build(_cfg(inp, tmp_path / "ds", **kw))
    lines = [json.loads(x) for x in (tmp_path / "ds" / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["reason"], r["source"]["line"]) for r in lines) == [("duplicate_id", 3), ("turn_too_long", 1)]
    t = res.manifest.totals
    assert (t["records"], t["rejected"], t["reject_lines"]) == (3, 1, 2), t
    by_input = res.manifest.inputs[0].totals
    assert (by_input["rejected"], by_input["reject_lines"]) == (1, 2)
    assert res.manifest.turns["lost"] == {
        "not_trained_by_policy": 0,
        "record_rejected": 3,
        "truncated": 0,
        "turn_too_long": 1,
    }
    assert "rejected          1 of 3 records (33.3%) -> rejects.jsonl" in format_build_summary(
        res.manifest, tmp_path / "ds"
    )


SHAREGPT = {"conversations": [{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "red"}]}
OPENAI = {
    "messages": [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "IMG"}}, {"type": "text", "text": "?"}],
        },
        {"role": "ASSISTANT", "content": "red"},
    ]
}


@pytest.mark.parametrize("layout", ["sharegpt", "openai"])
def test_every_rejected_records_turns_count_as_lost_whatever_the_stage(layout, tmp_path):
    """Records rejected while their images are fetched (normalize: image_not_found), at render (an image too small
    for the processor), for their id (invalid_id, before normalize), and for a line that is not UTF-8: each one's
    assistant turn is lost, in ShareGPT's layout (`from: gpt`) as in OpenAI's (any case of role). Before, a record
    rejected before it normalized counted only `messages` with role exactly "assistant": a ShareGPT build with 2 of 4
    records rejected for missing images said "2 of 2 trained, 100%"."""
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 10, 10)).save(tmp_path / "ok.png")
    Image.new("RGB", (4, 4), (200, 10, 10)).save(tmp_path / "tiny.png")

    def record(i, image, **extra):
        if layout == "sharegpt":
            return {"id": f"r{i}", **SHAREGPT, "images": [image], **extra}
        rec = json.loads(json.dumps(OPENAI).replace("IMG", image))
        return {"id": f"r{i}", **rec, **extra}

    lines = [json.dumps(record(0, "ok.png")), json.dumps(record(1, "missing.png"))]
    lines += [json.dumps(record(2, "ok.png")), json.dumps(record(3, "tiny.png"))]
    lines += [json.dumps({**record(4, "ok.png"), "id": True})]  # invalid_id
    lines += [json.dumps(record(5, "ok.png")).replace("what?", "what\xff?").replace('"?"', '"\xff?"')]
    (tmp_path / "in.jsonl").write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    res = build(
        _cfg(
            tmp_path / "in.jsonl",
            tmp_path / "ds",
            processor="tiny:qwen2-vl",
            min_image_side=8,
            max_reject_fraction=1,
            min_turn_coverage=0,
        )
    )
    reasons = sorted(json.loads(x)["reason"] for x in (tmp_path / "ds" / "rejects.jsonl").read_text().splitlines())
    assert reasons == ["image_not_found", "image_too_small", "invalid_id", "invalid_utf8"], reasons
    turns = res.manifest.turns
    assert (turns["input_assistant_turns"], turns["trained_assistant_turns"]) == (6, 2), turns
    assert turns["lost"]["record_rejected"] == 4 and res.manifest.totals["rejected"] == 4
    assert "2 of 6 trained (coverage 33.3%; lost: record_rejected 4)" in format_build_summary(
        res.manifest, tmp_path / "ds"
    )
