"""The builtin processors (`--processor builtin:NAME`): each is built offline by its vendor module (qwen.py,
mistral.py, llama.py) from the vocabulary and template files it reads, saved once into an on-disk cache keyed by
those files, and loaded back from there.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers import ProcessorMixin

log = logging.getLogger(__name__)

# Bump whenever a build would produce different files from the same inputs; it is part of the cache key.
BUILDER_VERSION = 2  # 2: image processors carry the published checkpoint settings, not the class defaults
MARKER_FILE = "vlmprep_builtin.json"

QWEN_BUILTINS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")  # built by vlmprep/processors/qwen.py
# Built by vlmprep/processors/mistral.py and llama.py, checked against the vendors' reference encoders.
VENDOR_BUILTINS = ("mistral-3", "llama-3.2-vision", "llama-4")


def builtin_names() -> list[str]:
    """The names `--processor builtin:NAME` accepts."""
    return list(QWEN_BUILTINS) + list(VENDOR_BUILTINS)


def default_cache_dir() -> Path:
    """Where the builtins are cached: $VLMPREP_CACHE, else ~/.cache/vlmprep."""
    env = os.environ.get("VLMPREP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vlmprep"


def build_builtin_processor(name: str, cache_dir: Path | None = None) -> ProcessorMixin:
    """The processor for builtin `name`, built on first use and then loaded from `cache_dir`."""
    from vlmprep.processors.load import from_local_dir

    return from_local_dir(builtin_dir(name, cache_dir))


def builtin_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The cached processor dir of builtin `name` in `cache_dir`, built there first if missing."""
    if name in QWEN_BUILTINS:
        from vlmprep.processors import qwen as vendor
    elif name == "mistral-3":
        from vlmprep.processors import mistral as vendor
    elif name in VENDOR_BUILTINS:
        from vlmprep.processors import llama as vendor
    else:
        raise ValueError(f"unknown builtin processor {name!r}: choose one of {', '.join(builtin_names())}")
    data, template = vendor.source_files(name)
    key = _cache_key(name, data, template)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{name}-{key[:16]}"
    if not (final / MARKER_FILE).is_file():
        _build_into(final, name, key, lambda: vendor.make_processor(name, template))
    return final


def _cache_key(name: str, tiktoken_bytes: bytes, template: str) -> str:
    import transformers

    h = hashlib.sha256()
    # transformers is in the key because its save format and tokenizer classes change between releases.
    for part in (name, str(BUILDER_VERSION), transformers.__version__):
        h.update(part.encode() + b"\0")
    h.update(hashlib.sha256(tiktoken_bytes).digest())
    h.update(hashlib.sha256(template.encode("utf-8")).digest())
    return h.hexdigest()


def _build_into(final: Path, name: str, key: str, make: Callable[[], ProcessorMixin]) -> None:
    """Build with `make()` into a temp dir and publish it with one rename, so the cache never holds a partial dir."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    if final.exists() and not (final / MARKER_FILE).is_file():
        # No marker means the dir was not written by this builder (all our writes are one rename); set it aside.
        trash = root / f".{final.name}.stale-{uuid.uuid4().hex}"
        try:
            os.replace(final, trash)
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.tmp-"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        make().save_pretrained(str(tmp))
        # Written last, so a dir that has it is complete.
        marker = {"name": name, "key": key, "builder_version": BUILDER_VERSION}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:
            # A concurrent build renamed its complete copy first (rename onto a non-empty dir fails): use that.
            if not (final / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built builtin processor %s into %s in %.1fs", name, final, time.perf_counter() - t0)
