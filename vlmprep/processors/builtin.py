"""The builtin processors (`--processor builtin:NAME`): each is built offline by its vendor module (qwen.py,
mistral.py, llama.py) from the vocabulary and template files it reads, saved once into an on-disk cache keyed by
those files, and loaded back from there (from_local_dir, also the load of a dataset's saved processor dir).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from vlmprep_schemas.boundary import open_no_follow, read_state, remove_state

if TYPE_CHECKING:
    from transformers import ProcessorMixin

log = logging.getLogger(__name__)

# Bump whenever a build would produce different files from the same inputs; it is part of the cache key.
# 2: image processors carry the published checkpoint settings, not the class defaults; 3: Llama 3.2 Vision's 560 px
BUILDER_VERSION = 3
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
    return from_local_dir(builtin_dir(name, cache_dir))


def builtin_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The cached processor dir of builtin `name` (or `tiny:NAME`, vlmprep/processors/tiny.py) in `cache_dir`, built
    there first if missing."""
    if name.startswith("tiny:"):
        from vlmprep.processors import tiny as vendor

        name = name.split(":", 1)[1]
        if name not in vendor.tiny_names():
            raise ValueError(
                f"unknown tiny processor tiny:{name}: choose one of "
                + ", ".join(f"tiny:{n}" for n in vendor.tiny_names())
            )
        data, template = vendor.source_files(name)
        key = _cache_key(f"tiny:{name}", data, template)
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        final = root / f"tiny-{name}-{key[:16]}"
        if cache_problem(final, key) is not None:
            _build_into(final, f"tiny:{name}", key, lambda: vendor.make_processor(name, template))
        return final
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
    if cache_problem(final, key) is not None:
        _build_into(final, name, key, lambda: vendor.make_processor(name, template))
    return final


def _digests(d: Path) -> dict[str, str]:
    """Every entry under dir `d` but the marker -> the sha256 of its bytes ("not a file" for a link, a FIFO or any
    other non-file), walked without following a link."""
    out = {}
    for top, dirs, names in os.walk(d):
        for n in [*names, *(x for x in dirs if os.path.islink(os.path.join(top, x)))]:
            p = Path(top, n)
            rel = p.relative_to(d).as_posix()
            if rel != MARKER_FILE:
                out[rel] = _sha256(p) if p.is_file() and not p.is_symlink() else "not a file"
    return out


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open_no_follow(p, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cache_problem(d: Path, key: str) -> str | None:
    """Why cached processor dir `d` is not the one vlmprep built for `key` (None: it is): it must be a real dir (no
    link), its marker must name `key` and list each file with the sha256 it was written with, and the dir must hold
    exactly those files with those bytes. A shared cache (~/.cache of a team, $VLMPREP_CACHE) is writable by
    others: a tokenizer or chat template edited there would change every build's tokens without a word."""
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return "not a directory of its own (a symlink or file)"
        marker = json.loads(read_state(d / MARKER_FILE, 1 << 20))
        files = marker.get("files")
        if marker.get("key") != key or not isinstance(files, dict):
            return f"its {MARKER_FILE} is not one this vlmprep wrote for it"
        now = _digests(d)
    except FileNotFoundError:
        return "missing, or not finished"
    except (OSError, ValueError, AttributeError) as e:
        return f"unreadable ({e})"
    changed = sorted(n for n in files.keys() | now.keys() if files.get(n) != now.get(n))
    return f"{', '.join(changed[:3])} changed since it was built" if changed else None


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
    tokenizer = fast_tokenizer_cls.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=False, added_tokens_decoder={}
    )  # the file's backend has them all
    tokenizer.__class__ = tokenizer_cls

    def given_tokenizer(cls, sub_processor_type, *args, **kwargs):
        return tokenizer

    fast_processor_cls = type(
        processor_cls.__name__,
        (processor_cls,),
        {"__module__": processor_cls.__module__, "_load_tokenizer_from_pretrained": classmethod(given_tokenizer)},
    )
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
    if (
        not isinstance(tokenizer_cls, type)
        or not issubclass(tokenizer_cls, TokenizersBackend)
        or not isinstance(processor_cls, type)
        or not issubclass(processor_cls, ProcessorMixin)
        or [a for a in processor_cls.get_attributes() if "tokenizer" in a] != ["tokenizer"]
        or "Pixtral" in proc_name
    ):
        return None  # PixtralProcessor loads its tokenizer itself, not through _load_tokenizer_from_pretrained
    return processor_cls, tokenizer_cls


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
    problem = cache_problem(final, key) if os.path.lexists(final) else None
    if problem is not None:
        # Not the dir this builder wrote (all our writes are one rename of a dir whose marker lists its files), or
        # changed since: set it aside (a link: the link itself) and build it again.
        log.warning("rebuilding the cached processor %s: %s", final, problem)
        trash = root / f".{final.name}.stale-{uuid.uuid4().hex}"
        try:
            os.replace(final, trash)
        except FileNotFoundError:
            pass
        except OSError as e:  # another user's dir in a shared cache: not ours to move
            raise ValueError(
                f"{final}: the cached processor {name} is {problem}, and cannot be replaced here ({e.strerror}); "
                "remove it, or set VLMPREP_CACHE to a dir of your own"
            ) from None
        remove_state(trash)

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.tmp-"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        make().save_pretrained(str(tmp))
        # Written last, so a dir that has it is complete; it lists every file's sha256, checked on each use.
        marker = {"name": name, "key": key, "builder_version": BUILDER_VERSION, "files": _digests(tmp)}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:
            # A concurrent build renamed its complete copy first (rename onto a non-empty dir fails): use that.
            if cache_problem(final, key) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built builtin processor %s into %s in %.1fs", name, final, time.perf_counter() - t0)
