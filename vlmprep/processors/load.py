"""Processor resolution: `builtin:NAME`, a local processor dir, or a hub id -> a loaded HF processor;
plus saving it into the dataset dir so the shards carry the exact processor that made them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from vlmprep_schemas.boundary import UnsafeDataset, fresh_state_dir
from vlmprep_schemas.processor_dir import check_processor_classes, processor_files

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
    raise ValueError(
        f"--chat-template {value}: no such file or bundled template; pass a .jinja file or one of "
        + ", ".join(bundled_templates())
    )


def load_processor(spec: str):
    """--processor value -> a transformers processor: `builtin:NAME` or `tiny:NAME` built offline (cached), a local
    dir loaded without code (load_saved_processor), else a hub id (the only path that may use the network; never
    remote code). A path that does not exist or an unknown builtin is a one-line ValueError."""
    from transformers import AutoProcessor

    if spec.startswith("builtin:"):
        from vlmprep.processors.builtin import build_builtin_processor, builtin_names

        name = spec.split(":", 1)[1]
        if name not in builtin_names():
            raise ValueError(
                f"unknown builtin processor {spec!r}: choose one of "
                + ", ".join(f"builtin:{n}" for n in builtin_names())
            )
        return build_builtin_processor(name)
    if spec.startswith("tiny:"):  # the family's real classes over a small vocabulary: for trying it and tests
        from vlmprep.processors.builtin import build_builtin_processor

        return build_builtin_processor(spec)
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
        raise ValueError(
            f"--processor {spec}: not a local directory, and loading it as a hub id failed: {first}"
        ) from e


def load_saved_processor(path: str | Path):
    """A processor from a local dir (e.g. the copy save_processor wrote into a dataset), never the network and never
    code: a dir whose configs ask for custom code (auto_map), or whose files link outside it, is refused in one line
    (UnsafeDataset, a ValueError) before transformers reads it."""
    from vlmprep.processors.builtin import from_local_dir

    processor_files(path)
    check_processor_classes(path)
    try:
        processor = from_local_dir(path)
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise anything (their Rust: plain Exception)
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnsafeDataset(
            f"{path}: cannot load the processor saved there ({type(e).__name__}: {text[:200]}); "
            "save it again from the model's own processor"
        ) from None
    if getattr(processor, "tokenizer", None) is None:  # transformers falls back to a bare tokenizer
        raise UnsafeDataset(
            f"{path}: loads as a {type(processor).__name__}, not a processor (no processor_config.json naming its "
            "class?); save it again from the model's own processor"
        )
    return processor


def vocab_size(processor) -> int:
    """Every token id the processor's tokenizer gives is below this (its length, or one past its highest id where
    the ids have holes): the manifest records it, and verify checks each sample's ids against the saved copy's."""
    tok = processor.tokenizer
    return max(len(tok), 1 + max(tok.get_vocab().values(), default=-1))


def fingerprint_dir(path: Path) -> str:
    """A processor dir -> the sha256 over its files' relative names and contents (what the plan records)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def save_processor(processor, dest: Path, *, expect: str | None = None) -> str:
    """Save atomically into dest, replacing a different older copy; returns the content fingerprint. Safe when
    several task processes save the same processor at once: each writes its own temp dir, and an identical copy
    already in place is kept. `expect`: the fingerprint dest must keep (an append's dataset): a processor that saves
    to another is not put in place, and its fingerprint is returned for the caller to refuse."""
    dest = Path(dest)
    tmp = fresh_state_dir(dest.with_name(f"{dest.name}.{os.getpid()}.tmp"))  # a link planted there: removed
    processor.save_pretrained(str(tmp))
    fingerprint = fingerprint_dir(tmp)
    if (dest.exists() and fingerprint_dir(dest) == fingerprint) or (expect is not None and fingerprint != expect):
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
        raise ValueError(
            f"--min-pixels/--max-pixels: {type(processor).__name__} has no pixel budget to set (only "
            "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4.1V resize within min/max pixels)"
        )
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
        raise ValueError(
            f"--video-fps/--video-max-frames: {type(processor).__name__} has no video support in vlmprep "
            "(Qwen2-VL, Qwen2.5-VL and Qwen3-VL have)"
        )
    vp.do_sample_frames = True
    vp.fps = float(fps or getattr(vp, "fps", None) or default_fps)
    vp.num_frames = None  # fps and num_frames exclude each other in sample_frames; the build samples by fps
    if max_frames is not None:
        vp.max_frames = max_frames
