"""Processor resolution: `builtin:NAME`, a local processor dir, or a hub id -> a loaded HF processor;
plus saving it into the dataset dir so the shards carry the exact processor that made them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from vlmprep_schemas.boundary import processor_files

TEMPLATES_DIR = Path(__file__).parent.parent / "templates"


def bundled_templates() -> list[str]:
    """Names of the chat templates shipped in vlmprep/templates (installed with the package)."""
    return sorted(p.name[: -len(".jinja")] for p in TEMPLATES_DIR.glob("*.jinja"))


def resolve_chat_template(value: str) -> Path:
    """--chat-template: an existing file, else the name of a bundled template (`qwen2_vl_tools` =
    vlmprep/templates/qwen2_vl_tools.jinja), so a pip-installed vlmprep reaches them without knowing where they are."""
    path = Path(value)
    if path.is_file():
        return path
    name = value[: -len(".jinja")] if value.endswith(".jinja") else value
    if "/" not in name and "\\" not in name and (TEMPLATES_DIR / f"{name}.jinja").is_file():
        return TEMPLATES_DIR / f"{name}.jinja"
    raise ValueError(f"--chat-template {value}: no such file or bundled template; pass a .jinja file or one of "
                     + ", ".join(bundled_templates()))


def load_processor(spec: str):
    """--processor value -> a transformers processor: `builtin:NAME` built offline (cached), a local dir loaded
    without code (load_saved_processor), else a hub id (the only path that may use the network; never remote code). A
    path that does not exist or an unknown builtin is a one-line ValueError."""
    from transformers import AutoProcessor

    if spec.startswith("builtin:"):
        from vlmprep.processors.builtin import build_builtin_processor, builtin_names

        name = spec.split(":", 1)[1]
        if name not in builtin_names():
            raise ValueError(f"unknown builtin processor {spec!r}: choose one of "
                             + ", ".join(f"builtin:{n}" for n in builtin_names()))
        return build_builtin_processor(name)
    if Path(spec).is_dir():
        return load_saved_processor(spec)
    if Path(spec).exists():
        raise ValueError(f"--processor {spec} is a file: pass a processor directory, a hub id or builtin:NAME")
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec:  # a path, never a hub id "org/name"
        raise ValueError(f"--processor {spec}: no such directory; pass a processor directory, a hub id or builtin:NAME")
    # A hub id: the one path that may use the network, and only when the user asks for it. Never its custom code:
    # trust_remote_code=False refuses it without transformers' interactive prompt.
    try:
        return AutoProcessor.from_pretrained(spec, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--processor {spec}: not a local directory, and loading it as a hub id failed: "
                         f"{first}") from e


def load_saved_processor(path: str | Path):
    """A processor from a local dir (e.g. the copy save_processor wrote into a dataset), never the network and never
    code: a dir whose configs ask for custom code (auto_map), or whose files link outside it, is refused in one line
    (UnsafeDataset, a ValueError) before transformers reads it."""
    processor_files(path)
    return from_local_dir(path)


def from_local_dir(path: str | Path):
    """AutoProcessor.from_pretrained of a local dir, its tokenizer read from tokenizer.json by the tokenizers library
    alone (~1 s of CPU for a 150k vocabulary, against ~3.5 s; most of a task or Ray worker's start-up). transformers'
    own load parses that 18 MB file with Python's json twice more (once for the added tokens the file's backend
    already carries, once to rebuild the BPE from its vocabulary and merges in the class's __init__). Here the
    tokenizer is the same class, made by the same from_pretrained, with the file handed to the Rust loader as
    transformers does for a class without its own __init__; tests/vlmprep/processors/test_load.py checks it equals the
    slow load for every builtin. Anything else (no tokenizer.json, a tokenizer or processor class transformers does
    not name, a sentencepiece or Mistral tokenizer) takes the slow load."""
    from transformers import AutoProcessor

    classes = _fast_classes(Path(path))
    if classes is None:
        return AutoProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    processor_cls, tokenizer_cls = classes
    # Runtime subclasses, so that transformers' from_pretrained does all the rest; their instances get the real
    # classes back at once.
    fast_tokenizer_cls = type(tokenizer_cls.__name__, (tokenizer_cls,), {"__module__": tokenizer_cls.__module__})
    tokenizer = fast_tokenizer_cls.from_pretrained(str(path), local_files_only=True, trust_remote_code=False,
                                                   added_tokens_decoder={})  # the file's backend has them all
    tokenizer.__class__ = tokenizer_cls

    def given_tokenizer(cls, sub_processor_type, *args, **kwargs):
        return tokenizer

    fast_processor_cls = type(processor_cls.__name__, (processor_cls,), {
        "__module__": processor_cls.__module__, "_load_tokenizer_from_pretrained": classmethod(given_tokenizer)})
    processor = fast_processor_cls.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    processor.__class__ = processor_cls
    return processor


def _fast_classes(d: Path):
    """(processor class, tokenizer class) where from_local_dir's fast path applies to dir d, else None."""
    import transformers
    from transformers import ProcessorMixin
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        tok_name = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
        proc_name = json.loads((d / "processor_config.json").read_text(encoding="utf-8")).get("processor_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not (d / "tokenizer.json").is_file() or not isinstance(tok_name, str) or not isinstance(proc_name, str):
        return None
    tokenizer_cls = tokenizer_class_from_name(tok_name)
    processor_cls = getattr(transformers, proc_name, None)
    if (not isinstance(tokenizer_cls, type) or not issubclass(tokenizer_cls, TokenizersBackend)
            or not isinstance(processor_cls, type) or not issubclass(processor_cls, ProcessorMixin)
            or [a for a in processor_cls.get_attributes() if "tokenizer" in a] != ["tokenizer"]
            or "Pixtral" in proc_name):
        return None  # PixtralProcessor loads its tokenizer itself, not through _load_tokenizer_from_pretrained
    return processor_cls, tokenizer_cls


def fingerprint_dir(path: Path) -> str:
    """A processor dir -> the sha256 over its files' relative names and contents (what the plan records)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def save_processor(processor, dest: Path) -> str:
    """Save atomically into dest, replacing a different older copy; returns the content fingerprint. Safe when
    several task processes save the same processor at once: each writes its own temp dir, and an identical copy
    already in place is kept."""
    dest = Path(dest)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    processor.save_pretrained(str(tmp))
    fingerprint = fingerprint_dir(tmp)
    if dest.exists() and fingerprint_dir(dest) == fingerprint:
        shutil.rmtree(tmp)
        return fingerprint
    if dest.exists():
        old = dest.with_name(f"{dest.name}.{os.getpid()}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, dest)
    except OSError:  # another process put its copy in place first
        if fingerprint_dir(dest) != fingerprint:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return fingerprint


def apply_pixel_budget(processor, family, *, min_pixels: int | None, max_pixels: int | None) -> None:
    """Set the image processor's resize budget (Qwen-VL min/max pixels) on the processor itself, so the copy saved
    into the dataset resizes exactly as the build did; refused for processors that have no such knob."""
    if min_pixels is None and max_pixels is None:
        return
    ip = getattr(processor, "image_processor", None)
    size = getattr(ip, "size", None)
    if family is None or not family.grid_images or getattr(size, "longest_edge", None) is None:
        raise ValueError(f"--min-pixels/--max-pixels: {type(processor).__name__} has no pixel budget to set (only "
                         "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4.1V resize within min/max pixels)")
    from transformers.image_utils import SizeDict

    ip.size = SizeDict(shortest_edge=min_pixels or size.shortest_edge, longest_edge=max_pixels or size.longest_edge)
    if ip.size.shortest_edge > ip.size.longest_edge:
        raise ValueError(f"--min-pixels {ip.size.shortest_edge} > --max-pixels {ip.size.longest_edge}: swap them")


def apply_video_budget(processor, family, *, fps: float | None, max_frames: int | None, default_fps: float) -> None:
    """Set the build's frame sampling on the video processor itself (its sample_frames reads it from self):
    do_sample_frames on, fps = --video-fps, else its own fps, else `default_fps` (the rate the build samples at),
    and --video-max-frames. So the copy saved into the dataset (and `trainer export`'s) samples a source video as
    the build did. --video-fps / --video-max-frames are refused for families without video support."""
    vp = getattr(processor, "video_processor", None)
    if family is None or family.video is None or vp is None:
        if fps is None and max_frames is None:
            return
        raise ValueError(f"--video-fps/--video-max-frames: {type(processor).__name__} has no video support in vlmprep "
                         "(Qwen2-VL, Qwen2.5-VL and Qwen3-VL have)")
    vp.do_sample_frames = True
    vp.fps = float(fps or getattr(vp, "fps", None) or default_fps)
    vp.num_frames = None  # fps and num_frames exclude each other in sample_frames; the build samples by fps
    if max_frames is not None:
        vp.max_frames = max_frames
