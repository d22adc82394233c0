import functools

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import LLAMAFACTORY
from tests.trainer.conftest import read_all_samples
from trainer.data.vision import ImageSpec, Patchifier


@pytest.fixture(scope="module")
def saved_image_processor(dataset):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(dataset / "processor"), local_files_only=True)


def test_spec_reads_the_saved_processor(image_spec):
    assert (image_spec.patch_size, image_spec.temporal_patch_size, image_spec.merge_size) == (14, 2, 2)
    assert image_spec.do_rescale and image_spec.do_normalize


def test_pixel_values_equal_the_processor_output(dataset, image_spec, saved_image_processor):
    samples = read_all_samples(dataset, image_spec)
    images = [im for s in samples for im in s.images][:6]
    rng = np.random.default_rng(0)
    images += [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(56, 56), (84, 140), (28, 308)]]
    ref = saved_image_processor(images=[Image.fromarray(im) for im in images], do_resize=False, return_tensors="pt")
    ours = Patchifier(image_spec, "cpu")([torch.from_numpy(im) for im in images], list(range(len(images))))
    assert ours.dtype == ref["pixel_values"].dtype == torch.float32
    assert ours.shape == ref["pixel_values"].shape
    assert torch.equal(ours, ref["pixel_values"]), float((ours - ref["pixel_values"]).abs().max())
    assert [list(image_spec.grid(*im.shape[:2])) for im in images] == ref["image_grid_thw"].tolist()


def test_grids_from_decoded_pixels_equal_stored_image_grid_thw(dataset, image_spec):
    checked = 0
    for s in read_all_samples(dataset, image_spec):
        grids = [list(image_spec.grid(*s.images[u].shape[:2])) for u in s.image_index]
        assert grids == s.image_grid_thw.tolist(), s.id
        checked += len(grids)
    assert checked > 10


def test_repeated_images_are_patchified_once_and_indexed(image_spec):
    a = torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8)
    b = torch.randint(0, 256, (28, 56, 3), dtype=torch.uint8)
    pf = Patchifier(image_spec, "cpu")
    pa, pb = pf([a], [0]), pf([b], [0])
    assert torch.equal(pf([a, b], [1, 0, 1]), torch.cat([pb, pa, pb]))
    assert pa.shape == (4 * 6, 3 * 2 * 14 * 14)


def test_normalize_only_and_rescale_only_follow_transformers(image_spec, saved_image_processor):
    im = np.random.default_rng(1).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    for flags in (dict(do_rescale=False, do_normalize=True), dict(do_rescale=True, do_normalize=False)):
        spec = ImageSpec.from_config({**image_spec.config, **flags})
        ref = saved_image_processor(images=[Image.fromarray(im)], do_resize=False, return_tensors="pt", **flags)
        assert torch.equal(Patchifier(spec, "cpu")([torch.from_numpy(im)], [0]), ref["pixel_values"]), flags


PHOTO_SIZES = [[(333, 210), (80, 60)], [(700, 455)], [(210, 500)]]


def _photo_records(path, sizes_per_record=PHOTO_SIZES) -> list:
    """Records of JPEG photos, one a list of (width, height) (by default three: one of two, of different sizes; one
    below GLM's minimum, which its processor scales up) -> the raw images in token order, as the processor decodes
    them."""
    import base64
    import io
    import json

    from tests.vlmprep.test_images import photo, save

    raw, records = [], []
    for k, sizes in enumerate(sizes_per_record):
        content = []
        for j, (w, h) in enumerate(sizes):
            data = save(photo(w, h, seed=10 * k + j), "JPEG", quality=90)
            raw.append(Image.open(io.BytesIO(data)))
            uri = "data:image/jpeg;base64," + base64.b64encode(data).decode()
            content.append({"type": "image_url", "image_url": {"url": uri}})
        content.append({"type": "text", "text": "What is in the photo?"})
        records.append({"id": f"r{k}", "messages": [{"role": "user", "content": content}]})
        records[-1]["messages"].append({"role": "assistant", "content": "A gradient."})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return raw


def _built_photos(tmp_path, name: str, image_format: str):
    """The photo records built with tiny:`name` in `image_format` -> the raw photos, the trainer's ImageSpec of the
    dataset, its saved image processor, the decoded samples' unique images and their per-occurrence index."""
    from transformers import AutoImageProcessor

    from trainer.data.processors import (
        load_image_processor_config,
        load_processor_settings,
        load_video_processor_config,
    )
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.shards.reader import iter_dataset

    raw = _photo_records(tmp_path / "photos.jsonl")
    ds = tmp_path / "ds"
    cfg = BuildConfig(
        inputs=(str(tmp_path / "photos.jsonl"),),
        out=str(ds),
        processor=f"tiny:{name}",
        image_format=image_format,
        progress=False,
    )
    build(cfg)
    stored = {m["member"].split(".", 1)[1] for s in iter_dataset(ds) for m in s.meta()["images"]}
    assert stored == ({"orig.jpg"} if image_format == "auto" else {"pdelta.zst"})
    where = str(ds / "processor")
    spec = ImageSpec.from_config(
        load_image_processor_config(where), load_video_processor_config(where), load_processor_settings(where)
    )
    processor = AutoImageProcessor.from_pretrained(where, local_files_only=True)
    samples = read_all_samples(ds, spec)
    images, index = [], []
    for s in samples:
        index += [len(images) + u for u in s.image_index]
        images += [torch.as_tensor(im) for im in s.images]
    return raw, spec, processor, samples, images, index


@pytest.mark.parametrize("image_format", ["auto", "zstd-pdelta"])
def test_glm_pixel_values_made_on_the_device_equal_its_image_processors_on_the_raw_photos(image_format, tmp_path):
    """GLM-4.1V trains with Qwen's device Patchifier: for a dataset built with tiny:glm-4.1v (photos stored as their
    JPEG bytes by the default, resized at load time; or as zstd-pdelta pixels resized at build time), the decoded
    samples patchified on the device give bit for bit the pixel_values and grids that Glm4vImageProcessor itself
    makes from the raw photos (its own resize, rescale, normalize and patch layout)."""
    from trainer.families import BY_NAME

    assert BY_NAME["glm-4.1v"].pixels == "patchify"
    raw, spec, processor, samples, images, index = _built_photos(tmp_path, "glm-4.1v", image_format)
    assert type(processor).__name__ == spec.kind == "Glm4vImageProcessor"
    ref = processor(images=raw, return_tensors="pt")
    ours = Patchifier(spec, "cpu")(images, index)
    assert ours.dtype == ref["pixel_values"].dtype == torch.float32 and ours.shape == ref["pixel_values"].shape
    assert torch.equal(ours, ref["pixel_values"]), float((ours - ref["pixel_values"]).abs().max())
    grids = np.concatenate([s.image_grid_thw for s in samples if len(s.image_grid_thw)])
    assert grids.tolist() == ref["image_grid_thw"].tolist() == [list(spec.grid(*images[u].shape[:2])) for u in index]


@pytest.mark.parametrize("image_format", ["auto", "zstd-pdelta"])
def test_gemma3_pixel_values_normalized_on_the_device_equal_its_image_processors_on_the_raw_photos(
    image_format, tmp_path
):
    """Gemma 3 normalizes on the device: for a dataset built with tiny:gemma-3 (photos kept as JPEG bytes, resized
    to 896x896 at load time; or stored resized as zstd-pdelta), the decoded samples' pixel_values made by Patchifier
    (N x 3 x 896 x 896) equal bit for bit what Gemma3ImageProcessor itself makes from the raw photos (its resize,
    its fused rescale + normalize); and with the PIL backend's class (Gemma3ImageProcessorPil: rescale in float64,
    then normalize) saved instead, what that class makes of the same stored pixels."""
    import transformers

    from trainer.families import BY_NAME

    assert BY_NAME["gemma-3"].pixels == "normalize"
    raw, spec, processor, _, images, index = _built_photos(tmp_path, "gemma-3", image_format)
    assert type(processor).__name__ == spec.kind == "Gemma3ImageProcessor" and spec.normalized
    ref = processor(images=raw, return_tensors="pt")
    ours = Patchifier(spec, "cpu")(images, index)
    assert ours.dtype == ref["pixel_values"].dtype == torch.float32 and ours.shape == (4, 3, 896, 896)
    assert ours.shape == ref["pixel_values"].shape
    assert torch.equal(ours, ref["pixel_values"]), float((ours - ref["pixel_values"]).abs().max())

    pil_spec = ImageSpec.from_config({**spec.config, "image_processor_type": "Gemma3ImageProcessorPil"})
    pil = transformers.Gemma3ImageProcessorPil(**processor.to_dict())
    stored = [Image.fromarray(images[u].numpy()) for u in index]
    pil_ref = pil(images=stored, do_resize=False, return_tensors="pt")["pixel_values"]
    pil_ours = Patchifier(pil_spec, "cpu")(images, index)
    assert torch.equal(pil_ours, pil_ref), float((pil_ours - pil_ref).abs().max())
    assert not torch.equal(pil_ref, ref["pixel_values"])  # the two backends differ: each got its own arithmetic


def test_gemma3_repeated_images_are_normalized_once_and_indexed_and_pan_and_scan_stays_on_the_host():
    """A repeated image's occurrences get the same rows (token order); a saved Gemma 3 processor with pan-and-scan on
    (its crops) is not normalized on the device: its host processor makes its pixel_values."""
    import transformers

    ip = transformers.Gemma3ImageProcessor(size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    spec = ImageSpec.from_config({**ip.to_dict(), "image_processor_type": "Gemma3ImageProcessor"})
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(2))
    ours = Patchifier(spec, "cpu")([torch.from_numpy(a), torch.from_numpy(b)], [1, 0, 1])
    ref = ip(images=[Image.fromarray(x) for x in (b, a, b)], do_resize=False, return_tensors="pt")["pixel_values"]
    assert torch.equal(ours, ref)
    panned = ImageSpec.from_config({**spec.config, "do_pan_and_scan": True})
    assert spec.normalized and not panned.normalized and not panned.do_normalize


@pytest.mark.parametrize("kind", ["Qwen2VLImageProcessorPil", "Glm4vImageProcessorPil"])
def test_pixel_values_equal_the_pil_backends_own_arithmetic(kind):
    """A saved processor of the PIL backend (`*Pil`: numpy's rescale in float64 then its normalize in float32, not
    torchvision's fused mean/std, 1 ulp apart on some pixels) gets its own arithmetic on the device: pixel_values
    equal that processor's bit for bit, with rescale and normalize, and with each alone."""
    import transformers

    ip = getattr(transformers, kind)()
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(56, 56), (84, 140), (140, 84)]]
    for flags in ({}, dict(do_rescale=False, do_normalize=True), dict(do_rescale=True, do_normalize=False)):
        spec = ImageSpec.from_config({**ip.to_dict(), "image_processor_type": kind, **flags})
        ref = ip(images=[Image.fromarray(im) for im in images], do_resize=False, return_tensors="pt", **flags)
        ours = Patchifier(spec, "cpu")([torch.from_numpy(im) for im in images], [0, 1, 2])
        assert ours.dtype == ref["pixel_values"].dtype == torch.float32
        assert torch.equal(ours, ref["pixel_values"]), (flags, float((ours - ref["pixel_values"]).abs().max()))


@pytest.mark.parametrize(
    "name", ["llama-3.2-vision", "llama-4", "mistral-3", "gemma-4", "internvl", "llava-onevision", "smolvlm"]
)
def test_host_pixel_inputs_from_channels_first_views_equal_the_processors_on_pil_images(name, monkeypatch):
    """The host path hands a torchvision-backend processor channels-first views of the stored pixels, not PIL images,
    and the processor resizes a large one as it lies (channels-last strides; its own process_image would copy it into
    planes, 3-7x slower to resize; a small one, or one it does not resize, it gets as planes): every output equals the processor's own on PIL images of the same pixels, bit for
    bit, and is contiguous, for a demo photo, a larger one, two images of one sample (of one size too: the processor
    stacks those), images 3 pixels tall or wide (channels-last pixels, or a layout read from the shape alone, would
    take their rows for channels); the stored pixels, read-only, are never written."""
    from trainer.families import BY_NAME
    from vlmprep.processors.load import load_processor
    from vlmprep_schemas import pixels

    processor = load_processor(f"tiny:{name}")
    ip, rule = processor.image_processor, pixels.RULES[type(processor).__name__]
    assert pixels._torchvision(ip) is ip, type(ip).__mro__
    assert pixels._torchvision(functools.partial(ip, do_normalize=False)) is ip  # the uint8 call
    resize = not BY_NAME[name].resized
    rng = np.random.default_rng(5)
    photo = np.asarray(Image.open(LLAMAFACTORY / "mllm_demo_data" / "2.jpg").convert("RGB"))
    big = np.asarray(Image.fromarray(photo).resize((1400, 800)))  # over VIEW_MIN_PIXELS: resized as it lies
    thin = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(3, 40, 3), (40, 3, 3)]]
    twin = np.ascontiguousarray(big[::-1])
    for im in (photo, big, twin, *thin):
        im.setflags(write=False)
    kept = [im.copy() for im in (photo, big, twin, *thin)]
    layouts: list[bool] = []
    from torchvision.transforms.v2.functional import _geometry

    def spy(image, *args, **kwargs):
        layouts.append(image.is_contiguous(memory_format=torch.channels_last))  # the pixels as stored
        return interpolate(image, *args, **kwargs)

    interpolate = _geometry.interpolate
    ids = np.zeros((1, 4), np.int64)
    for per_sample in ([[photo]], [[big]], [[big, photo]], [[big, twin]], [[thin[0]]], [[thin[1]]]):
        layouts.clear()
        with monkeypatch.context() as m:
            m.setattr(_geometry, "interpolate", spy)
            ours = pixels.pixel_inputs(ip, rule, per_sample, resize=resize, ids=ids, mm=ids)
        if resize and len(per_sample[0]) == 1:  # (LLaVA-OneVision pads each of several images to a square first)
            large = per_sample[0][0].shape[0] * per_sample[0][0].shape[1] >= pixels.VIEW_MIN_PIXELS
            assert layouts and layouts[0] == large, (name, per_sample[0][0].shape, "resized as planes / as it lies")
        with monkeypatch.context() as m:
            m.setattr(pixels, "_torchvision", lambda _ip: None)
            ref = pixels.pixel_inputs(ip, rule, per_sample, resize=resize, ids=ids, mm=ids)
        assert ours.keys() == ref.keys() and ours
        for k in ref:
            assert torch.equal(ours[k], ref[k]), (name, k, [im.shape for im in per_sample[0]])
            assert ours[k].is_contiguous(), (name, k)
    assert all(np.array_equal(a, b) for a, b in zip((photo, big, twin, *thin), kept))
