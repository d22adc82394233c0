"""`vlmprep watch --on-change rebuild` (issue 55.4; docs/datasets-that-grow.md "Rebuild"): a built object whose content
changed is built again into the next version, which replaces its old samples: the latest version's samples are a fresh
build's of the objects' current content, earlier versions stay byte-identical and verify, totals add up (added less
removed), a rebuilt id is no duplicate_id while a copy of another object's records still is, and a shard of the old
samples that is missing or corrupt is one line with nothing committed."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.support.watching import FLAGS, invoke, land, local_reader, records, watch_args
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.shards.manifest import open_dataset, shard_paths
from vlmprep.shards.reader import iter_shard
from vlmprep_schemas.versions import version_name


def once(inbox, out, *more):
    return invoke(*watch_args(inbox, out, "--once", *more))


def samples(ref) -> dict[str, tuple]:
    """Every sample of a dataset version by id: meta (its key's position aside), token ids, loss mask, pixels."""
    d, m = open_dataset(ref)
    got = {}
    for path in shard_paths(d, m):
        for s in iter_shard(path, version=m.format_version):
            meta = s.meta()
            images = [hashlib.sha256(im.tobytes()).hexdigest() for im in s.images()]
            got[meta["id"]] = (meta, s.array("input_ids").tolist(), s.array("loss_mask").tolist(), images)
    return got


def digests(d: Path, names) -> dict[str, str]:
    return {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in names}


def v1_files(out: Path) -> list[str]:
    m = json.loads((out / version_name(1)).read_text()) if (out / version_name(1)).exists() else None
    m = m or json.loads((out / "manifest.json").read_text())
    names = [s["name"] for s in m["shards"]] + [s["index"]["name"] for s in m["shards"] if s.get("index")]
    return names + ["rejects.jsonl", "samples.index.npy"]


@pytest.fixture
def rebuilt(tmp_path):
    """v1 from objects a (4 records, one with a turn_too_long reject line) and b; then a's content changed (3 records,
    other content, ids o0--000001..3 again), c new, and d a copy of b's bytes under another name; one --on-change
    rebuild cycle -> v2."""
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    a, b = land(inbox, 0, n=4, seed=9), land(inbox, 1)
    res = once(inbox, out)
    assert res.exit_code == 0 and "v1 committed" in res.output, res.output
    v1 = (out / "manifest.json").read_bytes()
    before = digests(out, v1_files(out))
    land(inbox, 0)  # a': 3 records, ids o0--000001..3 again
    c = land(inbox, 2)
    d = inbox / "copy-of-b.jsonl.zst"
    shutil.copyfile(b, d)
    res = once(inbox, out, "--on-change", "rebuild")
    assert res.exit_code == 0, res.output
    return inbox, out, (a, b, c, d), v1, before, res.output


def test_a_changed_object_is_rebuilt_into_a_version_that_replaces_its_samples(rebuilt, tmp_path):
    inbox, out, (a, b, c, d), v1, before, output = rebuilt
    assert f"{a} changed after it was built" in output and "--on-change rebuild" in output, output
    assert "v2 committed: 3 objects (1 rebuilt, 4 samples replaced)" in output, output
    # v2's samples are a fresh build's of a', b, c (d's records are all b's ids: duplicate_id rejects)
    fresh = tmp_path / "fresh"
    opts = dict(zip(FLAGS[::2], FLAGS[1::2]))
    build(
        BuildConfig(
            inputs=(str(a), str(b), str(c)),
            out=str(fresh),
            processor=opts["--processor"],
            seq_len=2048,
            samples_per_shard=2,
            chat_template=opts["--chat-template"],
            max_reject_fraction=1.0,
            min_turn_coverage=0.0,
            progress=False,
        )
    )
    want, got = samples(fresh), samples(f"{out}@v2")
    assert sorted(got) == sorted(want) and len(got) == 9
    for k in want:
        assert got[k] == want[k], k
    assert len(samples(f"{out}@v1")) == 7  # v1 as it was: a's old samples and b's
    # v1 byte-identical, both versions verify
    assert (out / version_name(1)).read_bytes() == v1
    assert digests(out, before) == before
    for n in (1, 2):
        res = invoke("verify", f"{out}@v{n}")
        assert res.exit_code == 0, res.output
    recs = records(local_reader(out))
    v2 = recs[1]
    removed = v2["version"]["removed"]
    assert [i["path"] for i in removed["inputs"]] == [str(a)]
    assert [i["path"] for i in v2["version"]["added"]["inputs"]] == sorted(map(str, (a, c, d)))
    assert [i["path"] for i in v2["inputs"]] == [str(a), str(b), str(d), str(c)]  # a at its place, its new stamp
    assert v2["inputs"][0]["bytes"] == a.stat().st_size
    # every rewrite replaces a v1 shard at its place; v1's other shards stay named
    names = [s["name"] for s in v2["shards"]]
    for old, new in removed["shards"].items():
        assert old not in names and (new is None or new.startswith("shard-v000002-r-"))
    # totals add up: v1's + added - removed
    for key, value in v2["totals"].items():
        want_v = recs[0]["totals"].get(key, 0) + v2["version"]["added"]["totals"].get(key, 0)
        assert value == want_v - removed["totals"].get(key, 0), key
    assert v2["totals"]["samples"] == 9 and v2["totals"]["records"] == 4 * 3
    # a rebuilt id is no duplicate_id; d's copies of b's ids are
    dups = [json.loads(line) for line in (out / "rejects.v000002.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in dups if r["reason"] == "duplicate_id") == [f"o1--{i:06d}" for i in (1, 2, 3)]
    assert {r["source"]["file"] for r in dups if r["reason"] == "duplicate_id"} == {str(d)}
    fresh_rejects = (fresh / "rejects.jsonl").read_text().splitlines()  # a's own rejects, as a fresh build has them
    assert [line for line in map(json.loads, fresh_rejects) if line["source"]["file"] == str(a)] == [
        r for r in dups if r["source"]["file"] == str(a)
    ]
    # stats --since v1 says what v2 did per source file
    res = invoke("stats", f"{out}@v2", "--since", "v1", "--json")
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert st["samples"] == 6 and st["version"] == 2 and st["since"] == 1
    assert {i["path"] for i in st["inputs"]} == {str(a), str(c), str(d)}
    # stats of v2 (and its reject table) hold a's rejects as a fresh build has them: v1's lines of a are not v2's
    assert any(
        json.loads(line)["source"]["file"] == str(a) for line in (out / "rejects.jsonl").read_text().splitlines()
    )
    res, fresh_st = invoke("stats", f"{out}@v2", "--json"), invoke("stats", fresh, "--json")
    by_path = {i["path"]: i for i in json.loads(res.output)["inputs"]}
    for i in json.loads(fresh_st.output)["inputs"]:
        assert {k: v for k, v in by_path[i["path"]].items() if k != "name"} == {
            k: v for k, v in i.items() if k != "name"
        }
    assert json.loads(res.output)["rejects"] == {"duplicate_id": 3, **json.loads(fresh_st.output)["rejects"]}
    # nothing left to do: the next cycle builds nothing
    res = once(inbox, out, "--on-change", "rebuild")
    assert res.exit_code == 0 and "nothing new; latest v2" in res.output, res.output


def test_a_changed_object_whose_old_shard_is_missing_or_corrupt_is_one_line_and_nothing_committed(tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    land(inbox, 0)
    land(inbox, 1)
    assert once(inbox, out).exit_code == 0
    land(inbox, 0, n=4, seed=9)
    shard = out / json.loads((out / "manifest.json").read_text())["shards"][0]["name"]
    kept = shard.read_bytes()
    for harm in ("corrupt", "missing"):
        if harm == "corrupt":
            shard.write_bytes(kept[:1000] + bytes(24) + kept[1024:])  # the same size, other bytes
        else:
            shard.unlink()
        res = once(inbox, out, "--on-change", "rebuild")
        assert res.exit_code == 1, res.output
        lines = res.output.strip().splitlines()
        assert lines[-1].startswith(f"error: {shard}: missing or not the shard its version record lists"), lines
        assert "Traceback" not in res.output
        assert not (out / version_name(2)).exists() and json.loads((out / "manifest.json").read_text())
    shard.write_bytes(kept)  # restored: the next cycle resumes the attempt (its tasks were done) and commits
    res = once(inbox, out, "--on-change", "rebuild")
    assert res.exit_code == 0 and "v2 resumed and committed" in res.output, res.output
    assert invoke("verify", f"{out}@v2").exit_code == 0


def test_a_hostile_rejects_line_of_a_changed_object_is_one_line_and_nothing_committed(tmp_path):
    """The replaced input's rejects are read as stats reads them: a line nested 100,000 deep is one line naming the
    file and line, never a RecursionError, and nothing is committed."""
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    land(inbox, 0)
    assert once(inbox, out).exit_code == 0
    land(inbox, 0, n=4, seed=9)
    (out / "rejects.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    res = once(inbox, out, "--on-change", "rebuild")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "rejects.jsonl line 1" in res.output.strip().splitlines()[-1], res.output
    assert not (out / version_name(2)).exists()


@pytest.mark.parametrize("harm", ["cut", "unsorted", "missing"])
def test_a_damaged_removed_ids_file_is_one_line_naming_it(tmp_path, harm):
    """A version's removed ids are read as its ids are (whole sorted digests, bounded): one cut short or out of order
    stops the next cycle in one line naming it, never a numpy error, and nothing is committed. One missing where the
    version's record says it removed samples (a copy that left it behind) too: read as none removed, their ids would
    make an appended record of one a false duplicate_id reject."""
    inbox, out = tmp_path / "inbox", tmp_path / "ds"
    land(inbox, 0)
    land(inbox, 1)
    assert once(inbox, out).exit_code == 0
    land(inbox, 0, n=4, seed=9)
    assert once(inbox, out, "--on-change", "rebuild").exit_code == 0
    removed = out / "versions" / "v000002.removed.ids"
    data = removed.read_bytes()
    assert len(data) >= 32
    if harm == "missing":
        removed.unlink()
    else:
        removed.write_bytes(data[:-1] if harm == "cut" else data[16:32] + data[:16] + data[32:])
    land(inbox, 2)
    res = once(inbox, out)
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    want = " is missing, but version 2 removed" if harm == "missing" else ": not sorted whole 16-byte digests"
    assert f"{removed}{want}" in res.output.strip().splitlines()[-1], res.output
    assert not (out / version_name(3)).exists()
