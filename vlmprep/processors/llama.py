"""Offline builds (cached by vlmprep.processors.builtin) of the Llama 3.2 Vision (MllamaProcessor) and Llama 4
(Llama4Processor) processors from the
tiktoken BPE ranks `llama-models` ships, special tokens at the official Hugging Face ids, and the chat format of
llama-models' ChatFormat (Meta's reference encoder) as the default template.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import ProcessorMixin

TEMPLATES = Path(__file__).parent.parent / "templates"
# ChatFormat encodes each tool call on its own, so BPE never merges across two calls (`}}` `{"`, not `}}{` `"`). The
# vendor templates print this string between such pieces and the builtin tokenizers split there and drop it, so the
# processor's own apply_chat_template gives ChatFormat's tokens. Text holding it is refused (vlmprep's sentinel prefix).
TOKEN_BREAK = "\ue000VLMPREP-BREAK\ue001"

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The 256 specials after the 128000 ranks, with the names of the Hugging Face Llama 3.1 / 3.2 tokenizer (llama-models
# names a few of them differently: <|step_id|> at 128005, <|image|> at 128011, which ChatFormat maps to 128256).
LLAMA3_SPECIALS = (
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    )
    + tuple(f"<|reserved_special_token_{i}|>" for i in range(3, 248))
    + ("<|image|>",)
)  # 128256: added for Llama 3.2 Vision

LLAMA4_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _llama4_specials() -> tuple[str, ...]:
    # The 2048 specials after the 200000 ranks, in llama-models' order (its Tokenizer is what the HF files came from).
    from llama_models.llama4.tokenizer import BASIC_SPECIAL_TOKENS, LLAMA4_SPECIAL_TOKENS

    named = BASIC_SPECIAL_TOKENS + LLAMA4_SPECIAL_TOKENS
    return tuple(named) + tuple(f"<|reserved_special_token_{i}|>" for i in range(2048 - len(named)))


@dataclass(frozen=True)
class _LlamaSpec:
    package_dir: str  # llama_models/<dir>/tokenizer.model
    pattern: str
    specials: tuple[str, ...] | None  # from id len(ranks) on (None: Llama 4's, read from llama-models)
    template: str  # default template (vendor format); the Hub one is HF_TEMPLATES[name]
    bos: str
    eos: str
    pad: str
    model_max_length: int


SPECS = {
    "llama-3.2-vision": _LlamaSpec(
        "llama3",
        LLAMA3_PATTERN,
        LLAMA3_SPECIALS,
        "llama3_2_vision_llama_models.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
        131072,
    ),
    "llama-4": _LlamaSpec(
        "llama4",
        LLAMA4_PATTERN,
        None,
        "llama4_llama_models.jinja",
        "<|begin_of_text|>",
        "<|eot|>",
        "<|finetune_right_pad|>",
        10485760,
    ),
}
HF_TEMPLATES = {"llama-3.2-vision": "llama3_2_vision.jinja", "llama-4": "llama4.jinja"}


def ranks_resource(spec: _LlamaSpec):
    """The llama-models tokenizer.model (tiktoken ranks) of a builtin Llama spec."""
    return importlib.resources.files("llama_models").joinpath(spec.package_dir, "tokenizer.model")


def read_template(name: str) -> str:
    """A bundled chat template (vlmprep/templates/NAME) as text."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def source_files(name: str) -> tuple[bytes, str]:
    """What the build reads (BPE ranks, default template): vlmprep.processors.builtin hashes them into the cache key."""
    spec = SPECS[name]
    return ranks_resource(spec).read_bytes(), read_template(spec.template)


def _tokenizer(spec: _LlamaSpec, template: str):
    from tokenizers import AddedToken, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = spec.specials if spec.specials is not None else _llama4_specials()
    with importlib.resources.as_file(ranks_resource(spec)) as path:
        backend = TikTokenConverter(vocab_file=str(path), pattern=spec.pattern).converted()
        n_ranks = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    backend.model.ignore_merges = True  # tiktoken looks a whole piece up first; see test_vendors parity
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(TOKEN_BREAK, "removed"), backend.pre_tokenizer]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for i, t in enumerate(specials):
        if backend.token_to_id(t) != n_ranks + i:
            raise RuntimeError(f"{t} got id {backend.token_to_id(t)}, expected {n_ranks + i}")
    bos_id = n_ranks + specials.index(spec.bos)
    # As the official tokenizer.json: encode() adds <|begin_of_text|> (the chat template writes it itself).
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{spec.bos}:0 $A:0",
                pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
                special_tokens=[(spec.bos, bos_id)],
            ),
        ]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        model_max_length=spec.model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = template
    return tok


def make_processor(name: str, template: str) -> ProcessorMixin:
    """A builtin Llama processor (llama-3.2-vision or llama-4) built offline from llama-models' vocabulary, with
    `template`."""
    import transformers as T

    spec = SPECS[name]
    tok = _tokenizer(spec, template)
    if name == "llama-3.2-vision":  # Llama-3.2-11B-Vision-Instruct preprocessor_config: 560 px tiles, up to 4 (the
        # class default is 224 px, which the checkpoint's vision tower, 560 px, cannot take)
        ip = T.MllamaImageProcessor(size={"height": 560, "width": 560}, max_image_tiles=4)
        return T.MllamaProcessor(image_processor=ip, tokenizer=tok, chat_template=template)
    if name == "llama-4":  # Llama-4-Scout-17B-16E-Instruct: 336 px tiles, up to 16, 14 px patches, pixel shuffle 0.5
        return T.Llama4Processor(
            image_processor=T.Llama4ImageProcessor(),
            tokenizer=tok,
            chat_template=template,
            patch_size=14,
            pixel_shuffle_ratio=0.5,
        )
    raise AssertionError(f"no processor builder for {name}")
