"""The dataset boundary (docs/untrusted-datasets.md): what a dataset from elsewhere may make a reader open or run.
A dataset dir or base URL and its manifest -> the checked shard and processor locations (inside it, or under its
URL); a saved processor dir -> its own files (inside it, no custom code). vlmprep and the trainer both call it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

# URL bases a dataset may live under, read through fsspec (s3fs, gcsfs, huggingface_hub's HfFileSystem; memory:// is
# fsspec's in-process filesystem): a manifest's names are joined to the base and never leave it.
REMOTE = ("http://", "https://", "s3://", "gs://", "gcs://", "hf://", "memory://")
MANIFEST_NAME = "manifest.json"
PROCESSOR_DIR = "processor"  # where a manifest without processor.dir keeps its saved processor
# One part of a name a dataset gives (not '.' or '..'): no separator, no '%' escape, no scheme, no space.
_PART = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")
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
    }
)


class UnsafeDataset(ValueError):
    """A dataset that names something outside itself, or a processor that asks for custom code: one line that names
    the file and the value."""


@dataclass(frozen=True)
class DatasetPaths:
    """Where a reader may look, once the manifest is checked: local paths for a dataset dir, URLs under its base."""

    shards: tuple[str, ...]  # in manifest order
    processor: str  # the saved processor dir (it may be absent: a reader that needs it says so)
    indexes: tuple[str | None, ...] = ()  # each shard's sample index sidecar, None where the manifest lists none
    sample_index: str | None = None  # the dataset's sample index (every shard's rows in one file), where listed


def _inside(path: str, root: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, top]) == top


def is_plain_path(name) -> bool:
    """A relative path of plain parts: no absolute path, '.' or '..' part, '%' escape, URL or backslash."""
    return isinstance(name, str) and all(_PART.match(p) and p not in (".", "..") for p in name.split("/"))


def dataset_file(base: str, name, *, where: str, what: str) -> str:
    """`name`, which `where` (a manifest) gives as `what`, joined to the dataset's dir or URL `base`: refused unless
    it is a relative path of plain parts (no absolute path, '..', '%' escape or URL) and, for a local
    dataset, its real path (every symlink followed) lies inside the dataset's real path."""
    if not is_plain_path(name):
        raise UnsafeDataset(
            f"{where}: {what} {name!r} is not a relative path inside the dataset (plain names only: "
            "no absolute path, '..' or URL); refusing to read it"
        )
    if base.startswith(REMOTE):
        refuse_credentials(base, where=where)
        return base.rstrip("/") + "/" + name
    path = os.path.join(base, *name.split("/"))
    if not _inside(path, base):
        raise UnsafeDataset(
            f"{where}: {what} {name!r} resolves to {os.path.realpath(path)}, outside the dataset "
            f"{os.path.realpath(base)} (a symlink); refusing to read it: copy the file in instead"
        )
    return path


def refuse_credentials(url: str, *, where: str) -> None:
    """A URL with a user or password in it (scheme://user:secret@host/...) would be printed, logged and written
    into run files wherever the URL is: refused; credentials come from each storage library's own environment and
    config (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN, ~/.netrc)."""
    authority = url.split("://", 1)[-1].split("/", 1)[0]
    if "@" in authority:
        scheme = url.split("://", 1)[0]
        raise UnsafeDataset(
            f"{where}: a {scheme}:// URL with credentials in it (user@ or user:password@); "
            "refusing it: put them in the storage library's environment or config instead, "
            "never in a URL"
        )


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]*@")


def redact_credentials(text: str) -> str:
    """`text` with the user and password of every URL in it (scheme://user:secret@host) replaced by `***`: what
    vlmprep writes or prints of a URL it did not choose (an image URL of a record, a redirect's target)."""
    return _USERINFO.sub(r"\1***@", text) if "@" in text else text


class _Names:
    """dataset_file for the many one-part names of one manifest (shards, sample indexes) in O(1) syscalls each: a
    plain one-part name joined to the dataset dir leaves it only when that entry is a symlink (no '..', no
    separator), so the dir is listed once and only its symlinks are resolved (realpath) and checked."""

    def __init__(self, base: str, where: str):
        self.base, self.where, self.links = base, where, None
        if not base.startswith(REMOTE):
            try:
                with os.scandir(base) as it:
                    self.links = {e.name for e in it if e.is_symlink()}
            except OSError:
                self.links = None  # checked one by one below, as dataset_file does

    def __call__(self, name, what: str) -> str:
        if (
            self.links is None
            or not isinstance(name, str)
            or "/" in name
            or name in self.links
            or not is_plain_path(name)
        ):
            return dataset_file(self.base, name, where=self.where, what=what)
        return os.path.join(self.base, name)


def dataset_paths(base: str, manifest: dict, *, where: str) -> DatasetPaths:
    """Every path a dataset's manifest (read from `where`) names, checked: each shard name one plain `.tar` file name
    in the dataset, each sample index one plain `.index.npy` name, the processor dir inside it; a local processor dir
    that exists is checked too (processor_files), so a dataset whose processor asks for custom code is refused by
    every reader, whether it loads the processor or not. O(shards) with one stat-free listing of a local dir."""
    base = str(base)
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise UnsafeDataset(f"{where}: 'shards' is not a list of objects; not a vlmprep manifest")
    if base.startswith(REMOTE):
        refuse_credentials(base, where=where)
    joined = _Names(base, where)
    names, indexes = [], []
    for s in shards:
        name = s.get("name")
        if not isinstance(name, str) or "/" in name or not name.endswith(".tar"):
            raise UnsafeDataset(
                f"{where}: shard name {name!r} is not a plain .tar file name in the dataset; refusing to read it"
            )
        names.append(joined(name, "shard name"))
        index = s.get("index")
        if index is None:
            indexes.append(None)
            continue
        iname = index.get("name") if isinstance(index, dict) else None
        if not isinstance(iname, str) or "/" in iname or not iname.endswith(".index.npy"):
            raise UnsafeDataset(
                f"{where}: sample index {iname!r} of shard {name!r} is not a plain .index.npy file "
                "name in the dataset; refusing to read it"
            )
        indexes.append(joined(iname, "sample index"))
    whole = manifest.get("sample_index")
    sample_index = None
    if whole is not None:
        wname = whole.get("name") if isinstance(whole, dict) else None
        if not isinstance(wname, str) or "/" in wname or not wname.endswith(".index.npy"):
            raise UnsafeDataset(
                f"{where}: the dataset's sample index {wname!r} is not a plain .index.npy file name "
                "in the dataset; refusing to read it"
            )
        sample_index = joined(wname, "sample index")
    proc = manifest.get("processor")
    processor = dataset_file(
        base,
        proc.get("dir", PROCESSOR_DIR) if isinstance(proc, dict) else PROCESSOR_DIR,
        where=where,
        what="processor dir",
    )
    if not base.startswith(REMOTE) and os.path.isdir(processor):
        processor_files(processor, vocab=False)  # its loaders (and verify) check the vocabulary
    return DatasetPaths(tuple(names), processor, tuple(indexes), sample_index)


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
    """Refuse a processor config whose sizes (POSITIVE_SIZES, at any depth) are not positive integers: a patch_size
    of 0 or -14 would be a ZeroDivisionError or a negative shape deep in the pixel math, naming no file."""
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


class UnsafeWrite(OSError):
    """Where vlmprep or the trainer writes or keeps state (a cache, a stage, a lock, a run dir, a build output),
    something that is not a plain file or dir of its own is in the way: a symlink planted there (in a shared cache
    dir, anyone could make it point at a file or dir of the user's), a FIFO or a device. One line naming the path;
    nothing is read, written or removed through it."""


_WRITE_FLAGS = {
    "rb": os.O_RDONLY,
    "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "a+b": os.O_RDWR | os.O_CREAT | os.O_APPEND,
    "lock": os.O_RDWR | os.O_CREAT,
}


def open_fd_no_follow(path: str | Path, mode: str = "wb") -> int:
    """A file descriptor on `path` opened for writing (`mode` as open()'s, or "lock": read-write, created if absent;
    "rb": a state file read back) without following a symlink at it (O_NOFOLLOW) and only if it is a regular file
    (a FIFO is not waited on, a device not opened). Raises UnsafeWrite naming the path otherwise."""
    flags = _WRITE_FLAGS[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | os.O_NOCTTY
    verb, done = ("read", "read") if mode == "rb" else ("write", "written")
    refused = UnsafeWrite(
        f"{path} is a symlink or special file (a FIFO, device or dir) where a plain file is {done}: refusing to "
        f"{verb} through it (someone may have planted it); remove it and run again"
    )
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR) or os.path.islink(path):  # ENXIO: a FIFO, no reader
            raise refused from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused
    os.set_blocking(fd, True)
    return fd


def open_no_follow(path: str | Path, mode: str = "wb", **kwargs):
    """open(path, mode) for writing (or "rb", reading a state file) without following a symlink at `path`
    (open_fd_no_follow); text modes take open()'s keywords (encoding)."""
    return os.fdopen(open_fd_no_follow(path, mode), mode, **kwargs)


STATE_BYTES = 256 << 20  # a plan, journal, task manifest, run.json or checkpoint marker: KBs to a few MB


def read_state(path: str | Path, limit: int = STATE_BYTES) -> bytes:
    """A file vlmprep or the trainer keeps state in (plan.json, a journal, a task manifest, manifest.json of
    --out, run.json, a checkpoint marker, a lock's note), read whole through open_fd_no_follow: a symlink or FIFO
    planted at its name is refused (UnsafeWrite), never followed or waited on, and at most `limit` bytes are
    read (more: UnsafeWrite). FileNotFoundError where it is absent."""
    with open_no_follow(path, "rb") as f:
        # read(n) allocates n first: ask for what the file holds (and a byte more, to see it grow past the limit)
        data = f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)
    if len(data) > limit:
        raise UnsafeWrite(f"{path} is more than {limit} bytes, more than this file ever holds: refusing it")
    return data


def state_dir(path: str | Path, *, root: str | Path | None = None) -> Path:
    """A dir vlmprep or the trainer writes or keeps state in (a cache entry, a stage, --out, a run dir, a task or
    checkpoint dir), made where absent, and refused (UnsafeWrite, one line) unless it is a real dir: a symlink at
    its name is never followed (the dir itself included, so nothing is written into or pruned from the link's
    target), a file, FIFO or device never used. `root`: the user's own dir above it ($VLMPREP_CACHE, --shard-cache,
    --out): every dir made below it is checked too; the root and its parents are made as they are."""
    path = Path(path)
    top = Path(root) if root is not None else path.parent
    if root is not None:
        top.mkdir(parents=True, exist_ok=True)
    below = path.relative_to(top).parts if root is not None else (path.name,)
    d = top
    for part in below:
        d = d / part
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        except FileNotFoundError:  # its parents first (above the root: the user's own, made as they are)
            d.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(d)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):  # lstat: a link to a dir is a link here
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            real = f" to {os.path.realpath(d)}" if stat.S_ISLNK(st.st_mode) else ""
            raise UnsafeWrite(
                f"{d} is {kind}{real} where vlmprep keeps a dir of its own: refusing to write into, or remove "
                "files from, anything through it (someone may have planted it); remove it and run again, or "
                "name the real dir yourself"
            )
    return path


def remove_state(path: str | Path) -> None:
    """Remove what is at `path`, a name vlmprep or the trainer owns (a temp or replaced dir, an old checkpoint): a
    symlink planted there is unlinked, never followed (rmtree refuses a link, and ignore_errors would keep it);
    a dir's tree goes (rmtree removes its inner links without following them); nothing there is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def fresh_state_dir(path: str | Path) -> Path:
    """An empty dir at `path` for vlmprep or the trainer to fill and rename into place (a checkpoint's or an
    export's temp dir, a processor copy's): what is at its name removed first (remove_state), then made
    (state_dir)."""
    remove_state(path)
    return state_dir(path)
