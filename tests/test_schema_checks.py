"""schema_problem's reader parts (`read`): a reader checks the types and bounds of the meta fields it reads, each
fault named as the whole check names it; the fields it never reads are left to `vlmprep verify`."""

import pytest

from trainer.data.decode import META_READ
from vlmprep_schemas.limits import schema_problem

META = {
    "id": "a:1",
    "source": {"file": "a.jsonl", "line": 1},
    "num_tokens": 10,
    "num_trainable_tokens": 3,
    "num_image_tokens": 4,
    "num_images": 1,
    "num_tokens_before_truncation": 10,
    "truncated": False,
    "dropped_images": 0,
    "unrendered_tool_calls": 0,
    "image_format": "auto",
    "images": [{"member": "img000.orig.jpg", "height": 28, "width": 56, "grid_thw": [1, 2, 4], "span": [1, 5]}],
}


def test_the_meta_is_valid_both_ways():
    assert schema_problem(META, "sample_meta.schema.json") is None
    assert schema_problem(META, "sample_meta.schema.json", META_READ) is None


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        (("num_tokens",), "10", "num_tokens is str, not integer"),
        (("num_tokens",), -1, "num_tokens is -1, below its minimum 1"),
        (("id",), 7, "id is int, not string"),
        (("images", 0, "height"), True, "images[0].height is bool, not integer"),
        (("images", 0, "width"), 2**64, "images[0].width is 18446744073709551616, past its maximum"),
        (("images", 0, "member"), None, "images[0].member is NoneType, not string"),
        (("images",), {}, "images is dict, not array"),
    ],
)
def test_a_field_the_loader_reads_is_refused_by_its_part_as_by_the_whole_check(path, value, problem):
    meta = _with(META, path, value)
    whole, part = (
        schema_problem(meta, "sample_meta.schema.json"),
        schema_problem(meta, "sample_meta.schema.json", META_READ),
    )
    assert part == whole and part.startswith(problem), (part, whole)


@pytest.mark.parametrize(
    ("path", "value"),
    [(("num_trainable_tokens",), "3"), (("source",), 5), (("images", 0, "span"), "x"), (("images", 0, "grid_thw"), 1)],
)
def test_a_field_the_loader_never_reads_is_left_to_verify(path, value):
    meta = _with(META, path, value)
    assert schema_problem(meta, "sample_meta.schema.json") is not None  # the whole check (verify's, vlmprep's reader)
    assert schema_problem(meta, "sample_meta.schema.json", META_READ) is None


def test_a_missing_field_the_loader_reads_is_named():
    meta = {k: v for k, v in META.items() if k != "num_tokens"}
    assert schema_problem(meta, "sample_meta.schema.json", META_READ) == "it has no 'num_tokens'"


def test_a_part_naming_a_field_outside_the_schema_is_a_bug():
    with pytest.raises(AssertionError, match="not in the schema"):
        schema_problem(META, "sample_meta.schema.json", ("id", "nmu_tokens"))


def _with(meta, path, value):
    import copy

    out = copy.deepcopy(meta)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out
