"""--out in a store (s3://, gs://, hf://; memory:// in tests): the build runs in a local stage dir exactly as a local
build does, and what lands there is uploaded as it lands: each shard (and its sample index) once the task's journal
holds it, a task's rejects and sample list and then its manifest when it ends, the merged dataset's files after the
merge and manifest.json last. An upload lands whole or not at all (one PUT, or a multipart upload completed last), so
the bucket never holds part of a file; it reads the file in bounded parts (Bucket._parts), not whole.

Resume: a killed build resumes from its stage (the same machine); without it (another machine, a lost disk), from the
bucket: the plan, the processor and every finished task (manifest, lists, sample indexes) are fetched back and only
the unfinished tasks run again, so the unit of resume from a bucket is the task (`--tasks N`).

The stage holds no shard once it is up (Uploader drop_shards): a resumed task checks its journaled shards in the
bucket, and the merge works from there (StoredShards: a shard is checked by its listed size, and fetched only where
the merge rewrites it), so the stage holds the shards in flight, the lists and the sample indexes, not the dataset.

No shared filesystem: a task run anywhere (a Ray worker, `--task-index`) fetches the plan and processor into its own
scratch stage, runs, uploads, and leaves nothing behind; the merge fetches the finished tasks' lists into the
driver's stage.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from vlmprep.builder.workers import BuildError
from vlmprep.ingest import READ_BLOCK, LocationError, is_url, url_fs, why
from vlmprep.shards.dataset import (
    FAILED_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    NV_META,
    PLAN_NAME,
    PROCESSOR_DIR,
    SHARD_GLOB,
    TASKS_DIR,
    TMP_SUFFIX,
    WATCH_LEASE,
    TaskFiles,
    is_ours,
    task_file,
)
from vlmprep.shards.format import INDEX_SUFFIX, index_name
from vlmprep.shards.manifest import Manifest, ShardEntry, TaskManifest
from vlmprep.shards.versions import CommitConflict, index_file, rejects_file, removed_ids_name, shard_version
from vlmprep_schemas.boundary import open_no_follow, read_state, state_dir
from vlmprep_schemas.terminal import for_terminal
from vlmprep_schemas.versions import ids_name, version_name

STAGE_ENV = "VLMPREP_STAGE"  # where stage dirs live (default ~/.cache/vlmprep/stage)
# An upload to S3 holds at most PARTS_IN_FLIGHT parts (and botocore's copy of each): ~64 MiB whatever the shard size.
PART_BYTES = 8 << 20  # S3's smallest part but the last is 5 MiB
PARTS_IN_FLIGHT = 4
MAX_PARTS = 10_000
# A stage's files that are the local run's own state, never uploaded: locks, journals, partial lists, temp files.
_LOCAL_ONLY = (LOCK_NAME, "*.lock", "*.journal.json", "*.partial", f"*{TMP_SUFFIX}", "*.part", "*.old")


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def is_store(out: str) -> bool:
    """Whether --out names a store's prefix rather than a local dir."""
    return is_url(str(out))


def stage_for(url: str) -> Path:
    """The local stage of an --out URL: one per URL, so a rerun on this machine resumes from it."""
    root = Path(os.environ.get(STAGE_ENV) or Path.home() / ".cache" / "vlmprep" / "stage")
    return root / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def _local_only(name: str) -> bool:
    return any(fnmatch.fnmatch(Path(name).name, g) for g in _LOCAL_ONLY)


class Bucket:
    """A dataset prefix in a store: list, put and get files by their names inside the dataset."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = url_fs(self.url, where="--out")
        self.root = self.root.rstrip("/")

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> dict[str, int]:
        """Every object under the prefix -> its size, by its name inside the dataset."""
        try:
            self.fs.invalidate_cache()
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:  # noqa: BLE001 - each store raises its own kinds
            raise LocationError(f"--out {self.url}: cannot list it: {why(e)}") from None
        cut = len(self.root) + 1
        return {
            k[cut:]: int(v.get("size") or 0)
            for k, v in found.items()
            if k.startswith(self.root + "/") and v.get("type", "file") == "file"
        }

    def sizes(self, names: list[str]) -> dict[str, int]:
        """The size of each of these objects that exists (one request each): a task asks after its own few files,
        not a listing of the whole prefix (tasks x objects on a big build)."""
        out = {}
        for name in names:
            key = self._key(name)
            try:
                self.fs.invalidate_cache(key)
                out[name] = int(self.fs.info(key).get("size") or 0)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001 - each store raises its own kinds
                raise LocationError(f"--out {self.url}: cannot look up {name}: {why(e)}") from None
        return out

    def put(self, local: Path, name: str) -> None:
        """Upload one file as the object `name`, read from the file in bounded parts (_parts): the object appears
        whole or not at all (one PUT, or a multipart upload completed last and aborted on a failure)."""
        try:
            self.fs.put_file(str(local), self._key(name), **self._parts(local))
        except Exception as e:  # noqa: BLE001
            raise LocationError(f"--out {self.url}: uploading {name} failed: {why(e)}") from None

    def _parts(self, local: Path) -> dict:
        """How s3fs uploads a file: it reads `max_concurrency` parts of `chunksize` bytes at a time (a file under two
        parts in one read), and botocore holds a copy of each part it sends; its defaults (10 parts of 50 MiB) held a
        512 MiB shard twice. Other stores already stream: gcsfs sends 50 MiB chunks one at a time, hf:// and memory://
        write through fsspec's buffered file."""
        if not {"s3", "s3a"} & set(_protocols(self.fs)):
            return {}
        part = max(PART_BYTES, -(-local.stat().st_size // MAX_PARTS))  # S3 takes at most 10,000 parts an object
        return {"chunksize": part, "max_concurrency": PARTS_IN_FLIGHT}

    def get(self, name: str, local: Path, size: int) -> None:
        """Fetch one object of its listed `size` to `local` (NAME.part, opened without following a link, then
        renamed): a kill never leaves part of one under its name, and a body past its size is refused unread."""
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise LocationError(f"--out {self.url}: {name!r} is outside the dataset; refusing it")
        state_dir(local.parent)
        part = local.with_name(local.name + ".part")
        with open_no_follow(part, "wb") as f:
            got = self._stream(name, size, f.write)
        if got != size:
            part.unlink()
            raise LocationError(
                f"--out {self.url}: {name} is {got}{'+' if got > size else ''} bytes fetched, {size} listed"
            )
        os.replace(part, local)

    def _stream(self, name: str, size: int, sink) -> int:
        """The object's bytes to `sink` in 4 MiB reads, stopping one byte past `size`; the bytes read."""
        got = 0
        try:
            with self.fs.open(self._key(name), "rb") as src:
                while got <= size and (chunk := src.read(min(READ_BLOCK, size + 1 - got))):
                    sink(chunk)
                    got += len(chunk)
        except Exception as e:  # noqa: BLE001 - each store raises its own kinds
            raise LocationError(f"--out {self.url}: fetching {name} failed: {why(e)}") from None
        return got

    def finished_task(self, have: dict[str, int], index: int, digest: str) -> TaskManifest | None:
        """Task `index`'s manifest where the bucket holds one of this plan (`digest`), read alone (its lists and
        shards are not fetched): a task finished there is not run again."""
        name = task_file(index, ".json")
        data = self.read(name, have[name]) if name in have else None
        if data is None:
            return None
        done = TaskManifest.from_json(json.loads(data), where=f"{self.url}/{name}")
        return done if done.plan == digest else None

    def read(self, name: str, size: int) -> bytes | None:
        """A small object of listed `size`, whole; None where it holds another number of bytes."""
        parts: list[bytes] = []
        return b"".join(parts) if self._stream(name, size, parts.append) == size else None

    def put_bytes(self, name: str, data: bytes) -> None:
        """Upload `data` as the object `name` (a PUT: whole or not at all)."""
        try:
            self.fs.pipe_file(self._key(name), data)
        except Exception as e:  # noqa: BLE001
            raise LocationError(f"--out {self.url}: uploading {name} failed: {why(e)}") from None

    def create(self, name: str, data: bytes) -> None:
        """Create the object `name` holding `data` only where no such object exists: a conditional PUT (fsspec's
        mode="create": S3 If-None-Match: *; gcsfs a generation precondition; memory:// exclusive), the one
        exclusive step a bucket offers. FileExistsError where it exists; a store that cannot be asked for it is a
        LocationError (store_versions.check_conditional_writes finds one that ignores it)."""
        try:
            self.fs.pipe_file(self._key(name), data, mode="create")
        except FileExistsError:
            raise
        except Exception as e:  # noqa: BLE001 - each store raises its own kinds
            raise LocationError(f"--out {self.url}: creating {name} failed: {why(e)}") from None

    def remove(self, names: list[str]) -> None:
        """Delete these objects (one already gone is fine)."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._key(name))


class Uploader:
    """Uploads a task's files from the stage as they become final, on one background thread (a bounded queue of
    names, so a slow store slows the task instead of piling up). close() waits and raises the first failure.
    drop_shards: each shard leaves the stage once up (the journal checks it in the bucket on a resume, the merge
    reads it there); its small sample index stays, for the merge's dataset index."""

    def __init__(self, url: str, stage: Path, *, drop_shards: bool = False):
        self.bucket, self.stage, self.drop_shards = Bucket(url), Path(stage), drop_shards
        self.sent: set[str] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=8)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="vlmprep-upload", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (name := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self.bucket.put(self.stage / name, name)
                    if self.drop_shards and fnmatch.fnmatch(name, SHARD_GLOB):
                        (self.stage / name).unlink()
                except BaseException as e:  # noqa: BLE001 - raised on the task's thread by send() / close()
                    self._error = e
            self._queue.task_done()

    def send(self, *names: str) -> None:
        """Queue files of the stage for upload (each once); a failed upload before is raised here."""
        if self._error is not None:
            raise self._error
        for name in names:
            if name not in self.sent:
                self.sent.add(name)
                self._queue.put(name)

    def shards(self, shards: list) -> None:
        """Each finished shard (ShardInfo or ShardEntry) and its sample index not sent yet."""
        for s in shards:
            s = s if isinstance(s, ShardEntry) else s.entry()
            self.send(s.name, *([s.index.name] if s.index else []))

    def task_done(self, files: TaskFiles, manifest: TaskManifest) -> None:
        """A finished task: its shards (those sent before a kill may be missing: sent again where the bucket lacks
        them), its lists, then its manifest once all else is up. Nothing where the bucket holds this manifest already:
        the task's files went up before it (a merge may since have removed a shard it emptied)."""
        name = task_file(files.index, ".json")
        if self._holds(name, read_state(files.manifest)):
            return
        if self._thread.is_alive():
            self._queue.join()  # the shards queued are up (and out of the stage) before the bucket is asked
        want = {n: size for s in manifest.shards for n, size in [(s.name, s.bytes)] + _index_of(s)}
        have = self.bucket.sizes(list(want))
        for n, size in want.items():
            if have.get(n) == size:  # up already (this run, or a run before the kill)
                self.sent.add(n)
            elif not (self.stage / n).is_file():  # removed from the stage once up: the bucket lost it since
                raise LocationError(
                    f"--out {self.bucket.url}: {n} of finished task {files.index} is in neither the bucket nor the "
                    f"stage; remove {self.bucket.url}/{task_file(files.index, '.json')} and build again to rerun it"
                )
            else:
                self.sent.discard(n)
        self.shards(manifest.shards)
        self.send(task_file(files.index, ".rejects.jsonl"), task_file(files.index, ".samples.jsonl"))
        self.close()
        self.bucket.put(files.manifest, task_file(files.index, ".json"))

    def _holds(self, name: str, data: bytes) -> bool:
        return self.bucket.sizes([name]).get(name) == len(data) and self.bucket.read(name, len(data)) == data

    def close(self) -> None:
        """Wait for every queued upload; raise the first that failed."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error


def _index_of(s: ShardEntry) -> list[tuple[str, int]]:
    return [(s.index.name, s.index.bytes)] if s.index else []


class StoredShards:
    """The shards a merge finds in the bucket rather than in its stage: their sizes from one listing, and a fetch for
    the few the merge rewrites (ids repeated across tasks)."""

    def __init__(self, bucket: Bucket, have: dict[str, int]):
        self.bucket, self.sizes = bucket, have

    def fetch(self, name: str, local: Path) -> None:
        """The shard into the stage, where the bucket holds it (one it lacks: the merge's checks name it)."""
        if name in self.sizes:
            self.bucket.get(name, local, self.sizes[name])


def check_bucket(bucket: Bucket, *, overwrite: bool) -> dict[str, int]:
    """The prefix's objects; refused when it holds files no vlmprep build wrote (unless --overwrite)."""
    have = bucket.names()
    foreign = sorted(n for n in have if not is_ours(n))  # the same names a local --out is judged by
    if foreign and not overwrite:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise BuildError(
            f"--out {bucket.url} holds files no vlmprep build wrote ({shown}); build into an empty or "
            "new prefix, or pass --overwrite to build beside them"
        )
    return have


def pull_plan(bucket: Bucket, stage: Path, have: dict[str, int]) -> bool:
    """The plan and the processor, into a stage; False where the bucket holds no plan. The plan comes last: a plan
    in the stage means the processor is there too."""
    if PLAN_NAME not in have:
        return False
    for name in sorted(n for n in have if n.startswith(PROCESSOR_DIR + "/")):
        bucket.get(name, stage / name, have[name])
    bucket.get(PLAN_NAME, stage / PLAN_NAME, have[PLAN_NAME])
    return True


def pull_task(bucket: Bucket, stage: Path, have: dict[str, int], index: int) -> bool:
    """A finished task as the bucket holds it, into a stage: its lists and the sample indexes there, its manifest
    last (its shards stay in the bucket: StoredShards); False where the task is not finished there (no
    manifest, or one without its lists: the task runs again). Its files went up before its manifest, so one missing
    now was removed since (a shard a merge emptied, or a loss the merge's checks name with the fix)."""
    name = task_file(index, ".json")
    if name not in have:
        return False
    fetched = stage / (name + ".part")
    bucket.get(name, fetched, have[name])
    done = json.loads(read_state(fetched))
    wanted = [task_file(index, ".rejects.jsonl"), task_file(index, ".samples.jsonl")]
    if not all(n in have for n in wanted):
        fetched.unlink()
        return False
    wanted += [s["index"]["name"] for s in done.get("shards", []) if s.get("index") and s["index"]["name"] in have]
    for n in wanted:
        bucket.get(n, stage / n, have[n])
    os.replace(fetched, stage / name)
    return True


def pull(bucket: Bucket, stage: Path, have: dict[str, int]) -> None:
    """What the bucket holds of a build, into an empty stage: the plan, the processor and each finished task. An
    unfinished task's shards are left in the bucket: the task runs again and overwrites them."""
    if not any(n == PLAN_NAME for n in have):
        return
    state_dir(stage / TASKS_DIR)
    for name in sorted(n for n in have if fnmatch.fnmatch(n, f"{TASKS_DIR}/task-[0-9]*.json")):
        pull_task(bucket, stage, have, int(Path(name).name[5:10]))
    pull_plan(bucket, stage, have)


def push_plan(bucket: Bucket, stage: Path) -> None:
    """The plan and the processor, before any task starts: a task anywhere, or a later resume, starts from them."""
    for p in sorted((stage / PROCESSOR_DIR).rglob("*")):
        if p.is_file() and not _local_only(p.name):
            bucket.put(p, p.relative_to(stage).as_posix())
    bucket.put(stage / PLAN_NAME, PLAN_NAME)


def push_dataset(
    bucket: Bucket,
    stage: Path,
    manifest: Manifest,
    tasks: list[TaskManifest],
    version: tuple[int, bytes | None] | None = None,
) -> None:
    """After the merge: every file of the stage the bucket lacks or holds otherwise (the merge rewrites the shards
    that held ids repeated across tasks), objects of an older build that the dataset no longer has removed (the
    shards the manifest names stay, in the stage or not), and manifest.json last. An append's (`version`: its number
    and record, None where it failed its checks): only the files of that version go up and only its own stale
    shards are removed (every earlier version's files stay); then its record is created exclusively
    (CommitConflict where another build did first) and manifest.json copied from it."""
    have = bucket.names()
    sent = {s.name: s.sha256 for m in tasks for s in m.shards}
    n = version[0] if version is not None else None
    local = {
        p.relative_to(stage).as_posix(): p
        for p in sorted(stage.rglob("*"))
        if p.is_file() and not _local_only(p.name) and p.name != MANIFEST_NAME
    }
    if n is not None:
        local = {name: p for name, p in local.items() if of_version(name, n)}
    for name, p in local.items():
        shard = next((s for s in manifest.shards if s.name == name), None)
        changed = shard is not None and sent.get(name) != shard.sha256
        if (
            changed
            or have.get(name) != p.stat().st_size
            or not (name.endswith(".tar") or name.endswith(index_name(".tar")))
        ):
            bucket.put(p, name)
    named = {k for s in manifest.shards for k, _ in [(s.name, s.bytes)] + _index_of(s)}
    gone = [k for k in have if k not in local and k not in named and k != MANIFEST_NAME and is_ours(k)]
    gone = [k for k in gone if not k.startswith(WATCH_LEASE)]  # a running watcher's lease is no build's file
    if n is None:
        bucket.remove(gone)
        bucket.put(stage / MANIFEST_NAME, MANIFEST_NAME)
        return
    bucket.remove([k for k in gone if of_version(k, n)])  # this version's stale files, an older plan's tasks
    if version[1] is not None:
        try:
            bucket.create(version_name(n), version[1])
        except FileExistsError:
            raise CommitConflict(
                f"--out {bucket.url}: version {n} was committed by another build meanwhile ({version_name(n)} "
                "exists); nothing of this build was committed: run the command again to append on top of it"
            ) from None
        bucket.put_bytes(MANIFEST_NAME, version[1])


def of_version(name: str, n: int) -> bool:
    """Whether object `name` of a dataset is the build of version `n`'s own (an append uploads and replaces only
    those): its shards and their indexes, its rejects, index and id file, the tasks of its plan, energon's meta and
    a failed check's note."""
    own = (rejects_file(n), index_file(n), ids_name(n), removed_ids_name(n))  # a rebuild's rewrites: shards of n
    if name.startswith((TASKS_DIR + "/", NV_META + "/")) or name in own:
        return True
    return name == FAILED_NAME or fnmatch.fnmatch(name.split(INDEX_SUFFIX)[0], SHARD_GLOB) and shard_version(name) == n


@contextlib.contextmanager
def scratch_stage(url: str, index: int):
    """A task's own stage where no shared filesystem is: a new temp dir, removed after."""
    d = Path(tempfile.mkdtemp(prefix=f"vlmprep-task-{index}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def say(line: str) -> None:
    """One progress line of a store build, on stderr."""
    print(for_terminal(f"vlmprep build: {line}"), file=sys.stderr)  # it names the bucket's keys
