"""A saved processor dir from a dataset (docs/untrusted-datasets.md): its own files (inside it, bounded), no custom
code, sane pixel sizes, and only class names transformers has; vlmprep and the trainer both check a dir through it
before transformers loads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vlmprep_schemas.boundary import UnsafeDataset, _inside

# A processor's own files, as transformers saves and reads them (tokenizer vocabularies of every backend, chat
# templates): all that is read from a processor dir, and all that `trainer export` copies. Anything else is ignored.
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
    "chat_template.jinja",
    "chat_template.json",
)
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # its *.jinja files are the processor's named chat templates
# Where transformers looks for `auto_map` (the custom code it would import, after a "run custom code? [y/N]" prompt
# when trust_remote_code is unset): config.json too, which AutoProcessor falls back to.
CODE_CONFIGS = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
    "config.json",
)
MAX_CONFIG_BYTES = 64 << 20  # a processor config this large is not one (tokenizer_config.json is KBs to a few MB)
MAX_VOCAB_BYTES = 512 << 20  # tokenizer.json, vocab.json, tekken.json: tens of MB for the largest vocabularies
MAX_JSON_DEPTH = 64  # a processor's JSON nests under 12 levels; 10^5 levels crash the parsers that read it
# Sizes a processor's pixel math divides by or allocates from: positive integers, or dicts of them ("size").
POSITIVE_SIZES = frozenset(
    {
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "spatial_merge_size",
        "size",
        "min_pixels",
        "max_pixels",
        "image_seq_length",
        "tile_size",
        "max_image_tiles",
        "crop_size",
        "max_patches",
        "image_size",
        "max_soft_tokens",  # Gemma 4's patch budget, with pooling_kernel_size
        "pooling_kernel_size",
        "max_image_size",  # Idefics3 / SmolVLM's tile: {"longest_edge": N}
    }
)
# Sizes whose processor code grows faster than the value: Mllama lists every tile arrangement, max_image_tiles^2 of
# them (4 in every released checkpoint; 10^6 would hang each reader that resizes an image).
MOST_SIZES = {"max_image_tiles": 1024}


def refuse_custom_code(config, where: str) -> None:
    """Refuse a processor config (as read from `where`) that names custom code anywhere in it (`auto_map`, top level
    or nested, e.g. processor_config.json's image_processor): one line, before transformers ever sees it."""
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("auto_map"):
                shown = json.dumps(node["auto_map"])
                raise UnsafeDataset(
                    f"{where}: asks to run custom code (auto_map {shown[:120]}"
                    f"{'...' if len(shown) > 120 else ''}); vlmprep and the trainer never run code "
                    "from a dataset or processor dir: use a processor built into transformers"
                )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def refuse_bad_sizes(config, where: str) -> None:
    """Refuse a processor config whose sizes (POSITIVE_SIZES, at any depth) are not positive integers, or over
    MOST_SIZES: a patch_size of 0 or -14 would be a ZeroDivisionError or a negative shape deep in the pixel math,
    naming no file."""
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            values = value.values() if isinstance(value, dict) and key in POSITIVE_SIZES else [value]
            if key in POSITIVE_SIZES and any(
                v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0) for v in values
            ):
                raise UnsafeDataset(
                    f"{where}: {key} {json.dumps(value)[:80]} is not a positive integer; refusing to "
                    "load the processor (save it again from the model's own processor)"
                )
            if key in MOST_SIZES and isinstance(value, int) and value > MOST_SIZES[key]:
                raise UnsafeDataset(
                    f"{where}: {key} {value} is over {MOST_SIZES[key]}; refusing to load the processor (save it again "
                    "from the model's own processor)"
                )
            if isinstance(value, (dict, list)):
                stack.append(value)


# The config keys that name a transformers class: what AutoProcessor and its parts resolve the dir's classes by.
CLASS_KEYS = (
    "processor_class",
    "tokenizer_class",
    "image_processor_type",
    "video_processor_type",
    "feature_extractor_type",
)


def refuse_unknown_classes(config, where: str) -> None:
    """Refuse a processor config (as read from `where`) that names a class (CLASS_KEYS, at any depth) transformers
    does not have: one line naming the class and the file, where transformers would fail deep inside or quietly load
    another class (a bare tokenizer in a processor's place: an AttributeError far from here). Imports transformers."""
    import transformers
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    def known(key: str, name) -> bool:
        if not isinstance(name, str):
            return False
        if key == "tokenizer_class":
            return tokenizer_class_from_name(name) is not None
        try:  # image and video processors are saved with a "Fast" suffix transformers 5 dropped
            return isinstance(getattr(transformers, name.removesuffix("Fast"), None), type)
        except ImportError:  # a class whose module needs a package this environment lacks: it exists
            return True

    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)):
            stack.extend(node.values() if isinstance(node, dict) else node)
        for key in CLASS_KEYS if isinstance(node, dict) else ():
            if node.get(key) is not None and not known(key, node[key]):
                raise UnsafeDataset(
                    f"{where}: {key} {json.dumps(node[key])[:80]} is not a class transformers has; refusing to load "
                    "the processor (save it again from the model's own processor)"
                )


def check_processor_classes(d: str | Path) -> None:
    """refuse_unknown_classes over each config of processor dir `d` (what its loaders call before transformers)."""
    for f in (Path(d) / n for n in CODE_CONFIGS):
        if f.is_file():
            refuse_unknown_classes(_read_json(f, MAX_CONFIG_BYTES), str(f))


def _read_json(path: Path, max_bytes: int, *, parse: bool = True):
    """A processor's JSON file, bounded in size and nesting before it is parsed (transformers parses it again);
    `parse` False: checked only (a vocabulary's tens of MB are parsed once, by the tokenizer's loader)."""
    from vlmprep_schemas.limits import json_depth

    size = path.stat().st_size
    if size > max_bytes:
        raise UnsafeDataset(
            f"{path}: {size} bytes, more than a processor file holds (at most {max_bytes >> 20} MiB); "
            "refusing to read it"
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
        depth = json_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise UnsafeDataset(
                f"{path}: JSON nested {depth} levels deep (a processor file nests under "
                f"{MAX_JSON_DEPTH}); refusing to load the processor"
            )
        return json.loads(text) if parse else None
    except (ValueError, RecursionError) as e:
        if isinstance(e, UnsafeDataset):
            raise
        raise UnsafeDataset(f"{path}: not valid JSON ({type(e).__name__}); refusing to load the processor") from None


def processor_files(d: str | Path, *, links_out: bool = False, vocab: bool = True) -> list[Path]:
    """A saved processor's own files in dir `d` (PROCESSOR_FILES and additional_chat_templates/*.jinja that exist):
    what may be read from it and what `trainer export` copies. Refused unless each, and each config transformers
    reads, resolves inside `d` (no symlink out), and no config asks for custom code (refuse_custom_code).
    `links_out=True` is for a dir the user named (--processor): symlinks out are followed (a Hugging Face cache
    snapshot links every file into blobs/), custom code is still refused."""
    d = Path(d)
    files = [d / n for n in PROCESSOR_FILES if os.path.lexists(d / n)]
    if (d / CHAT_TEMPLATES_DIR).is_dir():
        files += sorted((d / CHAT_TEMPLATES_DIR).glob("*.jinja"))
    configs = [d / n for n in CODE_CONFIGS if os.path.lexists(d / n)]
    for f in dict.fromkeys(files + configs):
        if not links_out and not _inside(str(f), str(d)):
            raise UnsafeDataset(
                f"{f}: resolves to {os.path.realpath(f)}, outside the processor dir "
                f"{os.path.realpath(d)} (a symlink); refusing to read it: copy the file in"
            )
        if not f.is_file():
            raise UnsafeDataset(f"{f}: not a regular file; refusing to read the processor")
    for f in configs:
        config = _read_json(f, MAX_CONFIG_BYTES)
        refuse_custom_code(config, str(f))
        refuse_bad_sizes(config, str(f))
    for f in files:  # tokenizer.json and the other vocabularies: size and depth (`vocab` False: a dataset opened
        # to read its shards, whose tokenizer nobody loads, is not made to read tens of MB)
        big = f.name in ("tokenizer.json", "vocab.json", "tekken.json")
        if f.suffix == ".json" and f not in configs and (vocab or not big):
            _read_json(f, MAX_VOCAB_BYTES if big else MAX_CONFIG_BYTES, parse=not big)
    return files
