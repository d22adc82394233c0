"""A large photo's views (vlmprep_schemas.views): Llama 4 and InternVL datasets built with --image-format auto store a
12 MP photo's canvas and global view beside its JPEG, and the trainer's pixel inputs made from them equal the image
processor's on the raw photos, bit for bit; the views are exact or not stored."""

import base64
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.trainer.conftest import read_all_samples
from tests.trainer.test_vision import _photo_records
from trainer.data.vision import HostPixels, ImageSpec
from trainer.families import BY_NAME
from vlmprep_schemas.views import Packed

# A 12 MP phone photo (4:3, and a portrait one), a tall page, and a small photo that keeps no views.
SIZES = [[(4000, 3000), (400, 300)], [(3024, 4032)], [(1280, 5808)]]


def _records(path) -> list:
    return [np.asarray(im.convert("RGB")) for im in _photo_records(path, SIZES)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    d = tmp_path_factory.mktemp("views")
    return d, _records(d / "photos.jsonl")


def _build(d, name: str, image_format: str = "auto"):
    from trainer.data.processors import load_image_processor_config

    ds = d / f"{name}-{image_format}"
    if not (ds / "manifest.json").exists():  # built once a module: the tests that change it change a copy
        _write(ds, name, image_format, d)
    spec = ImageSpec.from_config(load_image_processor_config(str(ds / "processor")))
    return ds, spec


def _write(ds, name: str, image_format: str, d) -> None:
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    build(
        BuildConfig(
            inputs=(str(d / "photos.jsonl"),),
            out=str(ds),
            processor=f"tiny:{name}",
            image_format=image_format,
            progress=False,
        )
    )


def _pixel_inputs(spec: ImageSpec, name: str, samples) -> dict:
    host = HostPixels(BY_NAME[name], spec.config, math=False)
    per_sample = [  # as collate hands them over
        [Packed(s.images[u], *s.views[u]) if s.views and s.views[u] else s.images[u] for u in s.image_index]
        for s in samples
    ]
    return host(per_sample, np.zeros((len(samples), 1), np.int64), np.zeros((len(samples), 1), np.uint8))


@pytest.mark.parametrize("name", ["llama-4", "internvl"])
def test_a_large_photos_views_give_the_processors_pixel_values_on_the_raw_photos(photos, name):
    """Each 12 MP photo and the tall page keep their JPEG and gain a views member; the small photo none. The host
    path's uint8 pixel_values from the decoded samples equal the image processor's (rescale and normalize off) on
    the raw photos, batch by batch."""
    from transformers import AutoImageProcessor

    from vlmprep.shards.reader import iter_dataset

    d, raw = photos
    ds, spec = _build(d, name)
    metas = [m for s in iter_dataset(ds) for m in s.meta()["images"]]
    assert [m["member"].split(".", 1)[1] for m in metas] == ["orig.jpg"] * 4
    assert [m.get("views", {}).get("member") for m in metas] == ["vws000.delta.zst", None, "vws000.delta.zst"] * 1 + [
        "vws000.delta.zst"
    ]
    samples = read_all_samples(ds, spec)
    assert [bool(v) for s in samples for v in (s.views or [None] * len(s.images))] == [True, False, True, True]
    ours = _pixel_inputs(spec, name, samples)
    ip = AutoImageProcessor.from_pretrained(str(ds / "processor"), local_files_only=True)
    ref = ip([Image.fromarray(r) for r in raw], do_rescale=False, do_normalize=False, return_tensors="pt")
    assert ours["pixel_values"].dtype == torch.uint8 or ours["pixel_values"].dtype == torch.float32
    assert torch.equal(ours["pixel_values"], ref["pixel_values"].float())


def _edit(ds, dst, edit):
    """The dataset copied with its shard's (key, member) -> bytes edited by `edit`, the manifest's bytes and sha256
    fixed (an attacker's dataset), so only the readers stand between the member and the trainer."""
    from tests.trainer.test_safe_reading import _rewrite_shard

    def members(pairs):
        got = dict(pairs)
        edit(got)
        return list(got.items())

    return _rewrite_shard(ds, dst, members)


def _meta_edit(change):
    def edit(members):
        key = next(n.split(".")[0] for n in members if n.endswith(".vws000.delta.zst"))
        meta = json.loads(members[f"{key}.json"])
        change(members, key, meta)
        members[f"{key}.json"] = json.dumps(meta).encode()

    return edit


def _views_of(meta):
    return next(im["views"] for im in meta["images"] if "views" in im)


def _stray(members, key, meta):
    for im in meta["images"]:
        im.pop("views", None)


def _renumbered(members, key, meta):
    _views_of(meta)["member"] = "vws001.delta.zst"
    old, new = f"{key}.vws000.delta.zst", f"{key}.vws001.delta.zst"
    renamed = {(new if n == old else n): data for n, data in members.items()}  # in place: a sample's members adjoin
    members.clear()
    members.update(renamed)


def _lying_size(members, key, meta):
    _views_of(meta)["canvas"][0] -= 8  # the member declares (and holds) more than these sizes pack into


def _tampered(members, key, meta):
    import zstandard

    name = f"{key}.vws000.delta.zst"
    raw = bytearray(zstandard.ZstdDecompressor().decompress(members[name]))
    raw[-1000] ^= 0x40  # one pixel of the global view, the stream still well formed
    members[name] = zstandard.ZstdCompressor().compress(bytes(raw))


HOSTILE = {
    "stray views member": (_stray, "belong to no kept photo"),
    "views of another image": (_renumbered, "not the member vws000.delta.zst of a kept photo"),
    "sizes the member does not hold": (_lying_size, "decompressed bytes"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_views_that_lie_are_one_line_from_the_trainers_reader(photos, tmp_path, case):
    """A views member the meta does not name, one named for another image, or one whose meta sizes it does not hold
    (its zstd frame declares its own): the trainer's decode refuses the sample in one line naming it (DataError),
    before anything is decompressed."""
    from trainer.data.errors import DataError

    d, _ = photos
    ds, spec = _build(d, "llama-4")
    change, words = HOSTILE[case]
    bad = _edit(ds, tmp_path / "bad", _meta_edit(change))
    with pytest.raises(DataError) as e:
        read_all_samples(bad, spec)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_views_on_a_family_that_makes_none_are_refused(photos, tmp_path):
    """A LLaVA-OneVision dataset given a Llama 4 sample's views (its member and meta): its processor makes no views,
    so the trainer refuses the sample rather than hand its processor a packed array."""
    from trainer.data.errors import DataError
    from trainer.data.processors import load_image_processor_config
    from vlmprep.shards.reader import iter_dataset

    d, _ = photos
    llama, _ = _build(d, "llama-4")
    s = next(s for s in iter_dataset(llama) if any("views" in im for im in s.meta()["images"]))
    views = s.read("vws000.delta.zst")
    other, _ = _build(d, "llava-onevision")
    spec = ImageSpec.from_config(load_image_processor_config(str(other / "processor")))

    def plant(members, key, meta):
        im = next(im for im in meta["images"] if im["member"] == "img000.orig.jpg")
        im["views"] = {"member": "vws000.delta.zst", "canvas": [1008, 1344], "global": [336, 336]}
        planted = {}
        for n, data in members.items():  # beside the sample's own members: a sample's members adjoin
            planted[n] = data
            if n == f"{key}.img000.orig.jpg":
                planted[f"{key}.vws000.delta.zst"] = views
        members.clear()
        members.update(planted)

    def edit(members):
        key = next(n.split(".")[0] for n in members if n.endswith(".img000.orig.jpg"))
        meta = json.loads(members[f"{key}.json"])
        plant(members, key, meta)
        members[f"{key}.json"] = json.dumps(meta).encode()

    bad = _edit(other, tmp_path / "bad", edit)
    with pytest.raises(DataError) as e:
        read_all_samples(bad, spec)
    assert "makes none" in str(e.value), str(e.value)


def test_verify_checks_each_views_member_against_the_processors_views_of_its_source(photos, tmp_path):
    """The built dataset verifies; a views member with one pixel changed (a well-formed stream: the trainer would
    train on it) fails verify in one line naming it."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    d, _ = photos
    ds, _ = _build(d, "llama-4")
    ok = CliRunner().invoke(app, ["verify", str(ds)])
    assert ok.exit_code == 0 and "OK" in ok.output, ok.output
    bad = _edit(ds, tmp_path / "bad", _meta_edit(_tampered))
    res = CliRunner().invoke(app, ["verify", str(bad)])
    lines = [ln for ln in res.output.splitlines() if "vws000.delta.zst" in ln]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert "not the views img000.orig.jpg's image processor makes from it" in lines[0], lines[0]


def test_a_views_dataset_reads_in_every_reader(photos):
    """Every reader reads a Llama 4 dataset with views: the trainer's decode loads the views, the others (the
    Collator, webdataset, HF datasets, Energon, verify, stats, inspect) read the source beside them as before."""
    from tests.support.hostile import every_reader
    from vlmprep.clients.collate import Collator

    d, _ = photos
    ds, spec = _build(d, "llama-4")
    for o in every_reader(ds, spec=spec, collator=Collator(ds), extra=4 << 30):
        assert o.ok and not o.crash, (o.reader, o.message, o.crash[-2000:])


def test_a_format_4_dataset_appended_with_large_photos_becomes_format_5_and_reads_whole(photos, tmp_path):
    """A Llama 4 dataset as format 4 wrote it (a small photo: no views) gets an append of the 12 MP photos: the new
    version is format 5, verifies, and the trainer reads every sample, the old ones as before and the new with their
    views."""
    from benchmarks.bench_loader import as_format
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.tools.verify import verify_dataset

    d, _ = photos
    lines = (d / "photos.jsonl").read_text().splitlines()
    (tmp_path / "first.jsonl").write_text(json.dumps({**json.loads(lines[0]), "id": "small"}) + "\n")
    first = json.loads((tmp_path / "first.jsonl").read_text())
    first["messages"][0]["content"] = first["messages"][0]["content"][1:]  # the 400x300 photo and the question
    (tmp_path / "first.jsonl").write_text(json.dumps(first) + "\n")
    (tmp_path / "more.jsonl").write_text("\n".join(lines[1:]) + "\n")

    def cfg(inp, out, **kw):
        return BuildConfig(inputs=(str(inp),), out=str(out), processor="tiny:llama-4", progress=False, **kw)

    build(cfg(tmp_path / "first.jsonl", tmp_path / "v5"))
    old = as_format(tmp_path / "v5", tmp_path / "ds", 4)
    assert json.loads((old / "manifest.json").read_text())["format_version"] == 4
    build(cfg(tmp_path / "more.jsonl", old, append=True))
    assert json.loads((old / "manifest.json").read_text())["format_version"] == 5
    assert verify_dataset(old) == []
    from trainer.data.processors import load_image_processor_config

    spec = ImageSpec.from_config(load_image_processor_config(str(old / "processor")))
    samples = read_all_samples(old, spec)
    assert [s.id for s in samples] == ["small", "r1", "r2"]
    assert [bool(s.views) for s in samples] == [False, True, True]


LARGE = {"llama-4": (3000, 2000), "internvl": (3400, 2400)}  # over 3 source pixels a pixel of the largest canvas


def _large_photo_records(tmp_path, name: str):
    """Record "two" (a large JPEG, then a PNG) and record "one" (the JPEG again) built with tiny:`name` -> the dataset,
    the records, their raw images and its samples; the JPEG stored with views."""
    from tests.trainer.test_family_training import _jpeg, _png_bytes, image_records, shard_samples
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    (u1, i1), (_, i2) = _jpeg(*LARGE[name], 3), _jpeg(900, 700, 4)
    u2 = "data:image/png;base64," + base64.b64encode(_png_bytes(i2)).decode()
    records = list(image_records(u1, u2, u1))
    path = tmp_path / "large.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = tmp_path / "ds"
    build(BuildConfig(inputs=(str(path),), out=str(ds), processor=f"tiny:{name}", progress=False))
    samples = shard_samples(ds)
    views = [im.get("views", {}).get("member") for s in samples for im in s.meta()["images"]]
    assert views == ["vws000.delta.zst", None, "vws000.delta.zst"], views
    return ds, records, [[i1, i2], [i1]], samples


@pytest.mark.parametrize("name", sorted(LARGE))
def test_the_trainers_and_the_collators_inputs_from_views_are_the_processors_on_the_raw_records(name, tmp_path):
    """A large JPEG with views beside a PNG in one sample, and the photo alone: the trainer's forward inputs (its host
    path from the views, the device's rescale and normalize) and the Collator's (from the source) hold, bit for bit,
    every tensor the processor gives on apply_chat_template of the raw records (test_family_training's check)."""
    from tests.trainer.test_family_training import assert_inputs_are_the_processors

    ds, records, images, _ = _large_photo_records(tmp_path, name)
    assert_inputs_are_the_processors(name, ds, records, images, ([0, 1], [1], [0]))


@pytest.mark.slow  # a trainer step with an export and the exported model's forward, per family (~15 s of CPU)
@pytest.mark.parametrize("name", sorted(LARGE))
def test_a_views_dataset_trains_at_the_exported_models_own_loss_on_the_raw_records(name, tmp_path):
    """test_family_training's export parity on a dataset whose large photo is stored with views: one trainer step
    over both records in one micro-batch (the host path reads the views), then the exported model's loss on the
    processor's batch of the raw records equals the step's. (A wrong canvas moves both families' loss past the
    tolerance; a wrong global view moves InternVL's, and Llama 4's by less than 1e-5 in the tiny model, whose global
    tile is one of many: the bit-for-bit input test above covers it there.)"""
    from tests.trainer.test_family_training import own_loss, train_one_step
    from vlmprep.families import FAMILIES as RENDER_FAMILIES

    ds, records, images, samples = _large_photo_records(tmp_path, name)
    row = train_one_step(ds, tmp_path / "run", name, "--micro-batch-size", "2")
    string_content = RENDER_FAMILIES[BY_NAME[name].processor_classes[0]].string_content
    loss, _ = own_loss(tmp_path / "run" / "hf", records, images, samples, string_content)
    assert row["num_samples"] == 2 and row["loss"] == pytest.approx(loss, rel=1e-5), (name, row["loss"], loss)
