"""The dataset boundary (docs/untrusted-datasets.md): what a dataset from elsewhere may make a reader open or run.
A dataset dir or base URL and its manifest -> the checked shard and processor locations (inside it, or under its
URL); a saved processor dir -> its own files (inside it, no custom code). vlmprep and the trainer both call it.
"""

from __future__ import annotations

import contextlib
import errno
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
        from vlmprep_schemas.processor_dir import processor_files  # it imports this module's checks

        processor_files(processor, vocab=False)  # its loaders (and verify) check the vocabulary
    return DatasetPaths(tuple(names), processor, tuple(indexes), sample_index)


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
