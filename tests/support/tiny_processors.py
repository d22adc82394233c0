"""Tiny offline processors for tests: each family's real transformers processor class, official chat template and
exact special tokens, over a small byte-level BPE vocab. Token ids are NOT the official ones: never train with these.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[2] / "vlmprep" / "templates"
BUILDER_VERSION = 1

# A fixed corpus for the merges: plain English and JSON, enough that words and "\n\n" become single tokens.
_CORPUS = """You are a helpful assistant. Describe the image. What is in this picture? The page shows a red square
and a green banner. I will click the button. Done: the page is open. Clicked. Scroll down to see more.
The screenshot now shows the search results. {"name": "click", "arguments": {"x": 3, "y": 12}}
Thinking about it, the answer is yes. Here is what I see: a cat, a dog and a chart with numbers 1 2 3 4.


Open the page, then type the query and press enter. The form was submitted. Thank you!"""


@dataclass(frozen=True)
class TinySpec:
    processor_class: str
    template: str  # file under vlmprep/templates
    specials: tuple[str, ...]  # special=True added tokens, in id order after the byte-level vocab
    plain: tuple[str, ...] = ()  # added tokens with special=False (as the official tokenizer_config has them)
    roles: dict = field(default_factory=dict)  # bos/eos/pad/unk -> token
    extra: dict = field(default_factory=dict)  # named extra special tokens the processor reads (image_token, ...)


_ROWCOL = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))

SPECS: dict[str, TinySpec] = {
    "gemma3": TinySpec(
        "Gemma3Processor", "gemma3.jinja",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
         "<image_soft_token>"),
        roles=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"),
        extra=dict(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>")),
    "llama3.2-vision": TinySpec(
        "MllamaProcessor", "llama3_2_vision.jinja",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>", "<|image|>"),
        roles=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")),
    "llama4": TinySpec(
        "Llama4Processor", "llama4.jinja",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>",
         "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>", "<|image_start|>", "<|image_end|>",
         "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"),
        roles=dict(bos_token="<|begin_of_text|>", eos_token="<|eot|>", pad_token="<|finetune_right_pad|>")),
    "mistral3-pixtral": TinySpec(
        "PixtralProcessor", "mistral3.jinja",
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
         "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[SYSTEM_PROMPT]",
         "[/SYSTEM_PROMPT]"),
        roles=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")),
    "idefics3-smolvlm": TinySpec(
        "Idefics3Processor", "smolvlm.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
         "<global-img>") + _ROWCOL,
        roles=dict(bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>",
                   unk_token="<|endoftext|>")),
    "llava-onevision": TinySpec(
        "LlavaOnevisionProcessor", "llava_onevision.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        extra=dict(image_token="<image>", video_token="<video>")),
    "internvl": TinySpec(
        "InternVLProcessor", "internvl.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
        roles=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        extra=dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>",
                   video_token="<video>")),
    "glm-4.1v": TinySpec(
        "Glm4vProcessor", "glm4v.jinja",
        ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
         "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"),
        plain=("<think>", "</think>", "<answer>", "</answer>"),
        roles=dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")),
}


def tiny_names() -> list[str]:
    return list(SPECS)


def _bpe_merges(n: int = 160) -> list[tuple[str, str]]:
    """Deterministic byte-level BPE merges over _CORPUS: most frequent pair first, ties by the pair itself."""
    from tokenizers.pre_tokenizers import ByteLevel

    words = collections.Counter(w for w, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(_CORPUS))
    seqs = {w: list(w) for w in words}
    merges = []
    for _ in range(n):
        pairs = collections.Counter()
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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    merges = _bpe_merges()
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, extra_special_tokens=dict(spec.extra),
                                  clean_up_tokenization_spaces=False, **spec.roles)
    tok.chat_template = template
    return tok


def _processor(name: str, spec: TinySpec):
    import transformers as T

    template = (TEMPLATES / spec.template).read_text(encoding="utf-8")
    tok = _tokenizer(spec, template)
    cls = getattr(T, spec.processor_class)
    if name == "gemma3":  # google/gemma-3-4b-it preprocessor: SigLIP 896, 256 soft tokens per image
        ip = T.Gemma3ImageProcessor(size={"height": 896, "width": 896}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                    resample=2, do_pan_and_scan=False)
        return cls(image_processor=ip, tokenizer=tok, chat_template=template, image_seq_length=256)
    if name == "llama3.2-vision":
        return cls(image_processor=T.MllamaImageProcessor(), tokenizer=tok, chat_template=template)
    if name == "llama4":
        return cls(image_processor=T.Llama4ImageProcessor(), tokenizer=tok, chat_template=template, patch_size=14,
                   pixel_shuffle_ratio=0.5)
    if name == "mistral3-pixtral":  # Mistral-Small-3.1: patch 14, 2x2 spatial merge, longest edge 1540
        ip = T.PixtralImageProcessor(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14})
        return cls(image_processor=ip, tokenizer=tok, chat_template=template, patch_size=14, spatial_merge_size=2)
    if name == "idefics3-smolvlm":  # SmolVLM-256M-Instruct: 512 px tiles, 64 tokens each
        ip = T.Idefics3ImageProcessor(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
        return cls(image_processor=ip, tokenizer=tok, chat_template=template, image_seq_len=64)
    if name == "llava-onevision":  # llava-onevision-qwen2-0.5b-ov-hf: SigLIP 384, 729 tokens per crop
        return cls(image_processor=T.LlavaOnevisionImageProcessor(), tokenizer=tok,
                   video_processor=T.LlavaOnevisionVideoProcessor(), chat_template=template, num_image_tokens=729,
                   vision_feature_select_strategy="full")
    if name == "internvl":  # InternVL3-1B-hf: 448 px tiles, 256 tokens each, up to 12 tiles + thumbnail
        ip = T.GotOcr2ImageProcessor(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1,
                                     max_patches=12, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
        return cls(image_processor=ip, tokenizer=tok, video_processor=T.InternVLVideoProcessor(),
                   chat_template=template, image_seq_length=256)
    if name == "glm-4.1v":  # GLM-4.1V-9B-Thinking: patch 14, merge 2, temporal 2
        ip = T.Glm4vImageProcessor(size={"shortest_edge": 12544, "longest_edge": 9633792}, patch_size=14,
                                   merge_size=2, temporal_patch_size=2)
        return cls(image_processor=ip, tokenizer=tok, video_processor=T.Glm4vVideoProcessor(), chat_template=template)
    raise AssertionError(f"no builder for {name}")


def _key(name: str) -> str:
    import transformers

    h = hashlib.sha256()
    spec = SPECS[name]
    for part in (name, str(BUILDER_VERSION), transformers.__version__, json.dumps(spec.__dict__, sort_keys=True),
                 (TEMPLATES / spec.template).read_text(encoding="utf-8"), _CORPUS):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def build_tiny_processor(name: str, cache_dir: str | None = None):
    """Build once into cache_dir (default $VLMPREP_CACHE or a temp dir) with save_pretrained, then load it back with
    AutoProcessor.from_pretrained, so the local-directory path every real processor takes is the one exercised."""
    from transformers import AutoProcessor

    if name not in SPECS:
        raise ValueError(f"unknown tiny family {name!r}: choose one of {', '.join(SPECS)}")
    root = Path(cache_dir or os.environ.get("VLMPREP_CACHE") or tempfile.gettempdir()) / "tiny"
    final = root / f"{name}-{_key(name)}"
    if not (final / "processor_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.tmp-"))
        try:
            _processor(name, SPECS[name]).save_pretrained(str(tmp))
            try:
                os.replace(tmp, final)
            except OSError:
                if not (final / "processor_config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoProcessor.from_pretrained(str(final), local_files_only=True)


@functools.lru_cache(maxsize=None)
def load_family_processor(name: str):
    """Any family by name: the real-vocab builtins (qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3.5) or a tiny one above."""
    from vlmprep.processors.builtin import build_builtin_processor, builtin_names

    if name in builtin_names():
        return build_builtin_processor(name)
    return build_tiny_processor(name)
