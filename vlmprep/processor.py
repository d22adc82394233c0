"""Processor resolution: `builtin:NAME`, a local processor dir, or a hub id -> a loaded HF processor;
plus saving it into the dataset dir so the shards carry the exact processor that made them.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def load_processor(spec: str):
    from transformers import AutoProcessor

    if spec.startswith("builtin:"):
        from vlmprep.builtin import build_builtin_processor, builtin_names

        name = spec.split(":", 1)[1]
        if name not in builtin_names():
            raise ValueError(f"unknown builtin processor {spec!r}: choose one of "
                             + ", ".join(f"builtin:{n}" for n in builtin_names()))
        return build_builtin_processor(name)
    if Path(spec).is_dir():
        return AutoProcessor.from_pretrained(spec, local_files_only=True)
    if Path(spec).exists():
        raise ValueError(f"--processor {spec} is a file: pass a processor directory, a hub id or builtin:NAME")
    # A hub id: the one path that may use the network, and only when the user asks for it.
    return AutoProcessor.from_pretrained(spec)


def fingerprint_dir(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def save_processor(processor, dest: Path) -> str:
    """Save atomically into dest (replacing an older copy); returns the content fingerprint."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    processor.save_pretrained(str(tmp))
    if dest.exists():
        old = dest.with_name(dest.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    return fingerprint_dir(dest)
