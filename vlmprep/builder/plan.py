"""Task plan: the inputs cut into T contiguous tasks (by file, and by line inside a file) -> DIR/plan.json.
The plan depends on the inputs and options only, never on how many machines run it, so any executor (a local
pool, Ray, a Slurm array running `--task-index i`) produces the same task outputs, and merge.py the same manifest.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vlmprep import __version__
from vlmprep.families import model_family
from vlmprep.ingest import LocationError, ReadLimits, Seek, as_input, input_names, iter_file_records, stamp
from vlmprep.processors.load import vocab_size
from vlmprep.shards.dataset import PLAN_NAME, PROCESSOR_DIR, TMP_SUFFIX, write_bytes_atomic
from vlmprep.shards.format import FORMAT_VERSION
from vlmprep.shards.manifest import JsonObject, SavedProcessor
from vlmprep.shards.summary import plural
from vlmprep.shards.versions import shard_prefix as version_shard_prefix
from vlmprep.types import RawRecord, UserError
from vlmprep_schemas.boundary import UnsafeWrite, read_state

PLAN_VERSION = 2  # 2: inputs carry their id name


class PlanError(UserError):
    """The dataset dir's plan does not fit what was asked (other options, a missing plan, changed inputs)."""


class InputChanged(PlanError):
    """An input of the plan changed (size, time, ETag) after the plan scanned it: the plan is void (`vlmprep watch`
    abandons the attempt and builds the object's new content on its next cycle)."""


@dataclass(frozen=True, kw_only=True)
class PlanInput(JsonObject):
    """One input file as the plan scanned it: its path, its id name, its stamp (bytes, mtime, a store's ETag) and
    the input positions of its records (first_position, then `records` of them)."""

    path: str
    name: str
    bytes: int
    mtime_ns: int
    etag: str | None = None
    first_position: int
    records: int


@dataclass(frozen=True, kw_only=True)
class Cut(JsonObject):
    """Where task `task` reads: from input position `position` (in input file `file`, at `seek`), `records` records
    of `bytes` bytes in all."""

    task: int
    position: int
    records: int
    bytes: int
    file: int
    seek: Seek

    NESTED = {"seek": (lambda d: Seek(**d), dataclasses.asdict)}


@dataclass(frozen=True, kw_only=True)
class AppendRef(JsonObject):
    """What an append's plan builds on (docs/datasets-that-grow.md): the version it makes, its parent version and the
    sha256 of the parent's record bytes (the merge commits only on top of that very record), and the input position
    its first record takes (the parent's records are positions 0 .. first_position - 1); a watcher's
    --on-change rebuild also the built inputs it replaces (`replaces`: each one's entry as the parent records it,
    its path and old stamp; builder/rewrite.py removes their samples)."""

    version: int
    parent: int
    parent_sha256: str
    first_position: int
    replaces: list | None = None


@dataclass(frozen=True, kw_only=True)
class Plan(JsonObject):
    """DIR/plan.json: the resolved config, the saved processor, the inputs and each task's cut; an append's plan
    also what it appends to (`append`; None: a whole build, version 1)."""

    plan_version: int
    format_version: int
    vlmprep_version: str
    tasks: int
    records: int
    config: dict  # the resolved BuildConfig (BuildConfig.to_json)
    processor: SavedProcessor
    inputs: tuple[PlanInput, ...]
    cuts: tuple[Cut, ...]
    append: AppendRef | None = None

    NESTED = {"processor": SavedProcessor, "inputs": [PlanInput], "cuts": [Cut], "append": AppendRef}

    @property
    def version(self) -> int:
        """The version this plan builds: 1 for a whole build."""
        return self.append.version if self.append is not None else 1

    @classmethod
    def from_json(cls, obj, *, where: str = PLAN_NAME) -> Plan:
        """A parsed plan.json (read from `where`), refused with a PlanError unless it is this vlmprep's plan_version
        and has every key a plan has."""
        if not isinstance(obj, dict) or obj.get("plan_version") != PLAN_VERSION:
            version = obj.get("plan_version") if isinstance(obj, dict) else "?"
            raise PlanError(f"{where}: plan_version {version} is not {PLAN_VERSION}; plan again with this vlmprep")
        try:
            return super().from_json(obj)
        except (TypeError, KeyError, AttributeError) as e:
            raise PlanError(f"{where}: unreadable ({e}); remove it and plan again") from None


def shard_prefix(plan: Plan, index: int) -> str:
    """One task: today's shard names. Several: the task index leads, so names sort in plan order and two tasks
    never write the same file. A version after the first carries its number first (shards/versions.py)."""
    return version_shard_prefix(plan.version, None if plan.tasks == 1 else index)


def saved_processor(spec: str, processor, fingerprint: str) -> SavedProcessor:
    """What the plan (and so the manifest) records of the processor a build renders with, saved as DIR/processor:
    its spec, class, the fingerprint of its saved files, and the model family and vocabulary it renders for."""
    return SavedProcessor(
        spec=spec,
        class_name=type(processor).__name__,
        fingerprint=fingerprint,
        dir=PROCESSOR_DIR,
        family=model_family(processor),
        vocab_size=vocab_size(processor),
    )


def make_plan(
    *,
    config: dict,
    files: list[Path],
    processor: SavedProcessor,
    tasks: int,
    limits: ReadLimits,
    append: AppendRef | None = None,
    names: list[str] | None = None,
) -> Plan:
    """Scan every input once (lines, not JSON: cheap beside rendering) and cut it into `tasks` runs of records of
    about equal bytes; a trace's bytes (screenshots inline) track its render time far better than a count. An
    append's records take the positions after its parent's (`append.first_position` on) and its inputs' id names
    (`names`) are given, taken among every input of the dataset (builder/append.py)."""
    sizes = array.array("q")
    where: list[tuple[int, int, int]] = []  # per record: (file, line before it, offset)
    inputs, frames_of = [], []
    position = start = append.first_position if append is not None else 0
    for fi, (path, name) in enumerate(zip(files, names or input_names(files))):
        frames: list[tuple[int, int]] = []
        file_first = position
        stamped = stamp(path)  # before the scan, which reads what it says (a remote one is checked on every read)
        for raw in iter_file_records(
            as_input(str(path), stamped),
            start_position=position,
            limits=limits,
            frames=frames,
            input_name=name,
            scan=True,
        ):
            sizes.append(max(raw.size, 1))
            where.append((fi, raw.source.line - 1, raw.offset))
            position = raw.position + 1
        inputs.append(
            PlanInput(path=str(path), name=name, **stamped, first_position=file_first, records=position - file_first)
        )
        frames_of.append(frames or [(0, 0)])
    cum = array.array("q", [0])
    for s in sizes:
        cum.append(cum[-1] + s)
    cut_at = [0]  # record index where each task starts: the record boundary nearest each k/T of the bytes
    for k in range(1, tasks):
        target = cum[-1] * k / tasks
        j = bisect.bisect_left(cum, target)
        if j > 0 and (j == len(cum) or target - cum[j - 1] <= cum[j] - target):
            j -= 1
        cut_at.append(max(j, cut_at[-1]))
    cuts = []
    for i, first in enumerate(cut_at):  # `first`: the task's first record, counted from the plan's first
        end = cut_at[i + 1] if i + 1 < tasks else len(sizes)
        if first < len(sizes):
            fi, line, offset = where[first]
            frames = frames_of[fi]
            frame, frame_offset = frames[bisect.bisect_right([d for _, d in frames], offset) - 1]
        else:
            fi, line, offset, frame, frame_offset = len(files), 0, 0, 0, 0
        seek = Seek(offset=offset, line=line, frame=frame, frame_offset=frame_offset)
        cut_bytes = int(sum(sizes[first:end]))
        cuts.append(Cut(task=i, position=start + first, records=end - first, bytes=cut_bytes, file=fi, seek=seek))
    made_by = {"plan_version": PLAN_VERSION, "format_version": FORMAT_VERSION, "vlmprep_version": __version__}
    covers = {"tasks": tasks, "records": len(sizes), "inputs": tuple(inputs), "cuts": tuple(cuts)}
    return Plan(**made_by, **covers, config=config, processor=processor, append=append)


def plan_bytes(plan: Plan) -> bytes:
    """A plan as the exact bytes of plan.json (sorted keys, so the same plan is the same file)."""
    return (json.dumps(plan.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def plan_digest(plan: Plan) -> str:
    """The sha256 of a plan's plan.json bytes: what each task manifest names, so merge refuses another plan's tasks."""
    return hashlib.sha256(plan_bytes(plan)).hexdigest()


def write_plan(out: Path, plan: Plan) -> None:
    """Atomic and safe when several `--task-index` runs write the same plan at once: each writes its own temp
    file, and every rename puts identical bytes in place."""
    path = Path(out) / PLAN_NAME
    write_bytes_atomic(path, plan_bytes(plan), tmp_suffix=f".{os.getpid()}{TMP_SUFFIX}")


def load_plan(out: Path) -> Plan | None:
    """DIR/plan.json -> the plan, or None where there is none; an unreadable one is a PlanError saying to plan again."""
    try:
        raw = json.loads(read_state(Path(out) / PLAN_NAME))  # a link or FIFO planted there: refused, not read
    except FileNotFoundError:
        return None
    except UnsafeWrite:
        raise  # a link or FIFO planted there: named as such
    except (OSError, ValueError) as e:
        raise PlanError(f"{Path(out) / PLAN_NAME}: unreadable ({e}); remove it and plan again") from None
    return Plan.from_json(raw, where=str(Path(out) / PLAN_NAME))


def config_changes(a: dict, b: dict) -> list[str]:
    """The option names whose values differ between two resolved configs (for refusals that name them)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_inputs_unchanged(plan: Plan) -> None:
    """A task reads byte offsets the plan took: an input changed since then would silently shift them."""
    for inp in plan.inputs:
        try:
            now = stamp(as_input(inp.path))
        except (OSError, LocationError) as e:
            why = getattr(e, "strerror", None) or e
            raise PlanError(
                f"{inp.path}: listed in the plan but not readable here ({why}); tasks must run where "
                "the inputs are visible under the same path"
            ) from None
        if any(getattr(inp, k) != v for k, v in now.items()):  # size and time (and a store's ETag)
            raise InputChanged(
                f"{inp.path} changed after the plan was made (size or mtime); plan again into a fresh --out dir"
            )


def task_records(plan: Plan, index: int, *, limits: ReadLimits) -> Iterator[RawRecord]:
    """The records of one task, read from its cut point on (a seek, or a frame start for .zst) to the next cut."""
    cut = plan.cuts[index]
    end = cut.position + cut.records
    if cut.records == 0:
        return
    for fi in range(cut.file, len(plan.inputs)):
        inp = plan.inputs[fi]
        first = fi == cut.file
        seek = cut.seek if first else Seek()
        start = cut.position if first else inp.first_position
        for raw in iter_file_records(
            as_input(inp.path, {"bytes": inp.bytes, "mtime_ns": inp.mtime_ns, "etag": inp.etag}),
            start_position=start,
            seek=seek,
            input_name=inp.name,
            limits=limits,
        ):
            if raw.position >= end:
                return
            yield raw
        if inp.first_position + inp.records >= end:
            return


def format_plan_summary(plan: Plan, out: Path) -> str:
    """A plan -> the lines `vlmprep build --plan-only` prints: the task count and how to run and merge them."""
    sizes = [c.bytes for c in plan.cuts]
    mean = sum(sizes) / max(len(sizes), 1)
    return (
        f"planned {out}: {plural(plan.records, 'record')} in {plural(plan.tasks, 'task')} "
        f"(largest task {max(sizes, default=0) / max(mean, 1):.2f}x the mean input bytes)\n"
        f"  run each: vlmprep build --out {out} --task-index I   (I = 0..{plan.tasks - 1})\n"
        f"  then:     vlmprep merge {out}"
    )
