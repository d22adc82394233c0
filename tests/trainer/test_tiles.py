"""Gemma 4's pixel inputs made on the device (trainer/data/tiles.py) against its image processor on the raw photos."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import LLAMAFACTORY
from tests.trainer.test_vision import _built_photos
from tests.vlmprep.test_images import photo
from trainer.data import tiles
from trainer.data.vision import HostPixels, ImageSpec, Patchifier
from trainer.families import BY_NAME


def _gemma4(**settings):
    """A Gemma 4 image processor (google/gemma-4-E4B-it's settings, as tiny:gemma-4 saves them) and its ImageSpec."""
    import transformers

    ip = transformers.Gemma4ImageProcessor(**{"patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3})
    for k, v in settings.items():
        setattr(ip, k, v)
    return ip, ImageSpec.from_config(ip.to_dict())


def _device_inputs(spec: ImageSpec, images: list, index: list[int]) -> dict:
    """What the trainer gives the forward: the workers' resize and position ids (HostPixels.device_images), the
    device's pixel_values (Patchifier) of the unique stored images."""
    host = HostPixels(BY_NAME["gemma-4"], spec.config, images=False, budget=spec.budget)
    resized, extra = host.device_images(images, index, [0] * len(index), np.zeros((1, 1), np.int64))
    return {"pixel_values": Patchifier(spec, "cpu")(resized, index), **extra}


def _assert_equal(ours: dict, ref) -> None:
    assert set(ours) == {"pixel_values", "image_position_ids"}
    for k, v in ours.items():
        assert v.dtype == ref[k].dtype and v.shape == ref[k].shape, (k, v.dtype, v.shape, ref[k].dtype, ref[k].shape)
        assert torch.equal(v, ref[k]), (k, float((v.double() - ref[k].double()).abs().max()))


def test_gemma4_is_patchified_on_the_device_from_its_saved_settings_only():
    """The device path needs the torchvision backend's resize and the whole saved math; the PIL backend, a saved
    do_resize=False or settings out of bounds keep the host path."""
    ip, spec = _gemma4()
    assert BY_NAME["gemma-4"].pixels == "patches"
    assert spec.budget == tiles.PatchBudget(patch_size=16, max_patches=280 * 9) and not spec.normalized
    assert spec.do_rescale and not spec.do_normalize and spec.rescale_factor == ip.rescale_factor
    cfg = spec.config
    for other in (
        {**cfg, "image_processor_type": "Gemma4ImageProcessorPil"},
        {**cfg, "do_resize": False},
        {**cfg, "patch_size": 0},
        {**cfg, "max_soft_tokens": "280"},
        {k: v for k, v in cfg.items() if k != "rescale_factor"},
    ):
        assert ImageSpec.from_config(other).budget is None, other


@pytest.mark.parametrize("image_format", ["auto", "zstd-pdelta"])
def test_gemma4_pixel_values_made_on_the_device_equal_its_image_processors_on_the_raw_photos(image_format, tmp_path):
    """For a dataset built with tiny:gemma-4 (photos stored as their JPEG bytes, or as zstd-pdelta pixels; both the
    source: Gemma 4 resizes in the loader), the decoded samples' unique images resized by the workers and
    patchified + padded on the device give bit for bit the pixel_values and image_position_ids that
    Gemma4ImageProcessor makes from the raw photos; a sample with two photos of different sizes included."""
    raw, spec, processor, samples, images, index = _built_photos(tmp_path, "gemma-4", image_format)
    assert type(processor).__name__ == spec.kind == "Gemma4ImageProcessor" and spec.budget is not None
    assert any(len(s.image_index) == 2 for s in samples)
    ref = processor(images=raw, return_tensors="pt")
    _assert_equal(_device_inputs(spec, images, index), ref)


def test_gemma4_demo_photos_a_large_photo_and_a_repeated_one_equal_the_processors():
    """The demo's JPEGs (about 300 x 170, scaled up to the budget), a 4 MP photo (scaled down) and a repeated image
    (resized and patchified once, its rows copied): pixel_values, image_position_ids and the soft-token counts equal
    the processor's; a micro-batch of one image equals it too."""
    ip, spec = _gemma4()
    demo = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))]
    large = np.asarray(photo(2400, 1800, seed=5))
    images = [*demo, large]
    index = [0, 3, 1, 0, 2, 3]
    ref = ip(images=[Image.fromarray(images[u]) for u in index], return_tensors="pt")
    ours = _device_inputs(spec, [torch.from_numpy(im) for im in images], index)
    _assert_equal(ours, ref)
    real = (ours["image_position_ids"][..., 0] >= 0).sum(-1)
    assert (real // 9).tolist() == ref["num_soft_tokens_per_image"].tolist()
    assert real.tolist() != [spec.budget.max_patches] * len(index)  # padding rows were compared too
    _assert_equal(_device_inputs(spec, [images[1]], [0]), ip(images=[Image.fromarray(images[1])], return_tensors="pt"))


def test_gemma4_with_a_normalize_gets_the_fused_arithmetic_and_a_wrong_one_fails():
    """A saved Gemma 4 processor that normalizes too (rescale and normalize fused, as torchvision's backend does)
    equals the processor bit for bit; the unfused rescale-then-normalize and padding with anything but 0 do not."""
    ip, spec = _gemma4(do_normalize=True, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.25])
    assert spec.do_normalize and spec.budget is not None
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(170, 300), (500, 210)]]
    ref = ip(images=[Image.fromarray(im) for im in images], return_tensors="pt")
    ours = _device_inputs(spec, images, [0, 1])
    _assert_equal(ours, ref)

    host = HostPixels(BY_NAME["gemma-4"], spec.config, images=False, budget=spec.budget)
    resized, _ = host.device_images(images, [0, 1], [0, 0], np.zeros((1, 1), np.int64))
    pf = Patchifier(spec, "cpu")
    mean, std = torch.tensor(spec.image_mean), torch.tensor(spec.image_std)

    def unfused(x, channels):
        return (x * spec.rescale_factor - mean.view(channels)) / std.view(channels)

    wrong = tiles.patches(unfused, resized, [0, 1], spec.budget, pf.device)
    assert not torch.equal(wrong, ref["pixel_values"])
    padded = pf(resized, [0, 1])
    padded[ours["image_position_ids"][..., 0] < 0] = pf._scale(torch.zeros(3, dtype=torch.uint8), (-1,))[0]
    assert not torch.equal(padded, ref["pixel_values"])  # the processor pads after its math: zeros, not a black pixel


def test_gemma4_resize_of_the_channels_last_view_equals_the_processors_contiguous_one():
    """tiles.resize hands the processor a channels-last view (faster); the processor's own resize of its contiguous
    C x H x W copy gives the same uint8 pixels, up and down."""
    ip, _ = _gemma4()
    for w, h in [(300, 170), (2400, 1800), (37, 900)]:
        im = np.asarray(photo(w, h, seed=w))
        ours = tiles.resize(ip, im)
        ref = ip.aspect_ratio_preserving_resize(
            image=torch.from_numpy(im).permute(2, 0, 1).contiguous(),
            patch_size=16,
            max_patches=280 * 9,
            pooling_kernel_size=3,
            resample=ip.resample,
        )
        assert ours.is_contiguous() and torch.equal(ours, ref.permute(1, 2, 0)), (w, h)


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4", "mllama"])
def test_a_real_checkpoint_of_a_family_with_host_inputs_gets_its_processor(model_type, tmp_path):
    """Gemma 3 (token types) and Gemma 4 (resize, position ids) make inputs on the host as the host families do: a
    run of a real checkpoint (not --tiny-random) loads the dataset's processor for them; Qwen's needs none."""
    import contextlib

    from trainer.data.datasets import RunData, processor_dir

    _, spec = _gemma4()
    data = RunData((), [], [], spec, "", str(tmp_path))
    with contextlib.ExitStack() as owner:
        assert processor_dir(data, owner, model_type=model_type, tiny=False) == str(tmp_path)
        assert processor_dir(data, owner, model_type="qwen2_vl", tiny=False) is None


TOKEN = 9  # the image token of the synthetic ids below


def _mllama(**settings):
    """An Mllama image processor (Llama-3.2-11B-Vision-Instruct's tiles, as tiny:llama-3.2-vision saves them) and its
    ImageSpec."""
    import transformers

    ip = transformers.MllamaImageProcessor(size={"height": 560, "width": 560}, max_image_tiles=4)
    for k, v in settings.items():
        setattr(ip, k, v)
    return ip, ImageSpec.from_config(ip.to_dict())


def _ids(rows: list[int], batch_rows: int) -> np.ndarray:
    """Token ids of `batch_rows` rows with an image token per occurrence (`rows`: its row), text around them."""
    ids = np.full((batch_rows, 12), 5, dtype=np.int64)
    for b in range(batch_rows):
        ids[b, 1 : 1 + 2 * rows.count(b) : 2] = TOKEN
    return ids


def _mllama_device(spec: ImageSpec, images: list, index: list[int], rows: list[int], ids: np.ndarray) -> dict:
    """The trainer's Mllama inputs: the workers' fit and ratios (HostPixels.device_images), the device's tiles
    (Patchifier.inputs of the micro-batch)."""
    from types import SimpleNamespace

    host = HostPixels(
        BY_NAME["llama-3.2-vision"], spec.config, image_token_id=TOKEN, max_tiles=4, images=False, canvas=spec.canvas
    )
    fitted, extra = host.device_images(images, index, rows, ids)
    batch = SimpleNamespace(vision=extra, images=fitted, image_index=index, image_rows=rows, input_ids=ids)
    pixels, videos = Patchifier(spec, "cpu").inputs(batch)
    assert videos is None
    return {"pixel_values": pixels, **extra}


def _mllama_reference(ip, images: list, index: list[int], rows: list[int], ids: np.ndarray) -> dict:
    """The host path's inputs (vlmprep_schemas.pixels, what the family tests hold equal to the processor's on the raw
    records); where every row has images, also the processor's own nested call."""
    from vlmprep_schemas.pixels import RULES, pixel_inputs

    per_row = [[np.asarray(images[u]) for u, r in zip(index, rows) if r == b] for b in range(len(ids))]
    ref = pixel_inputs(ip, RULES["MllamaProcessor"], per_row, resize=True, ids=ids, image_token_id=TOKEN, max_tiles=4)
    if all(per_row):
        own = ip([[Image.fromarray(im) for im in row] for row in per_row], return_tensors="pt")
        for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
            assert torch.equal(own[k], ref[k]), k
    return ref


def _assert_mllama_equal(ours: dict, ref: dict) -> None:
    assert set(ours) == set(ref) == {"pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"}
    for k, v in ours.items():
        assert v.dtype == ref[k].dtype and v.shape == ref[k].shape, (k, v.dtype, v.shape, ref[k].dtype, ref[k].shape)
        assert torch.equal(v, ref[k]), (k, float((v.double() - ref[k].double()).abs().max()))


def test_mllama_is_tiled_on_the_device_from_its_saved_settings_only():
    """The device path needs the torchvision backend and a square tile with the whole saved math; the PIL backend, a
    non-square size or a tile count out of bounds keep the host path."""
    ip, spec = _mllama()
    assert BY_NAME["llama-3.2-vision"].pixels == "tiles"
    assert spec.canvas == tiles.TileCanvas(tile_size=560, max_tiles=4) and spec.budget is None
    assert spec.do_rescale and spec.do_normalize and spec.image_mean == (0.5, 0.5, 0.5)
    cfg = spec.config
    for other in (
        {**cfg, "image_processor_type": "MllamaImageProcessorPil"},
        {**cfg, "size": {"height": 560, "width": 448}},
        {**cfg, "max_image_tiles": 0},
        {**cfg, "size": [560, 560]},
        {k: v for k, v in cfg.items() if k != "image_std"},
    ):
        assert ImageSpec.from_config(other).canvas is None, other


@pytest.mark.parametrize("image_format", ["auto", "zstd-pdelta"])
def test_mllama_inputs_made_on_the_device_equal_its_image_processors_on_the_raw_photos(image_format, tmp_path):
    """For a dataset built with tiny:llama-3.2-vision (the source stored as JPEG bytes or zstd-pdelta pixels), the
    decoded samples' unique images fitted by the workers and tiled on the device give bit for bit the pixel_values,
    aspect ratio ids and mask and cross-attention mask of its image processor on the raw photos: a row of two photos
    of different sizes, rows of one, and a row without images (padded like the host path pads it)."""
    raw, spec, processor, samples, images, index = _built_photos(tmp_path, "llama-3.2-vision", image_format)
    assert type(processor).__name__ == spec.kind == "MllamaImageProcessor" and spec.canvas is not None
    rows = [b if b < 2 else b + 1 for b, s in enumerate(samples) for _ in s.image_index]  # row 2 holds no image
    assert rows == [0, 0, 1, 3]
    ids = _ids(rows, 4)
    ours = _mllama_device(spec, images, index, rows, ids)
    _assert_mllama_equal(ours, _mllama_reference(processor, [np.asarray(im) for im in raw], list(range(4)), rows, ids))
    assert ours["pixel_values"][2].abs().sum() == 0 and ours["aspect_ratio_mask"][2].tolist() == [[1, 0, 0, 0]] * 2


def test_mllama_demo_photos_a_large_photo_and_a_repeated_one_equal_the_processors():
    """The demo's JPEGs (one tile each), a 4 MP photo (several tiles) and a repeated image (fitted and tiled once,
    its tiles copied), rows of different image counts: every input equals the processor's; one image alone too."""
    ip, spec = _mllama()
    demo = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))]
    images = [*demo, np.asarray(photo(2400, 1800, seed=5)), np.asarray(photo(300, 1400, seed=6))]
    index, rows = [0, 3, 1, 0, 2, 4, 3], [0, 0, 1, 1, 1, 2, 2]
    ids = _ids(rows, 3)
    ours = _mllama_device(spec, [torch.from_numpy(im) for im in images], index, rows, ids)
    _assert_mllama_equal(ours, _mllama_reference(ip, images, index, rows, ids))
    assert sorted(set(ours["aspect_ratio_mask"].sum(-1).flatten().tolist())) == [1, 3, 4]  # 1, 3 and 4 tiles
    one = _mllama_device(spec, [images[3]], [0], [0], _ids([0], 1))
    _assert_mllama_equal(one, _mllama_reference(ip, [images[3]], [0], [0], _ids([0], 1)))


def test_mllama_wrong_arithmetic_or_padding_fails():
    """The canvas padding is pixel 0 normalized ((0 - 0.5) / 0.5 = -1), the padding tiles 0.0 after the math, and the
    normalize is torchvision's fused one: each changed alone differs from the processor."""
    ip, spec = _mllama(image_mean=[0.48, 0.46, 0.41], image_std=[0.27, 0.26, 0.28])
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(700, 300), (200, 900)]]
    index, rows, ids = [0, 1], [0, 0], _ids([0, 0], 1)
    ref = _mllama_reference(ip, images, index, rows, ids)
    ours = _mllama_device(spec, images, index, rows, ids)
    _assert_mllama_equal(ours, ref)
    host = HostPixels(BY_NAME["llama-3.2-vision"], spec.config, image_token_id=TOKEN, max_tiles=4, canvas=spec.canvas)
    fitted, _ = host.device_images(images, index, rows, ids)
    pf = Patchifier(spec, "cpu")
    mean, std = torch.tensor(spec.image_mean), torch.tensor(spec.image_std)

    def unfused(x, channels):
        return (x * spec.rescale_factor - mean.view(channels)) / std.view(channels)

    assert not torch.equal(tiles.tiled(unfused, fitted, index, rows, 1, spec.canvas, pf.device), ref["pixel_values"])

    def zero_canvas(x, channels):  # the canvas padding made 0.0 after the math instead of pixel 0 normalized
        out = pf._scale(x, channels)
        out[(x == 0).all(-1)] = 0.0
        return out

    blank = [f.clone() for f in fitted]
    assert not torch.equal(tiles.tiled(zero_canvas, blank, index, rows, 1, spec.canvas, pf.device), ref["pixel_values"])
    black = ours["pixel_values"].clone()
    black[ours["aspect_ratio_mask"] == 0] = pf._scale(torch.zeros(3, dtype=torch.uint8), (-1,)).view(3, 1, 1)
    assert not torch.equal(black, ref["pixel_values"])  # padding tiles are 0.0, not a black pixel normalized


def _uint8_processor(name: str):
    """tiny:NAME's image processor (Llama 4's or InternVL's GotOcr2, their checkpoints' settings) and its ImageSpec."""
    from vlmprep.processors.tiny import _image_processors

    ip = _image_processors(name)[0]
    return ip, ImageSpec.from_config(ip.to_dict())


@pytest.mark.parametrize("name", ["llama-4", "internvl"])
def test_uint8_pixel_values_rescaled_and_normalized_on_the_device_equal_the_processors(name):
    """Llama 4 and InternVL: the workers' pixel_values are the processor's with its rescale and normalize off (uint8,
    a quarter of the bytes), and the device's rescale + normalize of them (Llama 4's in bfloat16, its override;
    InternVL's fused, torchvision's) equal bit for bit what the processor makes of the raw photos (the demo's, a 4 MP
    one, a repeat; the host rule's float32 of Llama 4's bfloat16); the other arithmetic fails it."""
    from types import SimpleNamespace

    from vlmprep_schemas.pixels import RULES, pixel_inputs

    ip, spec = _uint8_processor(name)
    family = BY_NAME[name]
    assert family.pixels == "uint8" and spec.host_uint8 and spec.do_rescale and spec.do_normalize
    demo = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))]
    per_sample = [[demo[0], np.asarray(photo(2400, 1800, seed=5))], [demo[1], demo[0]]]
    rule = RULES[family.processor_classes[0]]
    ref = pixel_inputs(ip, rule, per_sample, resize=True)
    host = HostPixels(family, spec.config, math=False)
    ours = host(per_sample, np.zeros((2, 4), np.int64), np.zeros((2, 4), np.uint8))
    assert ours.keys() == ref.keys() and ours["pixel_values"].dtype == torch.uint8
    assert all(torch.equal(ours[k], ref[k]) for k in ref if k != "pixel_values")
    pf = Patchifier(spec, "cpu")
    pixels, videos = pf.inputs(SimpleNamespace(vision=ours))
    assert videos is None and pixels.dtype == torch.float32 and pixels.shape == ref["pixel_values"].shape
    assert torch.equal(pixels, ref["pixel_values"]), float((pixels - ref["pixel_values"]).abs().max())
    own = ip(images=[Image.fromarray(im) for row in per_sample for im in row], return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, own.float())
    other = ImageSpec.from_config({**spec.config, "image_processor_type": "GotOcr2ImageProcessor"})
    wrong = Patchifier(other, "cpu").host_math(ours["pixel_values"]) if name == "llama-4" else None
    if wrong is None:  # InternVL: the unfused rescale then normalize
        mean, std = torch.tensor(spec.image_mean).view(1, -1, 1, 1), torch.tensor(spec.image_std).view(1, -1, 1, 1)
        wrong = (ours["pixel_values"] * spec.rescale_factor - mean) / std
    assert not torch.equal(wrong, ref["pixel_values"])


def test_uint8_host_pixels_need_the_torchvision_backend_and_the_whole_math():
    """A saved PIL backend, or a processor that rescales without normalizing, keeps the host's float pixel_values."""
    for name in ("llama-4", "internvl"):
        _, spec = _uint8_processor(name)
        cfg = spec.config
        for other in (
            {**cfg, "image_processor_type": cfg["image_processor_type"] + "Pil"},
            {**cfg, "do_normalize": False},
            {k: v for k, v in cfg.items() if k != "image_mean"},
        ):
            assert not ImageSpec.from_config(other).host_uint8, other


@pytest.mark.parametrize("kind", ["Idefics3ImageProcessor", "SmolVLMImageProcessor"])
def test_smolvlm_tiles_padded_in_uint8_and_normalized_under_the_mask_equal_the_processors(kind):
    """Idefics3 / SmolVLM: the workers' pixel_values are the processor's tiles with rescale, normalize and pad off,
    padded in uint8 (Uint8Tiles), and the device's rescale + normalize under the pixel mask equal bit for bit the
    processor's own inputs for a micro-batch whose samples have different tile counts (a demo photo and a 4 MP one
    in one sample, a wide strip alone), the mask's values included; padding left as a normalized black fails it. A saved
    processor that does not pad keeps the host's float path."""
    from types import SimpleNamespace

    import transformers

    from vlmprep_schemas.pixels import RULES, pixel_inputs

    tiny, _ = _uint8_processor("smolvlm")
    ip = getattr(transformers, kind)(**{k: v for k, v in tiny.to_dict().items() if k != "image_processor_type"})
    spec = ImageSpec.from_config({**ip.to_dict(), "image_processor_type": kind})
    family = BY_NAME["smolvlm"]
    assert family.pixels == "uint8" and spec.host_uint8
    demo = np.asarray(Image.open(sorted((LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))[0]).convert("RGB"))
    strip = np.asarray(photo(900, 120, seed=3))
    per_sample = [[demo, np.asarray(photo(2400, 1800, seed=5))], [strip]]
    ref = pixel_inputs(ip, RULES[family.processor_classes[0]], per_sample, resize=True)
    host = HostPixels(family, spec.config, math=False)
    host._ip = ip
    ours = host(per_sample, np.zeros((2, 4), np.int64), np.zeros((2, 4), np.uint8))
    assert ours.keys() == ref.keys() == {"pixel_values", "pixel_attention_mask"}
    mask = ours["pixel_attention_mask"]  # bool, as the model makes it where none is given
    assert ours["pixel_values"].dtype == torch.uint8 and mask.dtype == torch.bool
    assert torch.equal(mask.long(), ref["pixel_attention_mask"])
    assert int(ref["pixel_attention_mask"][1].amax(dim=(-1, -2)).sum()) < ref["pixel_values"].shape[1]  # padded tiles
    pf = Patchifier(spec, "cpu")
    pixels, _ = pf.inputs(SimpleNamespace(vision=ours))
    assert pixels.dtype == torch.float32 and torch.equal(pixels, ref["pixel_values"])
    black = pf._scale(ours["pixel_values"].flatten(0, 1), (1, -1, 1, 1)).view(ours["pixel_values"].shape)
    assert not torch.equal(black, ref["pixel_values"])
    assert not ImageSpec.from_config({**spec.config, "do_pad": False}).host_uint8


def test_llava_onevision_patches_padded_in_uint8_and_zeroed_by_count_on_the_device_equal_the_processors():
    """LLaVA-OneVision: the workers' pixel_values are the processor's patches with rescale, normalize and its pad off,
    padded in uint8 (Uint8Patches) with each image's own count, and the device's rescale + normalize, the padding
    patches 0.0, equal bit for bit the processor's own inputs for a micro-batch of a demo photo alone, a 4 MP one
    alone (more patches) and two in one sample (padded to squares, one patch each); the count never reaches the
    forward. Padding left as a normalized black fails it; a saved processor that does not pad keeps the float path."""
    from types import SimpleNamespace

    from vlmprep_schemas.pixels import RULES, pixel_inputs

    ip, spec = _uint8_processor("llava-onevision")
    family = BY_NAME["llava-onevision"]
    assert family.pixels == "uint8" and spec.host_uint8 and spec.do_rescale and spec.do_normalize
    demo = [np.asarray(Image.open(p).convert("RGB")) for p in sorted((LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))]
    per_sample = [[demo[0]], [np.asarray(photo(2400, 1800, seed=5))], [demo[1], np.asarray(photo(900, 120, seed=3))]]
    ref = pixel_inputs(ip, RULES[family.processor_classes[0]], per_sample, resize=True)
    host = HostPixels(family, spec.config, math=False)
    ours = host(per_sample, np.zeros((3, 4), np.int64), np.zeros((3, 4), np.uint8))
    assert ours.keys() - {tiles.PATCHES} == ref.keys() == {"pixel_values", "image_sizes", "batch_num_images"}
    assert ours["pixel_values"].dtype == torch.uint8 and ours["pixel_values"].shape == ref["pixel_values"].shape
    assert all(torch.equal(ours[k], ref[k]) for k in ("image_sizes", "batch_num_images"))
    counts = ours[tiles.PATCHES].tolist()
    assert len(counts) == 4 and counts[2:] == [1, 1] and counts[1] > counts[0] > 1  # padding patches in 3 of 4
    pf = Patchifier(spec, "cpu")
    pixels, videos = pf.inputs(SimpleNamespace(vision=ours))
    assert videos is None and pixels.dtype == torch.float32 and torch.equal(pixels, ref["pixel_values"])
    black = pf._scale(ours["pixel_values"].flatten(0, 1), (1, -1, 1, 1)).view(ours["pixel_values"].shape)
    assert not torch.equal(black, ref["pixel_values"])
    assert not ImageSpec.from_config({**spec.config, "do_pad": False}).host_uint8
    assert not ImageSpec.from_config(
        {**spec.config, "image_processor_type": "LlavaOnevisionImageProcessorPil"}
    ).host_uint8
