"""from_local_dir: a saved processor dir loaded with its tokenizer.json read by the tokenizers library alone, equal to
transformers' own (slower) load of the same dir."""

import json

import pytest

from vlmprep.processors.builtin import builtin_dir, builtin_names, from_local_dir

TEXT = (
    "<|im_start|>user\nHello <|vision_start|><|image_pad|><|vision_end|> w\u00f6rld 123 \n\n  x<|im_end|>"
    "<|endoftext|><think> [IMG][/INST]<|begin_of_text|><|eot|> \u4f60\u597d"
)


def _fingerprint(processor) -> dict:
    """Everything of a processor the build reads or saves: classes, the tokenizer's backend, tokens and settings, the
    template and the image / video processors' settings."""
    tok = processor.tokenizer
    return {
        "classes": (type(processor), type(tok)),
        "backend": tok.backend_tokenizer.to_str(),
        "ids": tok(TEXT)["input_ids"],
        "special": {k: str(v) for k, v in tok.special_tokens_map.items()},
        "special_ids": tok.all_special_ids,
        "added": str(tok.added_tokens_decoder),
        "len": len(tok),
        "init_kwargs": {k: str(v) for k, v in tok.init_kwargs.items() if k != "added_tokens_decoder"},
        "template": (processor.chat_template, tok.chat_template),
        "image": processor.image_processor.to_dict() if hasattr(processor, "image_processor") else None,
        "video": processor.video_processor.to_dict() if getattr(processor, "video_processor", None) else None,
    }


def _compare(name: str, monkeypatch=None) -> None:
    from transformers import AutoProcessor

    d = builtin_dir(name)
    big = []  # the sizes of the strings parsed by Python's json over 1 MiB: tokenizer.json
    if monkeypatch is not None:
        loads = json.loads

        def counting(s, *args, **kwargs):
            if len(s) > 1 << 20:
                big.append(len(s))
            return loads(s, *args, **kwargs)

        monkeypatch.setattr(json, "loads", counting)
    fast = from_local_dir(d)
    parsed_fast = len(big)
    slow = AutoProcessor.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    if monkeypatch is not None:
        assert parsed_fast == 0  # the point of the fast load: tokenizer.json read by the Rust loader only
        assert len(big) >= 2  # the count sees transformers' own parses (counted, not timed)
    a, b = _fingerprint(slow), _fingerprint(fast)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], (name, key)


def test_fast_load_equals_transformers_load_and_parses_no_json(monkeypatch):
    """A worker's start-up: the saved processor dir loads equal to transformers' own load, without parsing the MBs of
    tokenizer.json with Python's json (transformers' load does it twice)."""
    _compare("qwen2-vl", monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in builtin_names() if n != "qwen2-vl"])
def test_fast_load_equals_transformers_load_every_builtin(name):
    _compare(name)


def test_fast_load_skips_dirs_it_does_not_cover(tmp_path):
    """A dir without tokenizer.json, or a processor transformers loads its own way (Pixtral), takes the slow load."""
    from vlmprep.processors.builtin import _fast_classes

    assert _fast_classes(tmp_path) is None
    assert _fast_classes(builtin_dir("qwen2-vl")) is not None
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor"}))
    assert _fast_classes(tmp_path) is None  # builtin:mistral-3's
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    assert _fast_classes(tmp_path) is not None
