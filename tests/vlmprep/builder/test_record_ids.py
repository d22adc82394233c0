"""A record whose id an earlier record used is a duplicate_id reject whether or not either is split into step samples
(`a#0`, `a#1`, ... under --long-traces split) : the check is by record id (and sample id), within a task, across
tasks (merge) and across versions (the id files), and inspect's raw mode says what build would."""

import json
from pathlib import Path

import pytest

from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig, InspectConfig
from vlmprep.shards.manifest import open_dataset, shard_paths
from vlmprep.shards.reader import iter_shard
from vlmprep.shards.rejects_file import iter_rejects
from vlmprep.tools.verify import verify_dataset

# seq_len 400 splits a 4-turn record of these into 3 step samples and keeps a 1-turn one whole
OPTS = dict(
    processor="tiny:qwen2-vl",
    seq_len=400,
    long_traces="split",
    progress=False,
    min_turn_coverage=0.0,
    max_reject_fraction=1.0,
)


def record(rid: str, turns: int) -> dict:
    msgs = []
    for k in range(turns):
        msgs += [
            {"role": "user", "content": f"question {k} " + "word " * 15},
            {"role": "assistant", "content": f"answer {k} " + "reply " * 15},
        ]
    return {"id": rid, "messages": msgs}


def write(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def landed(ref) -> list[str]:
    d, m = open_dataset(ref)
    return [s.meta()["id"] for p in shard_paths(d, m) for s in iter_shard(p, version=m.format_version)]


def cfg(inputs, out, **kw) -> BuildConfig:
    return BuildConfig(inputs=tuple(map(str, inputs)), out=str(out), **{**OPTS, **kw})


SPLIT, WHOLE = record("a", 4), record("a", 1)


@pytest.mark.parametrize("first,second", [(SPLIT, WHOLE), (WHOLE, SPLIT)], ids=["split-first", "whole-first"])
def test_a_repeated_record_id_is_a_duplicate_within_a_task(tmp_path, first, second):
    res = build(cfg([write(tmp_path / "in.jsonl", first, second)], tmp_path / "ds"))
    ids = landed(tmp_path / "ds")
    assert ids == (["a#0", "a#1", "a#2"] if first is SPLIT else ["a"]), ids
    assert res.manifest.rejects == {"duplicate_id": 1} and res.manifest.totals["records"] == 2
    [line] = list(iter_rejects(tmp_path / "ds" / "rejects.jsonl"))
    assert (line["reason"], line["id"], line["source"]["line"]) == ("duplicate_id", "a", 2)
    assert not verify_dataset(tmp_path / "ds")


@pytest.mark.parametrize("first,second", [(SPLIT, WHOLE), (WHOLE, SPLIT)], ids=["split-first", "whole-first"])
def test_a_repeated_record_id_is_a_duplicate_across_tasks(tmp_path, first, second):
    files = [write(tmp_path / "0.jsonl", first), write(tmp_path / "1.jsonl", second)]
    res = build(cfg(files, tmp_path / "ds", tasks=2))
    assert res.plan.tasks == 2 and res.manifest.rejects == {"duplicate_id": 1}
    assert landed(tmp_path / "ds") == (["a#0", "a#1", "a#2"] if first is SPLIT else ["a"])
    assert not verify_dataset(tmp_path / "ds")


@pytest.mark.parametrize("first,second", [(SPLIT, WHOLE), (WHOLE, SPLIT)], ids=["split-first", "whole-first"])
def test_a_repeated_record_id_is_a_duplicate_across_versions(tmp_path, first, second):
    out = tmp_path / "ds"
    build(cfg([write(tmp_path / "0.jsonl", first, record("b", 1))], out))
    res = build(cfg([write(tmp_path / "1.jsonl", second, record("c", 1))], out, append=True))
    assert res.manifest.version["added"]["rejects"] == {"duplicate_id": 1}
    assert [r["id"] for r in iter_rejects(out / "rejects.v000002.jsonl")] == ["a"]
    assert landed(f"{out}@v2") == landed(f"{out}@v1") + ["c"]
    assert not verify_dataset(out)


def test_a_literal_id_that_is_another_records_step_sample_id_stays_a_duplicate(tmp_path):
    """Sample ids stay unique too: a whole record with id `a#1` after `a` split into a#0.. is refused."""
    res = build(cfg([write(tmp_path / "in.jsonl", SPLIT, record("a#1", 1))], tmp_path / "ds"))
    assert res.manifest.rejects == {"duplicate_id": 1} and landed(tmp_path / "ds") == ["a#0", "a#1", "a#2"]


def test_inspect_says_what_build_rejects(tmp_path):
    from vlmprep.tools.inspector import select

    raw = write(tmp_path / "in.jsonl", SPLIT, WHOLE)
    build_options = {k: OPTS[k] for k in ("processor", "seq_len", "long_traces")}
    items, _ = select(InspectConfig(path=str(raw), only="rejected", limit=5, build_options=build_options))
    assert [(r["reason"], r["id"]) for r in items] == [("duplicate_id", "a")]


def test_id_files_written_before_record_ids_were_kept_still_serve_an_append(tmp_path):
    """An id file of sample-id digests alone (as appends wrote it before): read as it is (the count check admits it),
    its sample ids still found; a record id of a split record in it is not (remove it to derive it anew)."""
    from vlmprep.shards.versions import id_digest, ids_bytes
    from vlmprep_schemas.versions import ids_name

    out = tmp_path / "ds"
    build(cfg([write(tmp_path / "0.jsonl", SPLIT, record("b", 1))], out))
    new_style = (out / ids_name(1)).read_bytes()
    assert len(new_style) == 16 * 5  # a#0, a#1, a#2, a, b
    (out / ids_name(1)).write_bytes(ids_bytes(map(id_digest, landed(out))))
    res = build(cfg([write(tmp_path / "1.jsonl", record("b", 1), record("c", 1))], out, append=True))
    assert res.manifest.version["added"]["rejects"] == {"duplicate_id": 1}
    assert landed(out) == ["a#0", "a#1", "a#2", "b", "c"]
    (out / ids_name(1)).unlink()  # derived again from the shards by the next append: record ids too
    build(cfg([write(tmp_path / "2.jsonl", WHOLE)], out, append=True, allow_empty=True))
    assert (out / ids_name(1)).read_bytes() == new_style
    assert [r["id"] for r in iter_rejects(out / "rejects.v000003.jsonl")] == ["a"]
