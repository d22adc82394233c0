"""The version reference parser shared by vlmprep and the trainer (schemas/versions.py, `vlmprep_schemas.versions`):
DIR@vN / DIR@TAG / DIR for local paths and dataset URLs, a literal path with an '@' in it, bad references in one
line; the resolution of a reference to its record (v1 of a dataset without records is its manifest.json, a tag's
sha256 checked) through a bounded reader that refuses planted links and FIFOs."""

import hashlib
import json
import os

import pytest

from vlmprep_schemas.boundary import UnsafeDataset
from vlmprep_schemas.versions import (
    Tag,
    VersionError,
    check_tag_name,
    ids_name,
    local_reader,
    parse_tag,
    resolve_ref,
    split_ref,
    tag_file,
    version_name,
    version_number,
)


def _never(_):
    return False


@pytest.mark.parametrize(
    "url, want",
    [
        ("ds", ("ds", None)),
        ("ds@v3", ("ds", "v3")),
        ("ds@v003", ("ds", "v003")),
        ("/a/b/ds@release-1.2_x", ("/a/b/ds", "release-1.2_x")),
        ("ds@v3/", ("ds", "v3")),
        ("a@b/ds", ("a@b/ds", None)),  # an '@' before the last '/' is part of the path
        ("a@b/ds@v2", ("a@b/ds", "v2")),
        ("s3://bucket/prefix/ds@v12", ("s3://bucket/prefix/ds", "v12")),
        ("s3://bucket/ds", ("s3://bucket/ds", None)),
        ("s3://bucket@x", ("s3://bucket@x", None)),  # the host part of a URL never holds a reference
        ("http://user@host", ("http://user@host", None)),
        ("hf://datasets/org/name@main/ds@v2", ("hf://datasets/org/name@main/ds", "v2")),
        ("gs://b/ds@nightly", ("gs://b/ds", "nightly")),
    ],
)
def test_split_ref(url, want):
    assert split_ref(url, exists=_never) == want


def test_a_local_path_that_exists_with_an_at_is_taken_literally(tmp_path):
    literal = tmp_path / "data@v2"
    literal.mkdir()
    assert split_ref(str(literal)) == (str(literal), None)
    assert split_ref(str(tmp_path / "data@v3")) == (str(tmp_path / "data"), "v3")  # not there: a reference
    # a URL is never looked up on the local disk
    assert split_ref("s3://b/data@v2", exists=lambda p: True) == ("s3://b/data", "v2")


@pytest.mark.parametrize("url", ["ds@", "ds@v0", "ds@1abc", "ds@-x", "@v2", "ds@a b", "ds@x\x1b[31m", "d/@v1"])
def test_a_bad_reference_is_one_line(url):
    with pytest.raises(VersionError) as e:
        split_ref(url, exists=_never)
    msg = str(e.value)
    assert "\n" not in msg and "\x1b" not in msg
    assert "DIR@v3" in msg or "v1" in msg


def test_names_and_tag_rules():
    assert version_name(1) == "versions/v000001.json" and version_name(123) == "versions/v000123.json"
    assert ids_name(7) == "versions/v000007.ids"
    assert tag_file("release-1") == "versions/tags/release-1.json"
    assert version_number("v0042") == 42 and version_number("nightly") is None
    for bad in ("v7", "1x", "", "a/b", "a" * 65, "..", "x y", None):
        with pytest.raises(VersionError):
            check_tag_name(bad)
    for bad in (0, -1, True, "1"):
        with pytest.raises(VersionError):
            version_name(bad)


def _dataset(tmp_path, *, records=(), manifest_number=None):
    """A dir with manifest.json (a version object where manifest_number > 1) and version records."""
    d = tmp_path / "ds"
    (d / "versions" / "tags").mkdir(parents=True)

    def body(n):
        return {"format_version": 4, "version": {"number": n}} if n > 1 else {"format_version": 4}

    for n in records:
        (d / version_name(n)).write_text(json.dumps(body(n)))
    if manifest_number is not None:
        (d / "manifest.json").write_text(json.dumps(body(manifest_number)))
    return d


def test_resolution_of_versions(tmp_path):
    d = _dataset(tmp_path, records=(1, 2), manifest_number=2)
    read = local_reader(str(d))
    assert resolve_ref("v2", read, where=str(d)).name == "versions/v000002.json"
    assert resolve_ref("v01", read, where=str(d)).number == 1
    assert resolve_ref(None, read, where=str(d)).name == "manifest.json"
    with pytest.raises(VersionError, match=r"@v3: no such version \(the latest is v2; `vlmprep versions"):
        resolve_ref("v3", read, where=str(d))
    # a record that lies about its number
    (d / version_name(2)).write_text(json.dumps({"version": {"number": 5}}))
    with pytest.raises(VersionError, match="claims to be version 5, not 2"):
        resolve_ref("v2", read, where=str(d))


def test_v1_of_a_dataset_without_records_is_its_manifest(tmp_path):
    d = _dataset(tmp_path, manifest_number=1)
    found = resolve_ref("v1", local_reader(str(d)), where=str(d))
    assert found.name == "manifest.json" and found.number == 1
    with pytest.raises(VersionError, match="latest is v1"):
        resolve_ref("v2", local_reader(str(d)), where=str(d))


def test_tags_resolve_and_their_sha256_is_checked(tmp_path):
    d = _dataset(tmp_path, records=(1, 2), manifest_number=2)
    sha = hashlib.sha256((d / version_name(2)).read_bytes()).hexdigest()
    (d / tag_file("good")).write_bytes(Tag("good", 2, sha, "2026-01-01T00:00:00Z").to_bytes())
    read = local_reader(str(d))
    assert resolve_ref("good", read, where=str(d)).number == 2
    with pytest.raises(VersionError, match="no version or tag 'missing'"):
        resolve_ref("missing", read, where=str(d))
    (d / tag_file("stale")).write_bytes(Tag("stale", 2, "0" * 64, "x").to_bytes())
    with pytest.raises(VersionError, match="changed after it was tagged"):
        resolve_ref("stale", read, where=str(d))
    (d / tag_file("other")).write_bytes(Tag("good", 2, sha, "x").to_bytes())
    with pytest.raises(VersionError, match="holds tag 'good', not 'other'"):
        resolve_ref("other", read, where=str(d))
    for bad in (b"[]", b'{"tag": "x", "version": true}', b"{" * 100000, b"\xff"):
        with pytest.raises(VersionError):
            parse_tag(bad, where="t.json")
    assert parse_tag(Tag("a", 1, sha, "t").to_bytes(), where="t") == Tag("a", 1, sha, "t")


def test_the_local_reader_refuses_links_out_fifos_and_oversize(tmp_path):
    d = _dataset(tmp_path, records=(1,), manifest_number=1)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    os.symlink(outside, d / version_name(2))
    read = local_reader(str(d))
    with pytest.raises(UnsafeDataset, match="outside the dataset"):
        read(version_name(2), 1 << 20)
    os.mkfifo(d / version_name(3))
    with pytest.raises(UnsafeDataset, match="not a plain file"):
        read(version_name(3), 1 << 20)  # returns at once: a FIFO is never waited on
    with pytest.raises(ValueError, match="more than a reader accepts"):
        read(version_name(1), 3)
    assert read(version_name(9), 100) is None
    # a versions/ dir planted as a link out of the dataset
    d2 = _dataset(tmp_path / "b", manifest_number=1)
    (d2 / "versions" / "tags").rmdir()
    (d2 / "versions").rmdir()
    os.symlink(tmp_path / "b", d2 / "versions")
    with pytest.raises(UnsafeDataset, match="outside the dataset"):
        resolve_ref("v1", local_reader(str(d2)), where=str(d2))
