"""`vlmprep versions`, `vlmprep tag`, `vlmprep gc` (issue 55.5, docs/datasets-that-grow.md) on a local dataset: gc
never removes a file that a kept version or a tag names, and every kept version still verifies (a property test over
random append / tag / gc sequences, and over catalogs whose versions drop shards); a gc cut short at any step leaves
every kept version readable and is finished by running it again; bad input is one line naming the fix with nothing
changed; a tag file that is a link or a FIFO is refused, and a link planted where gc deletes is removed as a link."""

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vlmprep.builder.test_append import cfg, invoke
from vlmprep.builder.catalog import Catalog, CatalogError, DatasetFiles, Record, dataset_files, read_catalog
from vlmprep.builder.pipeline import build
from vlmprep.builder.retention import collect, plan_gc
from vlmprep.shards.manifest import open_dataset
from vlmprep.tools.verify import verify_dataset
from vlmprep_schemas.versions import Tag, tag_file, version_name

VERSIONS = 5
_OF_VERSION = re.compile(r"v([0-9]{6})")


def _batch(path: Path, k: int) -> Path:
    """Three text-only records (ids r<k>-0..2): a build of them takes a second."""
    rows = [
        {
            "id": f"r{k}-{i}",
            "messages": [{"role": "user", "content": f"hi {k} {i}"}, {"role": "assistant", "content": "yo"}],
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """A dataset of VERSIONS versions: a build, then an append a version (3 samples each, 2 a shard)."""
    d = tmp_path_factory.mktemp("full")
    out = d / "ds"
    build(cfg([_batch(d / "b1.jsonl", 1)], out))
    for k in range(2, VERSIONS + 1):
        build(cfg([_batch(d / f"b{k}.jsonl", k)], out, append=True))
    return out


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    """As `full`, but version 1 holds b0 and b1, and version 3 rebuilds b1 (`vlmprep watch --on-change rebuild`: its
    content changed to 2 records) beside b3: it replaces version 1's shards holding b1's samples by its rewrites (the
    one shared with b0 rewritten, the other dropped), while versions 1-2 still name them."""
    d = tmp_path_factory.mktemp("rebuilt")
    out = d / "ds"
    build(cfg([_batch(d / "b0.jsonl", 0), _batch(d / "b1.jsonl", 1)], out))
    for k in range(2, VERSIONS + 1):
        if k == 3:
            b1 = _batch(d / "b1.jsonl", 1)
            b1.write_text("".join(b1.read_text().splitlines(keepends=True)[:2]).replace("hi", "hello"))
        inputs = [d / "b1.jsonl", _batch(d / f"b{k}.jsonl", k)] if k == 3 else [_batch(d / f"b{k}.jsonl", k)]
        build(cfg(inputs, out, append=True), replace=k == 3)
    replaced = json.loads((out / version_name(3)).read_text())["version"]["removed"]["shards"]
    assert sorted(replaced.items()) == [("shard-000001.tar", "shard-v000003-r-000000.tar"), ("shard-000002.tar", None)]
    return out


def _version_of(rel: str) -> int:
    m = _OF_VERSION.search(rel)
    return int(m.group(1)) if m else 1


def _dataset_files(d: Path) -> list[str]:
    skip = ("plan.json", ".vlmprep.lock", "manifest.json")
    return sorted(
        str(p.relative_to(d))
        for p in d.rglob("*")
        if p.is_file() and p.name not in skip and "tasks" not in p.relative_to(d).parts
    )


def grow(work: Path, full: Path, n: int) -> None:
    """Make `work` what an append of version n leaves: version n's own files (copied from `full`, where they are byte
    for byte what the append wrote), then manifest.json = its record. Version 1: the dataset as its build left it."""
    for rel in _dataset_files(full):
        if _version_of(rel) == n:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(full / rel, work / rel)
    shutil.copy2(full / version_name(n), work / "manifest.json")


def digests(d: Path) -> dict[str, str]:
    """sha256 of every file and the target of every link under d (nothing changed = equal)."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file() and p.name != ".vlmprep.lock":
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(r, *want: str) -> str:
    """The command failed with exit 1 and one line holding each of `want`."""
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert all(w in lines[0] for w in want), r.output
    return lines[0]


def check_kept(d: Path, plan, tags: dict[str, int]) -> None:
    """Every version gc kept (and each tagged one) is there whole: each file its record names exists, and it reads."""
    catalog = read_catalog(DatasetFiles(str(d)))
    assert set(catalog.records) == set(plan.kept)
    for tag, n in tags.items():
        assert n in catalog.records and catalog.tags[tag].version == n
    for n, record in catalog.records.items():
        missing = [f for f in record.names() if not (d / f).is_file()]
        assert not missing, f"v{n} lost {missing}"


_OPS = st.lists(
    st.one_of(
        st.just(("append",)),
        st.tuples(st.just("tag"), st.integers(0, VERSIONS - 1)),
        st.tuples(st.just("gc"), st.integers(1, 4), st.booleans()),
    ),
    min_size=3,
    max_size=10,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_gc_never_removes_what_a_kept_version_or_a_tag_names(rebuilt, tmp_path_factory, ops):
    """Random append / tag / gc sequences (version 3 a rebuild that replaced shards of version 1): after each gc the
    versions kept are exactly the --keep newest, the latest and (with --keep-tag) each tagged one; none lost a file;
    tags name kept versions; at the end each verifies."""
    full = rebuilt
    work = tmp_path_factory.mktemp("work") / "ds"
    work.mkdir()
    grow(work, full, 1)
    latest, tags, k = 1, {}, 0
    for op in ops:
        if op[0] == "append" and latest < VERSIONS:
            latest += 1
            grow(work, full, latest)
        elif op[0] == "tag":
            present = sorted(read_catalog(DatasetFiles(str(work))).records)
            n = present[op[1] % len(present)]
            k += 1
            r = invoke("tag", f"{work}@v{n}", f"t{k}")
            assert r.exit_code == 0, r.output
            tags[f"t{k}"] = n
        elif op[0] == "gc":
            _, keep, keep_tag = op
            before = sorted(read_catalog(DatasetFiles(str(work))).records)
            plan = collect(str(work), keep, keep_tags=keep_tag, say=lambda line: None)
            want = set(before[-keep:]) | {latest} | ({n for n in tags.values() if n in before} if keep_tag else set())
            assert set(plan.kept) == want
            tags = {t: n for t, n in tags.items() if n in want}
            check_kept(work, plan, tags)
    for n in sorted(read_catalog(DatasetFiles(str(work))).records):
        assert not verify_dataset(f"{work}@v{n}"), f"v{n}"
    for t in tags:
        assert not verify_dataset(f"{work}@{t}"), t
    assert not verify_dataset(work)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    keep=st.integers(1, VERSIONS + 1),
    keep_tags=st.booleans(),
)
def test_the_plan_never_names_a_kept_file_when_versions_drop_shards(full, data, keep, keep_tags):
    """Versions whose records drop earlier shards (a version that replaces samples): the files gc plans to remove
    are each named by a removed version and by no kept one, and every tagged version is kept (with --keep-tag)."""
    real = read_catalog(DatasetFiles(str(full)))
    pool = [s for s in real.records[VERSIONS].manifest.shards]
    records, tags = {}, {}
    present = sorted(data.draw(st.sets(st.integers(1, VERSIONS), min_size=1)))
    for n in present:
        picked = data.draw(st.lists(st.sampled_from(pool), unique_by=lambda s: s.name, min_size=1))
        manifest = dataclasses.replace(real.records[n].manifest, shards=tuple(picked))
        records[n] = Record(n, f"v{n}".encode(), manifest)
    for k, n in enumerate(data.draw(st.lists(st.sampled_from(present), max_size=3))):
        tags[f"t{k}"] = Tag(f"t{k}", n, records[n].sha256, "now")
    catalog = Catalog(None, records, tags, True)
    plan = plan_gc(catalog, keep, keep_tags=keep_tags)
    kept_names = set().union(*(records[n].names() for n in plan.kept))
    removed_names = set().union(set(), *(records[n].names() for n in plan.removed))
    assert not set(plan.files) & kept_names
    assert set(plan.files) == removed_names - kept_names
    assert max(present) in plan.kept and set(present[-keep:]) <= set(plan.kept)
    assert set(plan.kept) | set(plan.removed) == set(present)
    if keep_tags:
        assert {t.version for t in tags.values()} <= set(plan.kept)
    assert set(plan.tags) == {tag_file(t.tag) for t in tags.values() if t.version in plan.removed}


@pytest.fixture
def ds(full, tmp_path) -> Path:
    """A copy of the full dataset (VERSIONS versions) this test may change."""
    out = tmp_path / "ds"
    shutil.copytree(full, out)
    return out


def test_versions_tag_and_gc_through_the_cli(ds):
    r = invoke("versions", ds)
    assert r.exit_code == 0 and f"{VERSIONS} versions, the latest v{VERSIONS}" in r.output, r.output
    assert re.search(r"^v3 +- +\S+ +\+1 +9 \(\+3\)", r.output, re.M), r.output
    r = invoke("tag", f"{ds}@v2", "first")
    assert r.exit_code == 0 and f"tagged v2 as first: {ds}@first reads it" in r.output, r.output
    assert open_dataset(f"{ds}@first")[1].totals["samples"] == 6
    r = invoke("gc", ds, "--keep", "2", "--dry-run")
    assert r.exit_code == 0 and "would remove v1, v3" in r.output, r.output
    assert (ds / version_name(1)).is_file()
    r = invoke("gc", ds, "--keep", "2")
    assert r.exit_code == 0 and "removed v1, v3 (2 records" in r.output and "v2 (tag first)" in r.output, r.output
    assert not (ds / version_name(1)).exists() and not (ds / "samples.index.npy").exists()
    assert (ds / "shard-000000.tar").is_file() and (ds / "rejects.jsonl").is_file()  # v2.. name it; stats read it
    r = invoke("versions", ds, "--json")
    doc = json.loads(r.output)
    assert doc["removed"] == [1, 3] and [v["version"] for v in doc["versions"]] == [2, 4, 5]
    assert doc["versions"][0]["tags"] == ["first"]
    assert "removed by gc: v1, v3" in invoke("versions", ds).output
    one_line_error(invoke("inspect", f"{ds}@v1"), "no such version (no longer kept there: `vlmprep gc`")
    for n in (2, 4, 5):
        assert not verify_dataset(f"{ds}@v{n}")
    r = invoke("gc", ds, "--keep", "1", "--no-keep-tag")
    assert r.exit_code == 0 and "removed v2, v4" in r.output and "1 tag" in r.output, r.output
    assert not (ds / tag_file("first")).exists() and not verify_dataset(ds)
    r = invoke("tag", ds, "first")
    assert r.exit_code == 0 and "tagged v5 as first" in r.output
    r = invoke("tag", ds, "first", "--delete")
    assert r.exit_code == 0 and "removed tag first (it named v5)" in r.output


@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_gc_cut_short_leaves_kept_versions_readable_and_a_rerun_finishes(ds, monkeypatch, step):
    """gc removes the removed versions' tags, then their files, then their records (the record last, so a version
    half removed is still listed and a rerun finds what is left of it): a fault before any of the three steps leaves
    every kept version verifying, and gc run again ends where an uninterrupted gc ends."""
    clean = ds.parent / "clean"
    shutil.copytree(ds, clean)
    invoke("tag", f"{clean}@v1", "old")
    collect(str(clean), 2, keep_tags=False, say=lambda line: None)
    invoke("tag", f"{ds}@v1", "old")
    real, calls = DatasetFiles.remove, []

    def remove(self, names):
        calls.append(names)
        if len(calls) == step:
            raise KeyboardInterrupt("killed")
        real(self, names)

    monkeypatch.setattr(DatasetFiles, "remove", remove)
    with pytest.raises(KeyboardInterrupt):
        collect(str(ds), 2, keep_tags=False, say=lambda line: None)
    monkeypatch.setattr(DatasetFiles, "remove", real)
    for n in (VERSIONS - 1, VERSIONS):
        assert not verify_dataset(f"{ds}@v{n}")
    assert not verify_dataset(ds)
    collect(str(ds), 2, keep_tags=False, say=lambda line: None)
    assert digests(ds) == digests(clean) | {"plan.json": digests(ds)["plan.json"]}


def test_the_order_of_gc_steps(ds, monkeypatch):
    seen = []
    monkeypatch.setattr(DatasetFiles, "remove", lambda self, names: seen.append(names))
    invoke("tag", f"{ds}@v1", "old")
    plan = collect(str(ds), 3, keep_tags=False, say=lambda line: None)
    assert seen == [plan.tags, plan.files, plan.records] and plan.records == [version_name(1), version_name(2)]
    assert plan.tags == [tag_file("old")] and "samples.index.npy" in plan.files


@pytest.mark.parametrize(
    "args,want",
    [
        (["tag", "{ds}@v9", "x"], ["{ds}@v9: no such version", "vlmprep versions {ds}"]),
        (["tag", "{ds}@nope", "x"], ["nope", "vlmprep versions {ds}"]),
        (["tag", "{ds}@v2", "first"], ["tag 'first' exists (it names v1", "--force"]),
        (["tag", "{ds}", "a/b"], ["a/b"]),
        (["tag", "{ds}", "../up"], ["../up"]),
        (["tag", "{ds}", "a\x1b[2Jb"], ["a\\x1b[2Jb"]),
        (["tag", "{ds}", "v3"], ["v3"]),
        (["tag", "{ds}", ""], ["''"]),
        (["tag", "{ds}", "x" * 65], ["x" * 65]),
        (["tag", "{ds}", "nope", "--delete"], ["no tag 'nope'", "tags first"]),
        (["gc", "{ds}", "--keep", "0"], ["--keep 0", "--keep 1"]),
        (["gc", "{ds}", "--keep", "-3"], ["--keep -3", "--keep 1"]),
        (["gc", "{ds}@v2", "--keep", "1"], ["gc takes the dataset", "vlmprep gc {ds} --keep N"]),
        (["versions", "{ds}@v2"], ["vlmprep versions {ds}"]),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(ds, args, want):
    assert invoke("tag", f"{ds}@v1", "first").exit_code == 0
    before = digests(ds)
    line = one_line_error(invoke(*[a.format(ds=ds) for a in args]), *[w.format(ds=ds) for w in want])
    assert "\x1b" not in line
    assert digests(ds) == before


@pytest.mark.parametrize("what", ["missing", "empty", "file", "bare"])
def test_no_dataset_there_is_one_line_and_nothing_is_written(tmp_path, what):
    d = tmp_path / "d"
    if what == "empty":
        d.mkdir()
    elif what == "file":
        d.write_text("x")
    elif what == "bare":  # a dir of something else
        d.mkdir()
        (d / "notes.txt").write_text("x")
    before = digests(tmp_path)
    for args in (["versions", d], ["tag", d, "x"], ["gc", d, "--keep", "1"]):
        one_line_error(invoke(*args), str(d))
    assert digests(tmp_path) == before  # not even a lock file


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "other-number", "names-outside", "huge"],
)
def test_a_corrupt_version_record_is_refused_before_anything_is_removed(ds, damage):
    rec = ds / version_name(2)
    data = rec.read_bytes()
    if damage == "garbage":
        rec.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        rec.write_bytes(data[: len(data) // 2])
    elif damage == "other-number":
        rec.write_bytes(data.replace(b'"number": 2', b'"number": 3').replace(b'"number":2', b'"number":3'))
    elif damage == "names-outside":
        doc = json.loads(data)
        doc["shards"][0]["name"] = "../outside.tar"
        rec.write_text(json.dumps(doc))
    else:  # sparse: written in no time
        with rec.open("r+b") as f:
            f.truncate(300 << 20)
    before = digests(ds)
    fix = "restore it from a copy"
    for args in (["versions", ds], ["tag", f"{ds}@v3", "x"], ["gc", ds, "--keep", "1"]):
        one_line_error(invoke(*args), version_name(2), fix)
    assert digests(ds) == before


def test_a_tag_file_that_is_a_link_or_a_fifo_is_refused(ds, tmp_path):
    assert invoke("tag", f"{ds}@v2", "good").exit_code == 0
    outside = tmp_path / "outside.json"
    shutil.copy(ds / tag_file("good"), outside)
    (ds / tag_file("good")).unlink()
    os.symlink(outside, ds / tag_file("good"))
    before, out_before = digests(ds), outside.read_bytes()
    for args in (["versions", ds], ["gc", ds, "--keep", "1"], ["tag", ds, "good", "--force"]):
        one_line_error(invoke(*args), "good.json")
    assert digests(ds) == before and outside.read_bytes() == out_before
    (ds / tag_file("good")).unlink()
    os.mkfifo(ds / tag_file("good"))
    before = digests(ds)
    for args in (["versions", ds], ["gc", ds, "--keep", "1"]):
        one_line_error(invoke(*args), "good.json")  # it returns: a FIFO is never opened to wait on
    assert (ds / tag_file("good")).is_fifo() and digests(ds) == before


def test_a_link_planted_where_gc_deletes_is_refused_or_removed_as_a_link(ds, tmp_path):
    """A link at a file gc would remove: gc refuses (one line, nothing removed, the target intact); were it planted
    after the catalog was read, the unlink removes the link, never its target. versions/ swapped for a link to a
    copy outside: refused, nothing removed there or here."""
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.npy").write_bytes(b"mine")
    victim = ds / "samples.index.npy"  # v1's sample index: gc --keep 1 removes it
    victim.unlink()
    os.symlink(outside / "keep.npy", victim)
    before = digests(ds)
    one_line_error(invoke("gc", ds, "--keep", "1"), "samples.index.npy", "a symlink", "nothing was changed")
    assert digests(ds) == before and (outside / "keep.npy").read_bytes() == b"mine"
    files, _ = dataset_files(str(ds))
    files.remove(["samples.index.npy"])
    assert not os.path.lexists(victim) and (outside / "keep.npy").read_bytes() == b"mine"
    copy = tmp_path / "versions-copy"
    shutil.copytree(ds / "versions", copy)
    shutil.rmtree(ds / "versions")
    os.symlink(copy, ds / "versions")
    before, copy_before = digests(ds), digests(copy)
    one_line_error(invoke("gc", ds, "--keep", "1"), "not a plain directory")
    assert digests(ds) == before and digests(copy) == copy_before


def test_remove_refuses_a_dir_link_between_read_and_remove(ds, tmp_path):
    """A versions/ dir swapped for a link after the catalog was read: the unlink goes through no link."""
    files, _ = dataset_files(str(ds))
    copy = tmp_path / "versions-copy"
    shutil.copytree(ds / "versions", copy)
    shutil.rmtree(ds / "versions")
    os.symlink(copy, ds / "versions")
    with pytest.raises(CatalogError, match="not a plain directory"):
        files.remove([version_name(1)])
    assert (copy / Path(version_name(1)).name).is_file()


def test_gc_holds_the_dataset_lock(ds):
    from vlmprep.builder.owner import own_out

    before = digests(ds)
    with own_out(ds):
        one_line_error(invoke("gc", ds, "--keep", "1"), "in use")
        one_line_error(invoke("tag", ds, "x"), "in use")
    assert digests(ds) == before


def test_random_sequences_of_real_gc_keep_the_dataset_consistent(full, tmp_path):
    """A seeded walk (beside the hypothesis one) through the CLI: gc's output names what it kept."""
    rng = random.Random(55)
    work = tmp_path / "ds"
    work.mkdir()
    grow(work, full, 1)
    for n in range(2, VERSIONS + 1):
        grow(work, full, n)
        if rng.random() < 0.5:
            assert invoke("tag", work, f"at{n}").exit_code == 0
        r = invoke("gc", work, "--keep", str(rng.randint(1, 3)))
        assert r.exit_code == 0 and f"v{n} (latest)" in r.output, r.output
    assert not verify_dataset(work)


def test_an_append_after_gc_still_rejects_the_ids_of_removed_versions(ds, tmp_path):
    """gc keeps every version's id file and rejects file: an append after v1..v4 were removed rejects v1's ids as
    duplicates, and stats of the latest still adds up."""
    from vlmprep.tools.stats import compute_stats

    collect(str(ds), 1, say=lambda line: None)
    assert not (ds / version_name(1)).exists() and (ds / "versions" / "v000001.ids").is_file()
    again = _batch(tmp_path / "again.jsonl", 1).read_text().splitlines()  # v1's ids r1-0 .. r1-2
    fresh = _batch(tmp_path / "fresh.jsonl", 9).read_text().splitlines()
    (tmp_path / "mixed.jsonl").write_text("\n".join([again[0], *fresh[:2]]) + "\n")
    res = build(cfg([tmp_path / "mixed.jsonl"], ds, append=True))
    added = res.manifest.version["added"]
    assert res.manifest.version["number"] == VERSIONS + 1 and added["rejects"] == {"duplicate_id": 1}
    assert added["totals"]["samples"] == 2
    assert not verify_dataset(ds) and not compute_stats(ds)["mismatches"]
