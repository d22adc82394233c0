"""The tests' processors by family name: the real-vocabulary builtins (qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3.5, ...)
or vlmprep's own `tiny:NAME` processors (vlmprep/processors/tiny.py), built once into the test run's cache and loaded
back from disk, the path every real processor takes."""

from __future__ import annotations

import functools

# The families' registry names (vlmprep/families.py) -> their tiny:NAME.
TINY = {
    "gemma3": "gemma-3",
    "gemma4": "gemma-4",
    "llama3.2-vision": "llama-3.2-vision",
    "llama4": "llama-4",
    "mistral3-pixtral": "mistral-3",
    "idefics3-smolvlm": "smolvlm",
    "llava-onevision": "llava-onevision",
    "internvl": "internvl",
    "glm-4.1v": "glm-4.1v",
}


def tiny_names() -> list[str]:
    """The family names of the tiny processors the tests use beside the builtins."""
    return list(TINY)


@functools.lru_cache(maxsize=None)
def build_tiny_processor(name: str):
    """tiny:NAME by family name (or by tiny name)."""
    from vlmprep.processors.load import load_processor

    return load_processor(f"tiny:{TINY.get(name, name)}")


def tiny_dir(name: str):
    """The cached dir of tiny:NAME (family or tiny name)."""
    from vlmprep.processors.builtin import builtin_dir

    return builtin_dir(f"tiny:{TINY.get(name, name)}")


@functools.lru_cache(maxsize=None)
def load_family_processor(name: str):
    """Any family by name: the real-vocab builtins (qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3.5) or a tiny one above."""
    from vlmprep.processors.builtin import build_builtin_processor, builtin_names

    if name in builtin_names():
        return build_builtin_processor(name)
    return build_tiny_processor(name)
