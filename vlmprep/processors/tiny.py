"""`--processor tiny:NAME`: each family's real transformers processor class, chat template, image (and video)
processor settings of the published checkpoint and exact special-token strings, over a small byte-level BPE
vocabulary built here. For trying a family end to end (`--tiny-random NAME` sizes its model to it) and for tests,
never for training a real checkpoint: token ids are not the official ones (the manifest says `tiny`).
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vlmprep.processors.qwen import (
    QWEN2_VL_IMAGE,
    QWEN2_VL_SPECIAL_TOKENS,
    QWEN3_PLAIN_TOKENS,
    QWEN3_VL_IMAGE,
    QWEN25_VL_PLAIN_TOKENS,
    QWEN35_PRETOKENIZE_REGEX,
    QWEN35_TOKENS,
)

if TYPE_CHECKING:
    from transformers import ProcessorMixin

TEMPLATES = Path(__file__).parent.parent / "templates"
BUILDER_VERSION = 1

# A fixed corpus for the merges: plain English and JSON, enough that words and "\n\n" become single tokens.
_CORPUS = """You are a helpful assistant. Describe the image. What is in this picture? The page shows a red square
and a green banner. I will click the button. Done: the page is open. Clicked. Scroll down to see more.
The screenshot now shows the search results. {"name": "click", "arguments": {"x": 3, "y": 12}}
Thinking about it, the answer is yes. Here is what I see: a cat, a dog and a chart with numbers 1 2 3 4.


Open the page, then type the query and press enter. The form was submitted. Thank you!"""


@dataclass(frozen=True)
class TinySpec:
    """One tiny processor: its class, bundled template, added tokens (in id order after the byte-level vocabulary)
    and the named tokens its tokenizer and processor read."""

    processor_class: str
    template: str  # file under vlmprep/templates
    specials: tuple[str, ...]  # special=True added tokens, in id order
    plain: tuple[str, ...] = ()  # added tokens with special=False (as the official tokenizer_config has them)
    roles: dict = field(default_factory=dict)  # bos/eos/pad/unk -> token
    extra: dict = field(default_factory=dict)  # named extra special tokens the processor reads (image_token, ...)
    mixed: tuple[tuple[str, bool], ...] = ()  # instead of specials + plain: (token, special) in id order
    # The tokenizer class: transformers forces some model types' own class on a model dir (Qwen3.5's), so a tiny
    # processor exported beside such a model must be that class to tokenize as it did when the data was built.
    tokenizer_class: str = "PreTrainedTokenizerFast"
    pattern: str | None = None  # that class's pre-tokenizer regex (it rebuilds its pipeline with it on load)


_ROWCOL = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
_QWEN_ROLES = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")

SPECS: dict[str, TinySpec] = {
    "qwen2-vl": TinySpec("Qwen2VLProcessor", "qwen2_vl.jinja", QWEN2_VL_SPECIAL_TOKENS, roles=_QWEN_ROLES),
    "qwen2.5-vl": TinySpec(
        "Qwen2_5_VLProcessor", "qwen2_vl.jinja", QWEN2_VL_SPECIAL_TOKENS, QWEN25_VL_PLAIN_TOKENS, roles=_QWEN_ROLES
    ),
    "qwen3-vl": TinySpec(
        "Qwen3VLProcessor", "qwen3_vl.jinja", QWEN2_VL_SPECIAL_TOKENS, QWEN3_PLAIN_TOKENS, roles=_QWEN_ROLES
    ),
    "qwen3.5": TinySpec(
        "Qwen3VLProcessor",
        "qwen3_5.jinja",
        (),
        roles=_QWEN_ROLES,
        mixed=QWEN35_TOKENS,
        tokenizer_class="Qwen3_5Tokenizer",
        pattern=QWEN35_PRETOKENIZE_REGEX,
    ),
    "llama-3.2-vision": TinySpec(
        "MllamaProcessor",
        "llama3_2_vision.jinja",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
            "<|image|>",
        ),
        roles=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>"),
    ),
    "llama-4": TinySpec(
        "Llama4Processor",
        "llama4.jinja",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|header_start|>",
            "<|header_end|>",
            "<|eot|>",
            "<|eom|>",
            "<|python_start|>",
            "<|python_end|>",
            "<|finetune_right_pad|>",
            "<|image_start|>",
            "<|image_end|>",
            "<|image|>",
            "<|patch|>",
            "<|tile_x_separator|>",
            "<|tile_y_separator|>",
        ),
        roles=dict(bos_token="<|begin_of_text|>", eos_token="<|eot|>", pad_token="<|finetune_right_pad|>"),
    ),
    "mistral-3": TinySpec(
        "PixtralProcessor",
        "mistral3.jinja",
        (
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[TOOL_CALLS]",
            "[IMG]",
            "<pad>",
            "[IMG_BREAK]",
            "[IMG_END]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ),
        roles=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"),
    ),
    "gemma-3": TinySpec(
        "Gemma3Processor",
        "gemma3.jinja",
        (
            "<pad>",
            "<eos>",
            "<bos>",
            "<unk>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ),
        roles=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        extra=dict(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>"),
    ),
    "gemma-4": TinySpec(
        "Gemma4Processor",
        "gemma4.jinja",
        (
            "<pad>",
            "<eos>",
            "<bos>",
            "<unk>",
            "<|turn>",
            "<turn|>",
            "<|image>",
            "<image|>",
            "<|image|>",
            "<|video|>",
            "<|audio>",
            "<audio|>",
            "<|audio|>",
            "<|channel>",
            "<channel|>",
            "<|think|>",
        ),
        roles=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        extra=dict(
            image_token="<|image|>",
            boi_token="<|image>",
            eoi_token="<image|>",
            video_token="<|video|>",
            audio_token="<|audio|>",
            boa_token="<|audio>",
            eoa_token="<audio|>",
        ),
    ),
    "glm-4.1v": TinySpec(
        "Glm4vProcessor",
        "glm4v.jinja",
        (
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<|begin_of_image|>",
            "<|end_of_image|>",
            "<|image|>",
            "<|begin_of_video|>",
            "<|end_of_video|>",
            "<|video|>",
        ),
        plain=("<think>", "</think>", "<answer>", "</answer>"),
        roles=dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
    ),
    "internvl": TinySpec(
        "InternVLProcessor",
        "internvl.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        extra=dict(
            start_image_token="<img>",
            end_image_token="</img>",
            context_image_token="<IMG_CONTEXT>",
            video_token="<video>",
        ),
    ),
    "llava-onevision": TinySpec(
        "LlavaOnevisionProcessor",
        "llava_onevision.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        extra=dict(image_token="<image>", video_token="<video>"),
    ),
    "smolvlm": TinySpec(
        "Idefics3Processor",
        "smolvlm.jinja",
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<fake_token_around_image>",
            "<image>",
            "<end_of_utterance>",
            "<global-img>",
        )
        + _ROWCOL,
        roles=dict(
            bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>", unk_token="<|endoftext|>"
        ),
    ),
}


def tiny_names() -> list[str]:
    """The names `--processor tiny:NAME` accepts (the builtin names, and every family without a builtin)."""
    return list(SPECS)


def _bpe_merges(n: int = 160) -> list[tuple[str, str]]:
    """Deterministic byte-level BPE merges over _CORPUS: most frequent pair first, ties by the pair itself."""
    from tokenizers.pre_tokenizers import ByteLevel

    words = collections.Counter(w for w, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(_CORPUS))
    seqs = {w: list(w) for w in words}
    merges = []
    for _ in range(n):
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def _tokenizer(spec: TinySpec, template: str):
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    merges = _bpe_merges()
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    if spec.pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # the pipeline its class builds: a save and load leaves it as it is
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    added = spec.mixed or tuple((t, True) for t in spec.specials) + tuple((t, False) for t in spec.plain)
    for token, special in added:  # one at a time: each gets the next id, in the listed order
        (backend.add_special_tokens if special else backend.add_tokens)(
            [AddedToken(token, special=special, normalized=False)]
        )
    tok = getattr(transformers, spec.tokenizer_class)(
        tokenizer_object=backend,
        extra_special_tokens=dict(spec.extra),
        clean_up_tokenization_spaces=False,
        **spec.roles,
    )
    tok.chat_template = template
    return tok


def _image_processors(name: str):
    """(image processor, video processor or None, processor kwargs): the published checkpoint's settings."""
    import transformers as T

    if name in ("qwen2-vl", "qwen2.5-vl"):  # Qwen2-VL-7B / Qwen2.5-VL-7B-Instruct
        return T.Qwen2VLImageProcessor(**QWEN2_VL_IMAGE), T.Qwen2VLVideoProcessor(), {}
    if name in ("qwen3-vl", "qwen3.5"):  # Qwen3-VL-8B-Instruct, Qwen3.5-35B-A3B
        return (
            T.Qwen2VLImageProcessor(**QWEN3_VL_IMAGE),
            T.Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
            {},
        )
    if name == "llama-3.2-vision":  # Llama-3.2-11B-Vision-Instruct: 560 px tiles, up to 4
        return T.MllamaImageProcessor(size={"height": 560, "width": 560}, max_image_tiles=4), None, {}
    if name == "llama-4":  # Llama-4-Scout-17B-16E-Instruct: 336 px tiles, up to 16
        return T.Llama4ImageProcessor(), None, dict(patch_size=14, pixel_shuffle_ratio=0.5)
    if name == "mistral-3":  # Mistral-Small-3.1: patch 14, 2x2 spatial merge, longest edge 1540
        ip = T.PixtralImageProcessor(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14})
        return ip, None, dict(patch_size=14, spatial_merge_size=2)
    if name == "gemma-3":  # google/gemma-3-4b-it: SigLIP 896, 256 soft tokens per image
        ip = T.Gemma3ImageProcessor(
            size={"height": 896, "width": 896},
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
            resample=2,
            do_pan_and_scan=False,
        )
        return ip, None, dict(image_seq_length=256)
    if name == "gemma-4":  # google/gemma-4-E4B-it: 16 px patches, 280 soft tokens (3 x 3 pooling), aspect kept
        return (
            T.Gemma4ImageProcessor(patch_size=16, max_soft_tokens=280, pooling_kernel_size=3),
            T.Gemma4VideoProcessor(),
            dict(feature_extractor=T.Gemma4AudioFeatureExtractor()),
        )
    if name == "glm-4.1v":  # GLM-4.1V-9B-Thinking: patch 14, merge 2, temporal 2
        ip = T.Glm4vImageProcessor(
            size={"shortest_edge": 12544, "longest_edge": 9633792}, patch_size=14, merge_size=2, temporal_patch_size=2
        )
        return ip, T.Glm4vVideoProcessor(), {}
    if name == "internvl":  # InternVL3-1B-hf: 448 px tiles, 256 tokens each, up to 12 tiles + thumbnail
        ip = T.GotOcr2ImageProcessor(
            size={"height": 448, "width": 448},
            crop_to_patches=True,
            min_patches=1,
            max_patches=12,
            image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225],
        )
        return ip, T.InternVLVideoProcessor(), dict(image_seq_length=256)
    if name == "llava-onevision":  # llava-onevision-qwen2-0.5b-ov-hf: SigLIP 384, 729 tokens per crop
        return (
            T.LlavaOnevisionImageProcessor(),
            T.LlavaOnevisionVideoProcessor(),
            dict(num_image_tokens=729, vision_feature_select_strategy="full"),
        )
    if name == "smolvlm":  # SmolVLM-256M-Instruct: 512 px tiles, 64 tokens each
        ip = T.Idefics3ImageProcessor(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
        return ip, None, dict(image_seq_len=64)
    raise AssertionError(f"no image processor for tiny:{name}")


def source_files(name: str) -> tuple[bytes, str]:
    """What the build reads (the spec, corpus and builder version; the template): hashed into the cache key by
    vlmprep.processors.builtin."""
    spec = SPECS[name]
    data = json.dumps([BUILDER_VERSION, _CORPUS, spec.__dict__], sort_keys=True, default=list).encode()
    return data, (TEMPLATES / spec.template).read_text(encoding="utf-8")


def make_processor(name: str, template: str) -> ProcessorMixin:
    """The tiny processor `name` with `template`, built offline."""
    import transformers as T

    spec = SPECS[name]
    image, video, kwargs = _image_processors(name)
    parts = dict(image_processor=image, tokenizer=_tokenizer(spec, template), chat_template=template, **kwargs)
    if video is not None:
        parts["video_processor"] = video
    return getattr(T, spec.processor_class)(**parts)


def spec_digest(name: str) -> str:
    """A short digest of the tiny spec `name` (what the manifest records beside `tiny:NAME`)."""
    data, template = source_files(name)
    return hashlib.sha256(data + template.encode("utf-8")).hexdigest()[:16]
