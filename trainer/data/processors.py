"""The processor the shards were rendered with, as the trainer reads it: its dir checked (no file linking out, no
custom code), its image and video processor settings (for vision.py's pixel math), a URL's files copied for loading,
and what must agree between mixed datasets (family, vocabulary, pixel settings).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trainer.data.errors import DataError
from trainer.data.sources import DataSource, join_url, read_dataset_file
from vlmprep_schemas.boundary import REMOTE, UnsafeDataset
from vlmprep_schemas.limits import load_json
from vlmprep_schemas.processor_dir import (
    MAX_CONFIG_BYTES,
    MAX_VOCAB_BYTES,
    PROCESSOR_FILES,
    check_processor_classes,
    processor_files,
    refuse_bad_sizes,
    refuse_custom_code,
    refuse_unknown_classes,
)


def check_processor(location: str, *, user_named: bool = False) -> None:
    """A processor dir the trainer reads settings from (the dataset's, or --processor): each file it would read
    inside it, no custom code (vlmprep_schemas.processor_dir.processor_files) and no class transformers lacks; a URL's
    configs are checked as read.
    A dir the user named (`user_named`) may link out (a Hugging Face cache snapshot); a dataset's may not."""
    if not location.startswith(REMOTE):
        try:
            processor_files(location, links_out=user_named)
            check_processor_classes(location)
        except UnsafeDataset as e:
            raise DataError(str(e)) from None


def load_processor(processor_dir: str):
    """transformers' processor from a checked local dir (check_processor), offline and without code; a tokenizer or
    config it cannot load is one DataError naming the dir (the tokenizers library's own errors are bare Exceptions)."""
    from transformers import AutoProcessor

    try:
        check_processor_classes(processor_dir)
        processor = AutoProcessor.from_pretrained(processor_dir, local_files_only=True, trust_remote_code=False)
    except UnsafeDataset as e:
        raise DataError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise anything
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"{processor_dir}: cannot load the processor there ({type(e).__name__}: {text[:200]}); "
            "pass --processor DIR with the processor the shards were built with"
        ) from None
    if getattr(processor, "tokenizer", None) is None:  # transformers falls back to a bare tokenizer
        raise DataError(
            f"{processor_dir}: loads as a {type(processor).__name__}, not a processor (no processor_config.json "
            "naming its class?); pass --processor DIR with the processor the shards were built with"
        )
    return processor


def _no_custom_code(cfg, url: str):
    """A processor config as read from `url`, refused (one line) when it asks for custom code, its sizes are not
    positive integers or it names a class transformers lacks."""
    try:
        refuse_custom_code(cfg, url)
        refuse_bad_sizes(cfg, url)
        refuse_unknown_classes(cfg, url)
    except UnsafeDataset as e:
        raise DataError(str(e)) from None
    return cfg if isinstance(cfg, dict) else {}


def load_image_processor_config(location: str) -> dict:
    """The image processor's saved settings: `processor_config.json` (transformers 5) or the older
    `preprocessor_config.json`, from a local dir or a URL."""
    errors = []
    for name, pick in (
        ("processor_config.json", lambda d: d.get("image_processor")),
        ("preprocessor_config.json", lambda d: d),
    ):
        url = join_url(location, name)
        if not url.startswith(REMOTE) and not Path(url).is_file():
            errors.append(f"{url}: no such file")
            continue
        try:
            raw = load_json(read_dataset_file(url, MAX_CONFIG_BYTES), url, MAX_CONFIG_BYTES)
        except (OSError, ValueError, RecursionError, DataError) as e:
            errors.append(f"{url}: {e}")
            continue
        cfg = pick(_no_custom_code(raw, url))
        if isinstance(cfg, dict):
            return cfg
        errors.append(f"{url}: no image processor settings")
    raise DataError(
        f"cannot load the image processor from {location} ({'; '.join(errors)}); "
        "pass --processor DIR pointing at the processor the shards were built with"
    )


def load_processor_settings(location: str) -> dict:
    """The processor's own settings (`processor_config.json`'s top level, its image and video processors left out:
    Mistral 3's patch_size and spatial_merge_size), or {} where it saved none (an older save)."""
    url = join_url(location, "processor_config.json")
    if not url.startswith(REMOTE) and not Path(url).is_file():
        return {}
    try:
        raw = load_json(read_dataset_file(url, MAX_CONFIG_BYTES), url, MAX_CONFIG_BYTES)
    except (OSError, ValueError, RecursionError, DataError):
        return {}
    cfg = _no_custom_code(raw, url)
    return {k: v for k, v in cfg.items() if k not in ("image_processor", "video_processor", "tokenizer")}


def load_video_processor_config(location: str) -> dict | None:
    """The video processor's saved settings (`processor_config.json`'s video_processor, or the older
    `video_preprocessor_config.json`), or None where the processor saved none (an image-only model)."""
    for name, pick in (
        ("processor_config.json", lambda d: d.get("video_processor")),
        ("video_preprocessor_config.json", lambda d: d),
    ):
        url = join_url(location, name)
        if not url.startswith(REMOTE) and not Path(url).is_file():
            continue
        try:
            raw = load_json(read_dataset_file(url, MAX_CONFIG_BYTES), url, MAX_CONFIG_BYTES)
        except (OSError, ValueError, RecursionError, DataError):
            continue
        cfg = pick(_no_custom_code(raw, url))
        if isinstance(cfg, dict):
            return cfg
    return None


def local_processor(location: str, dest: Path) -> str:
    """A processor dir the trainer loads (its tokenizer, for a tiny model's vocabulary and a placeholder image's
    tokens): a local one as it is, a URL's files (the fixed list a processor may hold, each bounded) copied into
    `dest` first. Checked like any processor (no file linking out, no custom code) before it is loaded."""
    if not location.startswith(REMOTE):
        return location
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROCESSOR_FILES:
        url = join_url(location, name)
        try:
            data = read_dataset_file(url, MAX_CONFIG_BYTES)
        except DataError as e:
            if "no such file or object" in str(e):  # a file this processor does not have
                continue
            raise
        (dest / name).write_bytes(data)
    check_processor(str(dest))
    return str(dest)


def processor_difference(a: DataSource, b: DataSource, processor: str = "") -> list[str]:
    """How b's processor differs from a's in what training depends on ('part a-digest vs b-digest'; [] when none).
    `processor` (the run's --processor) stands in for both when given."""
    ia, ib = (processor_identity(processor or x.processor or "", x.manifest) for x in (a, b))
    return [f"{k} {ia[k]} vs {ib[k]}" for k in ia if ib[k] != ia[k]]


def processor_identity(location: str, manifest: dict | None) -> dict[str, str]:
    """What must agree between mixed datasets: the model family (processor class), the tokenizer's vocabulary
    (tokens, merges and added tokens; not the chat template or truncation settings) and the image and video
    processors' settings that the trainer's pixel math uses (not frame sampling or resize budgets: the frames
    are stored already sampled and resized). Digests, so the message can say which part differs."""

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]

    out = {"family": str(((manifest or {}).get("processor") or {}).get("class", "?"))}
    try:
        url = join_url(location, "tokenizer.json")
        tok = load_json(read_dataset_file(url, MAX_VOCAB_BYTES), url, MAX_VOCAB_BYTES)
        out["vocabulary"] = digest([tok.get("model"), tok.get("added_tokens")])
    except (OSError, ValueError, DataError):
        out["vocabulary"] = "?"  # a slow tokenizer only: compared by family and image settings
    keep = (
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "image_mean",
        "image_std",
        "rescale_factor",
        "do_rescale",
        "do_normalize",
    )
    image = load_image_processor_config(location)
    out["image processor"] = digest({k: image.get(k) for k in ("image_processor_type", *keep)})
    # One run normalizes every dataset's videos with the first dataset's video processor.
    video = load_video_processor_config(location)
    out["video processor"] = "none" if video is None else digest({k: video.get(k) for k in keep})
    return out
