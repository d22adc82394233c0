"""A dataset from someone else is untrusted input (issue 32): a member that claims more than it holds (an image that
inflates to gigabytes, a .npy header declaring terabytes, a meta json nested 200,000 deep, a sparse tar member) ends
in one line naming the shard and sample in every reader (verify, inspect, stats, the trainer's stream and indexed
readers, the webdataset / HF datasets / energon adapters and the Collator), under an address-space limit of 1 GiB
above what the process already holds: each is refused from headers and the meta, before memory is allocated.

Then a fuzz of the same readers: generated hostile shards and manifests (member names, tar header types, sparse
members, byte contents, truncation, .npy headers, zstd and image headers, meta json types and depth, manifest fields)
end in a one-line refusal (verify: one line per violation) or a full read, never a traceback, and no reader opens a
file outside the dataset. `make test` runs 30 generated cases, `make test-all` (the thorough profile) 1,000. Names a
manifest gives (shard names, the processor dir) are left to the dataset boundary's own tests.
"""

import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import vlmprep_schemas
from tests.support.hostile import (
    INDEX_READER,
    READERS,
    address_space,
    black_pdelta,
    cli,
    copy_dataset,
    deep_json,
    every_reader,
    forge,
    image_spec,
    jpeg_claiming,
    npy,
    npy_claiming,
    one_line_refusal,
    patch_members,
    png_claiming,
    read_members,
    replace_member,
    reseal,
    run_reader,
    seal_indexes,
    small_dataset,
    write_tar,
    zstd_claiming,
)

SHARD = "shard-000000.tar"
# Readers that never decode image members (inspect shows them collapsed, stats counts arrays): they need not refuse
# a hostile image member, but must not crash on it either.
NO_IMAGE_DECODE = ("inspect", "stats")
# webdataset's and energon's own tar readers hand vlmprep a member's bytes: a sparse member is expanded by them,
# before vlmprep's decode is called (docs/other-libraries.md), so the sparse case runs without them.
OWN_TAR_READER = ("wds", "energon", "collator")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def spec(dataset):
    return image_spec(dataset)


@pytest.fixture(scope="module")
def collator(dataset):
    """The dataset's Collator, its processor and the client libraries loaded before any limit applies."""
    import megatron.energon  # noqa: F401
    import webdataset  # noqa: F401

    from vlmprep.clients.collate import Collator

    c = Collator(dataset)
    assert c.processor is not None  # loaded now
    return c


@pytest.fixture(scope="module")
def key(dataset):
    """The key of the sample with the image and the video."""
    from vlmprep.shards.reader import iter_dataset

    key = next(s.key for s in iter_dataset(dataset) if s.meta()["id"] == "iv")
    assert key == K
    return key


class Members(list):
    """The clean shard's members; a short repr, as hypothesis prints a failing case's arguments."""

    def __repr__(self) -> str:
        return f"<{len(self)} members of {SHARD}>"


@pytest.fixture(scope="module")
def clean(dataset):
    return Members(read_members(dataset / SHARD))


@pytest.fixture(scope="module")
def clean_pdelta(pdelta_dataset):
    return Members(read_members(pdelta_dataset / SHARD))


def test_the_clean_dataset_reads_in_every_reader_under_the_limit(dataset, spec, collator):
    """The limit and the checks leave a dataset vlmprep built alone: every reader reads both samples."""
    for o in every_reader(dataset, spec=spec, collator=collator):
        assert o.ok and not o.crash, (o.reader, o.message, o.crash[-2000:])
        assert o.samples is None or sorted(map(str, o.samples)) == ["iv", "t"], (o.reader, o.samples)


def _meta_edit(key, edit):
    def apply(members):
        meta = json.loads(dict(members)[f"{key}.json"])
        edit(meta)
        return replace_member(members, key, "json", json.dumps(meta).encode())

    return apply


def _chain(*edits):
    def apply(members):
        for edit in edits:
            members = edit(members)
        return members

    return apply


def _rename_image(key, new_ext):
    def edit(meta):
        meta["images"][0]["member"] = f"img000.{new_ext}"

    return _meta_edit(key, edit)


CASES = {
    # A small zstd image member whose frame declares 8 GiB (the meta still says 224x160).
    "inflating_zstd_image": lambda key: lambda ms: replace_member(ms, key, "img000.npy.zst", zstd_claiming(8 << 30)),
    # The same as the default's zstd-delta member (.delta.zst, its meta renamed with it).
    "inflating_delta_image": lambda key: _chain(
        lambda ms: replace_member(ms, key, "img000.npy.zst", zstd_claiming(8 << 30), rename="img000.delta.zst"),
        _rename_image(key, "delta.zst"),
    ),
    # A PNG header claiming 40000x40000 (4.8 GB decoded) for a 16x12-patch grid, the meta unchanged but its member.
    "inflating_png_image": lambda key: _chain(
        lambda ms: replace_member(ms, key, "img000.npy.zst", png_claiming(40000, 40000), rename="img000.png"),
        _rename_image(key, "png"),
    ),
    # The same PNG with the meta agreeing on 40000x40000: over the readers' image limit.
    "inflating_png_image_and_meta": lambda key: _chain(
        lambda ms: replace_member(ms, key, "img000.npy.zst", png_claiming(40000, 40000), rename="img000.png"),
        _rename_image(key, "png"),
        _meta_edit(key, lambda m: m["images"][0].update(height=40000, width=40000)),
    ),
    # A video frame whose zstd frame declares 8 GiB.
    "inflating_video_frame": lambda key: (
        lambda ms: replace_member(ms, key, "vid000.0000.npy.zst", zstd_claiming(8 << 30))
    ),
    # loss_mask.npy (read by every reader, stats included) declaring 10**12 entries: a terabyte.
    "huge_npy_shape": lambda key: lambda ms: replace_member(ms, key, "loss_mask.npy", npy_claiming((10**12,), "|u1")),
    # The meta json nested 200,000 deep.
    "deep_meta_json": lambda key: lambda ms: replace_member(ms, key, "json", deep_json(200_000)),
    # An image member dropped, its meta still naming it (stats once took its size unchecked: a KeyError).
    "missing_image_member": lambda key: lambda ms: [(n, d) for n, d in ms if n != f"{key}.img000.npy.zst"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_member_ends_in_one_line_in_every_reader(case, dataset, spec, collator, key, tmp_path):
    d = forge(dataset, tmp_path / "d", CASES[case](key))
    image_case = "image" in case or "frame" in case
    for o in every_reader(d, spec=spec, collator=collator):
        if image_case and o.reader in NO_IMAGE_DECODE and o.ok:
            assert not o.crash, o.crash
            continue
        one_line_refusal(o, SHARD, key)


@pytest.fixture(scope="module")
def pdelta_dataset(tmp_path_factory):
    """The small dataset with two images of one size in its first sample, stored zstd-pdelta: img001 is compressed
    against img000's payload, as its meta's prefix says."""
    d = small_dataset(tmp_path_factory.mktemp("hostile-pdelta"), images=2, image_format="zstd-pdelta")
    meta = json.loads(dict(read_members(d / SHARD))[f"{K}.json"])
    assert [im.get("prefix") for im in meta["images"]] == [None, "img000.pdelta.zst"]
    return d


def _set_prefix(key, prefix):
    def edit(meta):
        if prefix is None:
            del meta["images"][1]["prefix"]
        else:
            meta["images"][1]["prefix"] = prefix

    return _meta_edit(key, edit)


PDELTA_CASES = {
    # The dependent member's frame declares 8 GiB.
    "inflating_pdelta_image": lambda key: (
        lambda ms: replace_member(ms, key, "img001.pdelta.zst", zstd_claiming(8 << 30))
    ),
    # Its prefix inflating: refused before the member that needs it is decompressed.
    "inflating_prefix_image": lambda key: (
        lambda ms: replace_member(ms, key, "img000.pdelta.zst", zstd_claiming(8 << 30))
    ),
    # A prefix that is not the previous image (a member the sample does not hold).
    "prefix_not_the_previous_image": lambda key: _set_prefix(key, "img007.pdelta.zst"),
    # The prefix taken away: the member decompressed without its dictionary is corrupt data.
    "prefix_dropped": lambda key: _set_prefix(key, None),
    # The prefix's meta size changed (a reader checks the size, or the grid it makes, before decoding).
    "prefix_of_another_size": lambda key: _meta_edit(key, lambda m: m["images"][0].update(height=28, width=28)),
    # Both images legal black 16000x16000 members (768 MB each decoded, under the image limit), the meta agreeing,
    # under the sample's 16x12 grid: refused from the meta and the grid, unread (issue 44.7: the clients and the
    # Collator decoded them, a MemoryError).
    "oversized_prefixes": lambda key: _chain(
        lambda ms: replace_member(
            replace_member(ms, key, "img000.pdelta.zst", black_pdelta(16000, 16000)),
            key,
            "img001.pdelta.zst",
            black_pdelta(16000, 16000),
        ),
        _meta_edit(key, lambda m: [im.update(height=16000, width=16000) for im in m["images"]]),
    ),
}


@pytest.mark.parametrize("case", list(PDELTA_CASES))
def test_a_hostile_pdelta_member_ends_in_one_line_in_every_reader(case, pdelta_dataset, spec, collator, tmp_path):
    """A .pdelta.zst member (format v4) depends on its sample's previous image: an inflating member or prefix, a
    prefix that is not the previous image, none, or one of another size end in one line naming the sample."""
    d = forge(pdelta_dataset, tmp_path / "d", PDELTA_CASES[case](K))
    for o in every_reader(d, spec=spec, collator=collator):
        if o.reader in NO_IMAGE_DECODE and o.ok:
            assert not o.crash, o.crash
            continue
        one_line_refusal(o, SHARD, K)


@pytest.fixture(scope="module")
def photo_dataset(tmp_path_factory):
    """The small dataset with a JPEG photo in its first sample, stored as its bytes (`orig.jpg`) by the default
    --image-format auto, its sha256 and source size in the meta."""
    d = small_dataset(tmp_path_factory.mktemp("hostile-photo"), image_format="auto", photo=True)
    [image] = json.loads(dict(read_members(d / SHARD))[f"{K}.json"])["images"]
    assert image["member"] == "img000.orig.jpg" and "sha256" in image
    return d


def _other_jpeg(members) -> bytes:
    """A valid JPEG of another size (64x48) than the sample's source, in its place."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


ORIGINAL_CASES = {
    # A decompression bomb: the JPEG's header claims 40000x40000 (6.4 GB decoded), a few hundred bytes of scan.
    "jpeg_claiming_40000x40000": lambda ms: replace_member(ms, K, "img000.orig.jpg", jpeg_claiming(40000, 40000)),
    # The source cut in half: its decode runs out of data.
    "truncated_jpeg": lambda ms: replace_member(ms, K, "img000.orig.jpg", dict(ms)[f"{K}.img000.orig.jpg"][:600]),
    # Another, valid JPEG of another size in the source's place (its sha256 is not the meta's either).
    "another_jpeg": lambda ms: replace_member(ms, K, "img000.orig.jpg", _other_jpeg(ms)),
}


def test_the_photo_dataset_reads_in_every_reader(photo_dataset, spec, collator):
    """The default storage of a photo (its bytes) reads in every reader, the Collator resizing it as the trainer."""
    for o in every_reader(photo_dataset, spec=spec, collator=collator):
        assert o.ok and not o.crash, (o.reader, o.message, o.crash[-2000:])


@pytest.mark.parametrize("case", list(ORIGINAL_CASES))
def test_a_hostile_source_image_member_ends_in_one_line_in_every_reader(case, photo_dataset, spec, collator, tmp_path):
    """An `orig.jpg` member (a source stored as its bytes, decoded and resized by the loader): a header claiming a
    decompression bomb, a cut-off file or another, valid image in its place end in one line naming the sample in
    every reader that decodes images (verify: its sha256 against the meta's, in one line), before anything is
    allocated for a size over the reader's image limit; the readers that hand source pixels on (webdataset, HF
    datasets, energon) check its header against the meta's source size."""
    d = forge(photo_dataset, tmp_path / "d", ORIGINAL_CASES[case])
    for o in every_reader(d, spec=spec, collator=collator):
        passes = NO_IMAGE_DECODE
        if o.reader in passes and o.ok:
            assert not o.crash, o.crash
            continue
        one_line_refusal(o, SHARD, K)
        if o.reader == "verify":  # one line for the member, whatever else the forged copy lacks
            assert [ln for ln in o.message.splitlines() if "img000.orig.jpg" in ln and "sha256" in ln], o.message


CHAIN = 999  # the most images a record may hold (img000..img998): the deepest pdelta chain a build writes


@pytest.fixture(scope="module")
def reversed_chain(tmp_path_factory):
    """A sample of 999 distinct 56x56 images stored zstd-pdelta, each compressed against the one before, then its
    occurrences listed last to first (each occurrence's member and prefix moved with it; the tar patched in place,
    so its sample index files still describe it): a legal sample. Returns its dir and the images in member order."""
    import base64

    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.shards.reader import iter_dataset

    tmp = tmp_path_factory.mktemp("chain")
    rng = np.random.default_rng(7)
    parts = []
    for _ in range(CHAIN):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
        parts.append(
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
            }
        )
    record = {
        "id": "chain",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "which?"}, *parts]},
            {"role": "assistant", "content": "the last."},
        ],
    }
    (tmp / "r.jsonl").write_text(json.dumps(record) + "\n")
    d = tmp / "ds"
    build(
        BuildConfig(
            inputs=(str(tmp / "r.jsonl"),),
            out=str(d),
            processor="builtin:qwen2-vl",
            seq_len=8192,
            image_format="zstd-pdelta",
            max_images_per_record=CHAIN,
            progress=False,
        )
    )
    (s,) = iter_dataset(d)
    forward, meta = s.images(), s.meta()
    moved = [{k: im[k] for k in ("member", "prefix") if k in im} for im in meta["images"]]
    for im, m in zip(meta["images"], reversed(moved)):
        im.pop("prefix", None)
        im.update(m)
    patch_members(
        d / SHARD,
        {
            f"{s.key}.json": json.dumps(meta, ensure_ascii=False, sort_keys=True).encode(),
            f"{s.key}.image_index.npy": npy(np.arange(CHAIN, dtype=np.int32)[::-1].copy()),
        },
    )
    reseal(d)
    return d, forward


def test_a_reversed_999_deep_pdelta_chain_decodes_once_per_member_in_every_reader(
    reversed_chain, spec, collator, monkeypatch
):
    """Issue 44.7: occurrences listing a legal pdelta chain last to first made vlmprep's reader decompress
    999 * 1000 / 2 times (verify 296 s on real screenshots, the webdataset client > 300 s). Every reader now reads it
    with one decompression a member (counted in vlmprep's and the trainer's decoders), inspect's lazy views in
    occurrence order included, and each occurrence gets its image."""
    import trainer.data.decode
    import vlmprep.clients.wds
    import vlmprep.shards.decode
    from vlmprep.shards.reader import iter_dataset
    from vlmprep.tools.inspected import sample_from_stored

    d, forward = reversed_chain
    calls = []
    for module in (trainer.data.decode, vlmprep.shards.decode):
        monkeypatch.setattr(
            module, "decompressor", lambda prefix, real=module.decompressor: (calls.append(prefix), real(prefix))[1]
        )
    for reader in ("verify", "trainer-stream", "trainer-indexed", INDEX_READER, "wds", "hf", "energon", "collator"):
        calls.clear()
        o = run_reader(reader, d, spec=spec, collator=collator)
        assert o.ok and not o.crash, (reader, o.message, o.crash[-2000:])
        assert len(calls) == CHAIN, f"{reader}: {len(calls)} decompressions for a chain of {CHAIN}"
    calls.clear()
    (s,) = iter_dataset(d)
    views = [load() for load in sample_from_stored(s).images]  # inspect's views, each decoded as it is shown
    assert len(calls) == CHAIN, f"inspect's views: {len(calls)} decompressions for a chain of {CHAIN}"
    members = {name.partition(".")[2]: data for name, data in read_members(d / SHARD)}
    got = vlmprep.clients.wds.decode({"__key__": s.key, "__url__": str(d / SHARD), **members})["images"]
    assert all(np.array_equal(a, b) for a, b in zip(got, forward[::-1])) and len(got) == CHAIN
    assert all(np.array_equal(a, b) for a, b in zip(views, forward[::-1]))


def test_the_payload_cache_that_makes_a_chain_linear_stays_within_its_limit(reversed_chain):
    """The cache by member that makes any decode order linear is bounded in bytes: with room for 100 payloads, the
    reversed chain decoded occurrence by occurrence (inspect's order) never holds more, and every image is right."""
    from vlmprep.shards.decode import PayloadCache
    from vlmprep.shards.reader import iter_dataset

    d, forward = reversed_chain
    (s,) = iter_dataset(d)
    payload = 56 * 56 * 3 + 128  # the .npy header np.save writes, then the filtered rows
    s._payloads = cache = PayloadCache(limit=100 * payload)
    sizes, peak = s.stored_sizes(), 0
    for k, name in enumerate(s.image_members()):
        assert np.array_equal(s.decode(name, sizes[name]), forward[CHAIN - 1 - k]), k
        peak = max(peak, cache._bytes)
    assert 0 < peak <= cache.limit


def test_the_collator_checks_sizes_against_the_grid_before_its_processor(dataset, collator, key):
    """A sample dict (from any reader) whose image is 16000x16000 under its 16x12 grid: the Collator refuses it in
    one line naming the sample and image from its shape, before its processor converts a pixel (it would take
    gigabytes: a MemoryError under the limit)."""
    import vlmprep.clients.wds

    members = {name.partition(".")[2]: data for name, data in read_members(dataset / SHARD) if name.startswith(key)}
    sample = vlmprep.clients.wds.decode({"__key__": key, "__url__": str(dataset / SHARD), **members})
    sample["images"] = [np.broadcast_to(np.zeros(3, np.uint8), (16000, 16000, 3))]  # no memory behind it
    with address_space(1 << 30), pytest.raises(ValueError) as e:
        collator([sample])
    assert "\n" not in str(e.value) and all(
        w in str(e.value) for w in ("sample iv", "image 0 is 16000x16000", "grid [1, 12, 16]")
    ), str(e.value)


def test_a_sparse_tar_member_is_refused_unread(dataset, spec, collator, key, tmp_path):
    """A GNU sparse member claiming 8 GiB (a hole a reader expanding it fills with zeros) is refused by every reader
    that opens the tar itself."""
    d = forge(dataset, tmp_path / "d", lambda ms: ms, sparse={f"{key}.loss_mask.npy": 8 << 30})
    readers = [r for r in READERS if r not in OWN_TAR_READER]
    for o in every_reader(d, spec=spec, collator=collator, readers=readers):
        one_line_refusal(o, SHARD)


def test_a_hostile_rejects_file_ends_in_one_line(dataset, tmp_path):
    """rejects.jsonl is the dataset's too: a line nested 200,000 deep, or 5 MiB long, is one line from `stats` and
    `inspect --only rejected`."""
    for name, line in (("deep", deep_json(200_000)), ("long", b'"' + b"x" * (5 << 20) + b'"')):
        d = copy_dataset(dataset, tmp_path / name)
        (d / "rejects.jsonl").write_bytes(b'{"reason": "invalid_json"}\n' + line + b"\n")
        for args in (["stats", str(d)], ["inspect", str(d), "--only", "rejected", "--limit", "5"]):
            with address_space(1 << 30):
                ok, output, crash = cli(args)
            assert not ok and not crash, (args, output, crash)
            lines = output.strip().splitlines()
            assert len(lines) == 1 and "rejects.jsonl line 2" in lines[0], (args, output[-2000:])


# The fuzz: a few dozen cases in make test, 1,000 under make test-all's thorough profile.
FUZZ_EXAMPLES = 1000 if settings().max_examples >= 10_000 else 30
FUZZ_READERS = tuple(r for r in READERS if r != "inspect") + (INDEX_READER,)
K, T = "0000000000", "0000000001"  # the sample with an image and a video, the text-only one

# --- what a case may do to the shard and the manifest

NAMES = [
    f"{K}.json",
    f"{K}.img000.npy.zst",
    f"{K}.img000.pdelta.zst",
    f"{K}.img001.pdelta.zst",
    f"{K}.img000.png",
    f"{K}.img001.webp",
    f"{K}.img000.orig.ppm",
    f"{K}.vid000.0000.npy.zst",
    f"{K}.vid000.0009.png",
    f"{K}.vid999.0000.png",
    f"{K}.input_ids.npy",
    f"{K}.evil.pyd",
    f"{K}.x.pth",
    K,
    f"{K}.",
    f"../outside/{K}.json",
    f"/etc/{K}.json",
    f"{K}/x.json",
    f"x/{K}.json",
    f"{T}.json",
    f"{T}.img000.npy.zst",
    "0000000009.json",
    "a.b.json",
    "0000000000_0001.json",
    "__key__.json",
    f"{K}.json/..",
    "",
    ".",
]
names = st.sampled_from(NAMES) | st.text(st.sampled_from("0123456789._/-aimgjsonpyz~"), max_size=24)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 10**9, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
META_PATHS = [
    ("num_tokens",),
    ("num_images",),
    ("id",),
    ("images",),
    ("images", 0),
    ("images", 0, "height"),
    ("images", 0, "width"),
    ("images", 0, "member"),
    ("images", 0, "grid_thw"),
    ("images", 0, "prefix"),
    ("images", 1, "prefix"),
    ("images", 1, "member"),
    ("images", 1, "height"),
    ("videos",),
    ("videos", 0),
    ("videos", 0, "frames"),
    ("videos", 0, "height"),
    ("videos", 0, "width"),
    ("videos", 0, "member"),
    ("source",),
    ("source", "line"),
    ("num_videos",),
    ("image_format",),
    ("messages",),
]
# Values near the real ones (a 224x168 image of 16x12 patches, 4 frames of 392x280), and past every limit.
near_values = st.integers(-3, 5) | st.sampled_from(
    [12, 14, 16, 20, 28, 48, 84, 168, 169, 224, 280, 392, 999, 40000, 2**31, 10**12, 2**63]
)
NPY_DESCR = ["<i4", "|u1", "<i8", "<f4", ">i4", "|O", "<U4", "|V8", "|b1"]
npy_shapes = st.lists(st.integers(0, 3) | st.sampled_from([7, 10**6, 10**12, 2**62, 2**64]), max_size=3)
member_bytes = st.one_of(
    st.binary(max_size=48),
    st.builds(npy_claiming, npy_shapes.map(tuple), st.sampled_from(NPY_DESCR), st.binary(max_size=40)),
    st.builds(zstd_claiming, st.integers(0, 2**40) | st.sampled_from([8 << 30, 0, 1])),
    st.just(zstandard.ZstdCompressor(write_content_size=False).compress(npy(np.zeros((168, 224, 3), np.uint8)))),
    st.builds(png_claiming, st.integers(1, 100_000), st.integers(1, 100_000)),
    st.builds(png_claiming, st.sampled_from([224, 225, 392]), st.sampled_from([168, 167, 280])),
    st.builds(zstd_claiming, st.sampled_from([168 * 224 * 3 + 128, 280 * 392 * 3 + 128])),
    st.builds(black_pdelta, st.sampled_from([168, 169, 16000]), st.sampled_from([224, 16000])),  # legal, any size
    st.builds(deep_json, st.integers(1, 300_000)),
    json_values.map(lambda v: json.dumps(v).encode()),
)
TAR_TYPES = [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE]
# The build's sample index files (format v4 datasets carry both): a case may change their bytes or a row's field.
INDEX_FILES = ["samples.index.npy", f"{SHARD}.index.npy"]
INDEX_FIELDS = ["position", "id", "start", "end", "num_tokens", "num_trainable_tokens"]

ops = st.one_of(
    st.tuples(st.just("rename"), st.integers(0, 99), names),
    st.tuples(st.just("drop"), st.integers(0, 99)),
    st.tuples(st.just("duplicate"), st.integers(0, 99)),
    st.tuples(st.just("bytes"), st.integers(0, 99), member_bytes),
    st.tuples(st.just("truncate"), st.integers(0, 99), st.integers(0, 200)),
    st.tuples(st.just("flip"), st.integers(0, 99), st.integers(0, 10**6)),
    st.tuples(st.just("meta"), st.sampled_from([K, T]), st.sampled_from(META_PATHS), json_values | near_values),
    st.tuples(st.just("array"), st.integers(0, 99), st.integers(0, 10**6), near_values),
    st.tuples(st.just("type"), st.integers(0, 99), st.sampled_from(TAR_TYPES)),
    st.tuples(st.just("sparse"), st.integers(0, 99), st.sampled_from([8 << 30, 1 << 20, 0])),
    st.tuples(
        st.just("manifest"),
        st.sampled_from(
            [
                ("format_version",),
                ("shards", 0, "num_samples"),
                ("shards", 0, "num_tokens"),
                ("shards",),
                ("totals",),
                ("image_format",),
                ("shards", 0, "index", "bytes"),
                ("sample_index", "bytes"),
                ("sample_index",),
                (),
            ]
        ),
        json_values | near_values | st.builds(lambda n: json.loads(deep_json(min(n, 500))), st.integers(1, 500)),
    ),
    st.tuples(st.just("index"), st.sampled_from(INDEX_FILES), st.just("flip"), st.integers(0, 10**4)),
    st.tuples(st.just("index"), st.sampled_from(INDEX_FILES), st.just("truncate"), st.integers(0, 400)),
    st.tuples(st.just("index"), st.sampled_from(INDEX_FILES), st.just("bytes"), member_bytes),
    st.tuples(
        st.just("index"),
        st.sampled_from(INDEX_FILES),
        st.just("row"),
        st.tuples(st.sampled_from(INDEX_FIELDS), st.integers(0, 3), near_values),
    ),
    st.tuples(st.just("deep_manifest"), st.integers(1, 300_000)),
    st.tuples(st.just("unsealed")),
)


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _index_edit(data: bytes, kind: str, arg) -> bytes:
    """A sample index file's bytes after one "index" op: a byte flipped, cut short, replaced, or one row's field set."""
    if kind == "flip" and data:
        at = arg % len(data)
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    if kind == "truncate":
        return data[:arg]
    if kind == "bytes":
        return arg
    try:
        rows = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception:  # noqa: BLE001 - numpy's own header parser (which no reader runs) raises many kinds
        return data
    field, row, value = arg
    if kind != "row" or not rows.shape or not len(rows) or field not in (rows.dtype.names or ()):
        return data
    rows[field][row % len(rows)] = np.array(value).astype(rows.dtype[field])
    return npy(rows)


def apply(members, manifest: dict, case, indexes: dict[str, bytes]) -> tuple[list, dict | bytes, dict, dict, bool]:
    """The members, manifest (a dict, or raw bytes), sparse claims, tar types and whether to reseal after `case`;
    `indexes` (sample index file name -> bytes) is changed in place."""
    members, sparse, types, seal = list(members), {}, {}, True
    for op, *args in case:
        i = args[0] % len(members) if args and isinstance(args[0], int) and members else None
        if op == "rename" and members:
            members[i] = (args[1], members[i][1])
        elif op == "drop" and members:
            del members[i]
        elif op == "duplicate" and members:
            members.insert(i, members[i])
        elif op == "bytes" and members:
            members[i] = (members[i][0], args[1])
        elif op == "truncate" and members:
            members[i] = (members[i][0], members[i][1][: args[1]])
        elif op == "flip" and members and members[i][1]:
            data = bytearray(members[i][1])
            data[args[1] % len(data)] ^= 0xFF
            members[i] = (members[i][0], bytes(data))
        elif op == "meta":
            key, path, value = args
            for k, (name, data) in enumerate(members):
                if name == f"{key}.json":
                    try:
                        meta = json.loads(data)
                        _set(meta, path, value)
                    except (ValueError, KeyError, IndexError, TypeError):
                        continue
                    members[k] = (name, json.dumps(meta).encode())
        elif op == "array" and members and members[i][0].endswith(".npy"):
            try:
                arr = np.load(io.BytesIO(members[i][1]))
            except ValueError:
                continue
            if arr.size:
                arr.flat[args[1] % arr.size] = np.array(args[2]).astype(arr.dtype)
                members[i] = (members[i][0], npy(arr))
        elif op == "type" and members:
            types[members[i][0]] = args[1]
        elif op == "sparse" and members:
            sparse[members[i][0]] = args[1]
        elif op == "manifest" and isinstance(manifest, dict):
            path, value = args
            try:
                if path:
                    _set(manifest, path, value)
                else:
                    manifest = value
            except (KeyError, IndexError, TypeError):
                pass
        elif op == "index" and args[0] in indexes:
            indexes[args[0]] = _index_edit(indexes[args[0]], *args[1:])
        elif op == "deep_manifest":
            manifest = deep_json(args[0])
        elif op == "unsealed":
            seal = False
    return members, manifest, sparse, types, seal


# vlmprep's own schema files (read lazily, once per process, by whichever reader needs one first): not the dataset's.
_OWN_SCHEMAS = os.path.realpath(os.path.dirname(vlmprep_schemas.__file__)) + os.sep


class OpenWatch:
    """An audit hook (installed once per process: hooks cannot be removed) recording every file opened while a case
    runs but the modules Python imports, vlmprep's own schema files and this process's /proc entries."""

    on = False
    opened: list[str] = []

    @classmethod
    def hook(cls, event, args):
        if cls.on and event == "open" and isinstance(args[0], (str, bytes, Path)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if (
                not path.endswith((".py", ".pyc", ".so"))
                and not path.startswith("/proc/self/")
                and not os.path.realpath(path).startswith(_OWN_SCHEMAS)
            ):
                cls.opened.append(path)


sys.addaudithook(OpenWatch.hook)


def _check(o, d: Path) -> None:
    assert not o.crash, f"{o.reader} crashed:\n{o.crash[-4000:]}"
    if o.ok:
        return
    lines = [ln for ln in o.message.splitlines() if ln.strip()]
    assert lines and "Traceback" not in o.message, f"{o.reader}: {o.message[-2000:]!r}"
    if o.reader != "verify":  # verify lists its violations, one line each
        assert len(lines) == 1, f"{o.reader} said more than one line:\n{o.message[-3000:]}"
    if o.reader != "collator":  # it is handed decoded samples: it names its processor and what they store
        assert any(SHARD in ln or "manifest" in ln or str(d) in ln for ln in lines), (
            f"{o.reader} names neither the shard nor the manifest: {o.message[-2000:]}"
        )


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(case=st.lists(ops, min_size=1, max_size=4), source=st.sampled_from(["zstd", "zstd-pdelta"]))
def test_fuzz_every_reader_refuses_a_hostile_shard_in_one_line_or_reads_it(
    dataset, pdelta_dataset, spec, collator, clean, clean_pdelta, source, case
):
    """Generated hostile shards, sample index files and manifests, of a zstd and a zstd-pdelta dataset (format v4:
    a sample whose second image is compressed against its first), through every reader but inspect (its tokenizer
    load per case is slow; the cases above run it): the clients and the Collator, and the trainer from the build's
    sample index files."""
    src, members = (pdelta_dataset, clean_pdelta) if source == "zstd-pdelta" else (dataset, clean)
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        (root / "outside").mkdir()
        (root / "outside" / "secret.json").write_text("{}")
        d = copy_dataset(src, root / "ds", processor=False, indexes=True)
        indexes = {name: (d / name).read_bytes() for name in INDEX_FILES}
        members, manifest, sparse, types, seal = apply(
            members, json.loads((d / "manifest.json").read_text()), case, indexes
        )
        for name, b in indexes.items():
            (d / name).write_bytes(b)
        data = write_tar(d / SHARD, members, sparse=sparse, types=types)
        if (
            seal
            and isinstance(manifest, dict)
            and isinstance(manifest.get("shards"), list)
            and manifest["shards"]
            and isinstance(manifest["shards"][0], dict)
        ):
            manifest["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            seal_indexes(d, manifest)
        (d / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
        readers = [r for r in FUZZ_READERS if not (sparse and r in OWN_TAR_READER)]
        for reader in readers:
            with address_space(1 << 30):
                OpenWatch.on, OpenWatch.opened = True, []
                try:
                    outcome = run_reader(reader, d, spec=spec, collator=collator)
                finally:
                    OpenWatch.on = False
            _check(outcome, d)
            outside = [p for p in OpenWatch.opened if not p.startswith(str(d) + "/")]
            assert not outside, f"{reader} opened files outside the dataset: {outside[:3]}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_json_depth_skips_strings_as_the_parser_does():
    """json_depth counts brackets outside strings in C-speed passes (escaped backslashes and quotes dropped first):
    the same depth as skipping each string with a regex (what it replaced; 0.45 s on a 10^4-shard manifest), for
    strings full of brackets, quotes and backslashes, ASCII-escaped or not."""
    import random
    import re

    from vlmprep_schemas.limits import json_depth

    string = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')

    def by_regex(text: str) -> int:
        depth = best = 0
        for c in re.sub(r"[^\[\]{}]+", "", string.sub("", text)):
            depth += 1 if c in "[{" else -1
            best = max(best, depth)
        return best

    rnd = random.Random(3)

    def value(d: int):
        r = rnd.random()
        if d > 40 or r < 0.3:
            return rnd.choice(['a\\"[{', "\\\\", "x]]}", '"', "\u00e9[\n", 1, None, '\\\\"{', "\\"])
        if r < 0.6:
            return [value(d + 1) for _ in range(rnd.randint(0, 3))]
        return {rnd.choice(["k[", "\\", '"{}']) + str(i): value(d + 1) for i in range(rnd.randint(0, 3))}

    for _ in range(500):
        text = "[" * 70 + json.dumps(value(0), ensure_ascii=rnd.random() < 0.5) + "]" * 70  # past the fast path
        assert json_depth(text) == by_regex(text), text
