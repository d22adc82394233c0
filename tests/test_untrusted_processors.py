"""A dataset's saved processor is untrusted JSON too (issue 44, round 4): every processor JSON file is bounded in size
and nesting before a parser sees it, its sizes are checked positive, and a tokenizer that does not load is one line
naming the dir; through vlmprep's loader, the Collator, verify and the trainer."""

import json

import pytest

from tests import test_untrusted_datasets as base
from tests.test_untrusted_datasets import _copy, _one_line, _trainer_refuses, _verify_fails

dataset = base.dataset  # the same module-scoped fixture: 4 records built with builtin:qwen2-vl

DEEP = 100_000


def _nest(path, depth: int = DEEP) -> None:
    path.write_text("[" * depth + "]" * depth)


@pytest.mark.parametrize("name", ["tokenizer.json", "processor_config.json", "tokenizer_config.json"])
def test_a_processor_file_nested_100000_deep_is_refused_by_every_reader(dataset, tmp_path, capsys, name):
    from vlmprep.clients.collate import Collator
    from vlmprep.processors.load import load_saved_processor
    from vlmprep.shards.reader import ShardFormatError

    ds = _copy(dataset, tmp_path)
    _nest(ds / "processor" / name)
    must = (str(ds / "processor" / name), f"JSON nested {DEEP} levels deep")
    with pytest.raises(ValueError) as e:
        load_saved_processor(ds / "processor")
    _one_line(e.value, *must)
    with pytest.raises((ShardFormatError, ValueError)) as e:  # as it opens the dataset (configs), or loads its
        # processor (the vocabulary)
        _ = Collator(ds).processor
    _one_line(e.value, *must)
    _verify_fails(ds, *must)  # before: OK, and `trainer export` shipped it
    _trainer_refuses(ds, tmp_path, capsys, *must)


@pytest.mark.parametrize(
    "key, value",
    [
        ("patch_size", 0),
        ("patch_size", -14),
        ("patch_size", 14.5),
        ("patch_size", True),
        ("size", {"height": 0, "width": 448}),
        ("pooling_kernel_size", 0),
        ("max_soft_tokens", -280),
        ("max_image_size", {"longest_edge": 0}),
        ("max_image_tiles", 10**6),
    ],
)
def test_a_processor_size_that_is_not_a_positive_integer_is_refused_naming_the_file(
    dataset, tmp_path, capsys, key, value
):
    """patch_size 0 was a ZeroDivisionError and -14 an 'invalid shape dimension', with no file named; Gemma 4's
    pooling kernel or budget, Idefics3's tile, the same; Mllama's max_image_tiles 10^6 would hang the build's and the
    loader's resize (every tile arrangement is listed)."""
    from trainer.data.errors import DataError
    from trainer.data.processors import load_image_processor_config
    from vlmprep.processors.load import load_saved_processor

    ds = _copy(dataset, tmp_path)
    path = ds / "processor" / "processor_config.json"
    _edit(path, lambda cfg: cfg["image_processor"].update({key: value}))
    problem = "is over 1024" if key == "max_image_tiles" else "is not a positive integer"
    must = (str(path), f"{key} {json.dumps(value)} {problem}")
    with pytest.raises(ValueError) as e:
        load_saved_processor(ds / "processor")
    _one_line(e.value, *must)
    with pytest.raises(DataError) as e:
        load_image_processor_config(str(ds / "processor"))
    _verify_fails(ds, *must)
    _trainer_refuses(ds, tmp_path, capsys, *must)


def test_a_tokenizer_that_does_not_load_is_one_line_naming_the_dir(dataset, tmp_path):
    """Valid, shallow JSON that is not a tokenizer: the tokenizers library raises a bare Exception; here it is one
    line naming the processor dir, in vlmprep and in the trainer."""
    ds = _copy(dataset, tmp_path)
    (ds / "processor" / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nope"}}))
    _loaders_refuse(ds / "processor", "cannot load the processor saved there", "cannot load the processor there")


def _loaders_refuse(proc, vlmprep_says: str, trainer_says: str) -> None:
    """vlmprep's loader (a ValueError) and the trainer's (a DataError) each refuse processor dir `proc` in one line
    naming it."""
    from trainer.data.errors import DataError
    from trainer.data.processors import load_processor as trainer_load
    from vlmprep.processors.load import load_saved_processor

    with pytest.raises(ValueError) as e:
        load_saved_processor(proc)
    _one_line(e.value, str(proc), vlmprep_says)
    with pytest.raises(DataError) as e:
        trainer_load(str(proc))
    _one_line(e.value, str(proc), trainer_says)


def _edit(path, change) -> None:
    """The JSON file `path` rewritten with `change` applied to its value."""
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _rename_classes(cfg, key: str, to: str) -> None:
    stack = [cfg]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            node.update({key: to} if key in node else {})
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("processor_config.json", "processor_class"),
        ("tokenizer_config.json", "tokenizer_class"),
        ("processor_config.json", "image_processor_type"),
        ("processor_config.json", "video_processor_type"),
    ],
)
def test_a_processor_config_naming_a_class_transformers_lacks_is_one_line_naming_it(
    dataset, tmp_path, capsys, name, key
):
    """Issue 53.6 (round 5): a processor_class transformers does not have made AutoProcessor fall back to the bare
    tokenizer, and the trainer ended in an AttributeError traceback (verify said OK); an unknown tokenizer_class was
    quietly replaced. Each class a config names is looked up first: one line naming the class and the file, through
    vlmprep's loader, the Collator, verify and the trainer."""
    from vlmprep.clients.collate import Collator
    from vlmprep.processors.load import load_saved_processor

    ds = _copy(dataset, tmp_path)
    path = ds / "processor" / name
    _edit(path, lambda cfg: _rename_classes(cfg, key, "NoSuchClass"))
    must = (str(path), f'{key} "NoSuchClass" is not a class transformers has')
    with pytest.raises(ValueError) as e:
        load_saved_processor(ds / "processor")
    _one_line(e.value, *must)
    with pytest.raises(ValueError) as e:
        _ = Collator(ds).processor
    _one_line(e.value, *must)
    _verify_fails(ds, *must)
    _trainer_refuses(ds, tmp_path, capsys, *must)


def test_a_processor_dir_that_loads_as_a_bare_tokenizer_is_one_line(dataset, tmp_path):
    """No processor_config.json (nor a processor_class anywhere): transformers loads the tokenizer alone, which the
    readers took for a processor."""
    ds = _copy(dataset, tmp_path)
    (ds / "processor" / "processor_config.json").unlink()
    _edit(ds / "processor" / "tokenizer_config.json", lambda cfg: cfg.pop("processor_class", None))
    _loaders_refuse(ds / "processor", "not a processor", "not a processor")


@pytest.mark.parametrize("name", ["mistral-3", "gemma-4"])
def test_the_trainers_placeholder_image_never_renders_the_datasets_chat_template(tmp_path, name):
    """A host family's placeholder image (trainer/data/vision.py host_pixels) comes from the processor's own call:
    a dataset whose saved chat template would loop or raise is never rendered by the trainer."""
    from trainer.data.processors import load_image_processor_config
    from trainer.data.vision import ImageSpec, host_pixels
    from trainer.families import BY_NAME
    from vlmprep.processors.tiny import make_processor, source_files

    hostile = "{{ raise_exception('the dataset template was rendered') }}"
    make_processor(name, hostile).save_pretrained(tmp_path / "p")
    trusted = make_processor(name, source_files(name)[1])
    spec = ImageSpec.from_config(load_image_processor_config(str(tmp_path / "p")))
    _, placeholder, size = host_pixels(BY_NAME[name], str(tmp_path / "p"), spec, trusted.image_token_id)
    black = [{"role": "user", "content": [{"type": "image", "image": _black()}, {"type": "text", "text": "x"}]}]
    want = trusted.apply_chat_template(black, tokenize=True, return_dict=True)["input_ids"]
    assert len(placeholder) == sum(i == trusted.image_token_id for i in want[0]) > 0


def _black():
    from PIL import Image

    from trainer.data.vision import PLACEHOLDER_SIDE

    return Image.new("RGB", (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE))
