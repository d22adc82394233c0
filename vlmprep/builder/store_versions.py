"""An append into a store (--append with --out s3://...): what a local --out gets from its file system, a bucket gets
here. Its writes must be exclusive where they count, so the store is first probed for conditional creates (a second
create of one object must fail: a store that ignores If-None-Match is refused); the parent version is read from the
bucket (manifest.json repaired there, version 1 recorded, id files derived); the version is claimed before any of its
shards goes up (versions/v00000N.claim, created exclusively: two appends from two machines would write the same
shard names); and the parent's files the merge reads are fetched into the stage.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Callable

from vlmprep.builder.append import Parent, append_ref, no_dataset, parent_of
from vlmprep.builder.plan import Plan, plan_digest
from vlmprep.builder.store import Bucket
from vlmprep.builder.workers import BuildError
from vlmprep.shards.dataset import MANIFEST_NAME, PLAN_NAME
from vlmprep.shards.manifest import ShardFormatError
from vlmprep.shards.reader import iter_shard
from vlmprep.shards.versions import id_digest, id_keys, ids_bytes, parse_record, removed_ids_name
from vlmprep.types import UserError
from vlmprep_schemas.limits import LIMITS, load_json
from vlmprep_schemas.versions import VERSIONS_DIR, ids_name, record_number, version_name

_RECORD = re.compile(rf"^{VERSIONS_DIR}/v([0-9]{{6,}})\.json$")


def check_conditional_writes(bucket: Bucket) -> None:
    """A store that ignores a conditional create would let two appends both commit one version: create a probe
    object twice (the second must fail), then remove it; BuildError naming the fix where the second succeeds."""
    probe = f"{VERSIONS_DIR}/.probe-{uuid.uuid4().hex}"
    bucket.create(probe, b"1")
    try:
        bucket.create(probe, b"2")
    except FileExistsError:
        return
    finally:
        bucket.remove([probe])
    raise BuildError(
        f"--out {bucket.url}: this store ignores conditional writes (a second create of one object succeeded), so "
        "two appends could both commit one version; append into a store that honours them (S3 and S3-compatible "
        "stores with If-None-Match, GCS) or into a local --out"
    )


def _read(bucket: Bucket, have: dict[str, int], name: str, limit: int) -> bytes | None:
    """A small object whole (None where absent), refused over `limit` bytes before it is read."""
    if name not in have:
        return None
    if have[name] > limit:
        raise ShardFormatError(f"{bucket.url}/{name} is {have[name]} bytes, more than a reader accepts ({limit})")
    data = bucket.read(name, have[name])
    if data is None:
        raise ShardFormatError(f"{bucket.url}/{name} changed while it was read; run again")
    return data


def store_parent(bucket: Bucket, say: Callable[[str], None]) -> Parent:
    """The latest version of the dataset in the bucket, made ready for an append as local_parent does it for a dir:
    manifest.json repaired where it is behind the highest record, version 1 of a dataset built before versions
    created as versions/v000001.json (its byte copy), and each version's id file derived where it has none."""
    have = bucket.names()
    data = repair_bucket_manifest(bucket, have, say)
    if data is None:
        raise no_dataset(bucket.url)
    parent = parent_of(data, bucket.url)
    if parent.number == 1 and version_name(1) not in have:
        try:
            bucket.create(version_name(1), data)  # the dataset built before versions becomes version 1, unchanged
        except FileExistsError:
            if bucket.read(version_name(1), len(data)) != data:
                raise ShardFormatError(f"{bucket.url}/{version_name(1)} is not manifest.json's copy") from None
    for k in range(1, parent.number + 1):
        if ids_name(k) not in have:
            say(f"deriving {ids_name(k)} from its shards (once)")
            record = parent.manifest if k == parent.number else _record(bucket, have, k)
            bucket.put_bytes(ids_name(k), ids_bytes(_stored_ids(bucket, have, record)))
    return parent


def repair_bucket_manifest(bucket: Bucket, have: dict[str, int], say: Callable[[str], None]) -> bytes | None:
    """manifest.json of the bucket's dataset, copied again from the highest record where a kill left it behind (saying
    so), as repair_manifest does it for a dir; its bytes (None where there is none). One that is ahead of the records,
    or differs from the record of its own version, is not ours to fix: ShardFormatError naming both."""
    records = [int(m.group(1)) for k in have if (m := _RECORD.match(k))]
    data = _read(bucket, have, MANIFEST_NAME, LIMITS.manifest_bytes)
    if not records:
        return data
    top = max(records)
    record = _read(bucket, have, version_name(top), LIMITS.manifest_bytes)
    if data == record:
        return data
    try:
        number = record_number(load_json(data, MANIFEST_NAME, LIMITS.manifest_bytes)) if data else None
    except ValueError:
        number = None
    if number is not None and number >= top:
        raise ShardFormatError(
            f"{bucket.url}/{MANIFEST_NAME} (version {number}) is not the byte copy of {version_name(top)}; a "
            "version record is never rewritten: copy it over manifest.json"
        )
    bucket.put_bytes(MANIFEST_NAME, record)
    say(f"{bucket.url}/{MANIFEST_NAME} was behind {version_name(top)} (a commit cut short): repaired")
    return record


def _record(bucket: Bucket, have: dict[str, int], k: int):
    data = _read(bucket, have, version_name(k), LIMITS.manifest_bytes)
    if data is None:
        raise ShardFormatError(f"{bucket.url}/{version_name(k)} is missing; the dataset's versions are not whole")
    return parse_record(data, f"{bucket.url}/{version_name(k)}")


def _stored_ids(bucket: Bucket, have: dict[str, int], record):
    """The id digests of the samples version `record` added, each of its shards fetched to a temp file and read."""
    added = (record.version or {}).get("added", {}).get("shards")
    with tempfile.TemporaryDirectory(prefix="vlmprep-ids-") as tmp:
        for s in record.shards:
            if added is None or s.name in added:
                local = Path(tmp) / s.name
                bucket.get(s.name, local, s.bytes)
                for x in iter_shard(local, version=record.format_version):
                    yield from map(id_digest, id_keys(x.meta()))
                local.unlink()


def attempt_in_bucket(bucket: Bucket, have: dict[str, int], parent: Parent) -> bool:
    """Whether the bucket's plan.json is an unfinished append on top of `parent` (one to resume from the bucket)."""
    data = _read(bucket, have, PLAN_NAME, LIMITS.manifest_bytes)
    try:
        plan = Plan.from_json(json.loads(data)) if data else None
    except (ValueError, UserError):
        return False
    return plan is not None and plan.append is not None and replace(plan.append, replaces=None) == append_ref(parent)


def claim_version(bucket: Bucket, plan: Plan) -> None:
    """Claim the version `plan` builds before any of its shards goes up: versions/v00000N.claim, created exclusively,
    names the plan. A claim of this very plan (a rerun, another task of it) passes; another plan's is refused in one
    line naming who holds it. A claim is never removed (a later one can never land after a commit)."""
    n, digest = plan.version, plan_digest(plan)
    name = f"{VERSIONS_DIR}/v{n:06d}.claim"
    note = {
        "plan": digest,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        bucket.create(name, json.dumps(note, sort_keys=True).encode())
    except FileExistsError:
        have = bucket.names()
        try:
            held = json.loads(_read(bucket, have, name, 1 << 16) or b"{}")
        except ValueError:
            held = {}
        if isinstance(held, dict) and held.get("plan") == digest:
            return
        who = (
            f"pid {held.get('pid')} on {held.get('host')}, since {held.get('since')}" if isinstance(held, dict) else "?"
        )
        raise BuildError(
            f"--out {bucket.url}: version {n} is being built by another append ({who}: {name}); wait for it to "
            f"commit, or, if it died, remove {bucket.url}/{name} and run again"
        ) from None
    if version_name(n) in bucket.names():
        raise BuildError(f"--out {bucket.url}: version {n} was committed meanwhile; run the command again")


def pull_parent(bucket: Bucket, stage: Path, have: dict[str, int], plan: Plan) -> None:
    """What the merge of an append reads of the versions before it, into the stage: the parent's record, every earlier
    version's id file and the parent's sample index."""
    names = [version_name(plan.append.parent), *(ids_name(k) for k in range(1, plan.append.parent + 1))]
    names += [removed_ids_name(k) for k in range(2, plan.append.parent + 1)]  # those a rebuild wrote
    record = _read(bucket, have, names[0], LIMITS.manifest_bytes)
    if record is not None:
        index = parse_record(record, names[0]).sample_index
        names += [index.name] if index is not None else []
    for name in names:
        local = stage / name
        if name in have and not (local.is_file() and local.stat().st_size == have[name]):
            bucket.get(name, local, have[name])
