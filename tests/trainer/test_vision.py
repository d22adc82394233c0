import numpy as np
import pytest
import torch
from PIL import Image

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
