"""What --out holds when a build starts: check_out refuses another build's dataset or plan, files no build wrote, or
a dataset with versions, unless --overwrite (or --append, for the last); clear_dataset removes an older dataset's
files before a whole build, clear_attempt an unfinished append's (never a file a committed version names).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from vlmprep.builder.plan import Plan, PlanError, config_changes, load_plan
from vlmprep.builder.workers import BuildError
from vlmprep.config import BuildConfig, spelled, spelled_flag
from vlmprep.shards.dataset import BUILD_FILES, DATASET_FILES, FAILED_NAME, MANIFEST_NAME, TASKS_DIR, is_ours
from vlmprep.shards.versions import highest_version, index_file, rejects_file, removed_ids_name, shard_prefix
from vlmprep_schemas.boundary import UnsafeWrite, read_state
from vlmprep_schemas.versions import VERSIONS_DIR, ids_name


def plan_options(plan: Plan) -> dict:
    """What a plan was made of (config, task count, input stamps): two plans of the same options are the same."""
    return {
        "config": plan.config,
        "tasks": plan.tasks,
        "inputs": [(i.path, i.bytes, i.mtime_ns, i.etag) for i in plan.inputs],
    }


def clear_dataset(out: Path) -> None:
    """Remove every trace of an older dataset or plan in `out` (files vlmprep writes, every version's; never a file
    of the user's)."""
    for p in out.iterdir():
        if p.is_file() and is_ours(p.name, DATASET_FILES):
            p.unlink()
    shutil.rmtree(out / TASKS_DIR, ignore_errors=True)
    if (out / VERSIONS_DIR).is_symlink():
        (out / VERSIONS_DIR).unlink()
    shutil.rmtree(out / VERSIONS_DIR, ignore_errors=True)


def clear_attempt(out: Path, n: int, *, keep_tasks: int = 0) -> None:
    """Remove what an unfinished build of version `n` (not committed: no record of it exists) left in `out`: its
    shards and their sample indexes and temp files, its rejects, index and id file, the tasks of an older plan.
    `keep_tasks` (a --task-index run, which plans while others of the same plan may be running): only the task files
    of indexes from `keep_tasks` on go; each task clears its own shards as it starts, the merge rewrites the rest.
    Never a file of a committed version: their names carry their own numbers."""
    if keep_tasks:
        for p in (out / TASKS_DIR).glob("task-*"):
            if not p.name[5:10].isdigit() or int(p.name[5:10]) >= keep_tasks:
                p.unlink(missing_ok=True)
        return
    for p in out.iterdir():
        own = p.name.startswith(shard_prefix(n, None)) if n > 1 else False
        if p.is_file() and (own or p.name in (rejects_file(n), index_file(n), FAILED_NAME)):
            p.unlink()
    (out / ids_name(n)).unlink(missing_ok=True)
    (out / removed_ids_name(n)).unlink(missing_ok=True)
    shutil.rmtree(out / TASKS_DIR, ignore_errors=True)


def check_out(cfg: BuildConfig, out: Path) -> None:
    """Refuse (changing nothing) an --out holding another build's dataset or plan with other options, or files no
    build wrote, unless --overwrite; a dataset that failed its checks (build-failed.txt) is replaced, saying so. The
    same build again passes: it resumes, or finds the dataset complete. A dataset with versions is only appended to
    (--append; builder/append.py checks its options) or replaced whole (--overwrite)."""
    if cfg.overwrite or not out.exists():
        return
    if not out.is_dir():
        raise BuildError(f"--out {out} is a file: pass a directory")
    foreign = sorted(p.name for p in out.iterdir() if not is_ours(p.name, BUILD_FILES))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise BuildError(
            f"--out {out} holds files no vlmprep build wrote ({shown}); build into an empty or new dir, "
            "or pass --overwrite to build beside them"
        )
    try:
        old = load_plan(out)
    except PlanError as e:
        raise BuildError(f"{e}; or pass --overwrite to replace it") from None
    if cfg.append:
        return
    top = highest_version(out)
    if (top or 1) > 1 or (old is not None and old.append is not None):
        raise BuildError(
            f"--out {out} holds a dataset with versions (v{top or old.append.version}): pass --append to add the "
            "--in inputs as its next version, or --overwrite to replace it whole"
        )
    old_config = old.config if old is not None else manifest_config(out)
    if old_config is None:
        return
    asked = cfg.to_json()
    differ = config_changes(asked, old_config)
    if differ and (out / FAILED_NAME).is_file() and (out / MANIFEST_NAME).is_file():
        # A dataset that failed its checks is there to be looked at, not kept: its own fix line must just work.
        print(
            f"vlmprep build: replacing the dataset in {out}, which failed its checks ({FAILED_NAME}), with one "
            f"built with {', '.join(spelled_flag(k, asked.get(k)) for k in differ[:3])}",
            file=sys.stderr,
        )
        return
    if differ:
        now = {k: spelled_flag(k, v) if isinstance(v, bool) else spelled(k, v) for k, v in asked.items()}
        shown = ", ".join(
            f"{spelled_flag(k, old_config.get(k))} there, {now.get(k, 'not set')} asked" for k in differ[:3]
        ) + (f" (and {len(differ) - 3} more)" if len(differ) > 3 else "")
        grow = "; to add other inputs as a new version, pass --append" if differ == ["inputs"] else ""
        raise BuildError(
            f"--out {out} holds a dataset built with other options ({shown}); pass --overwrite to "
            f"replace it, or build into another --out{grow}"
        )


def manifest_config(out: Path) -> dict | None:
    """The config in DIR/manifest.json (None: no manifest; a marker dict where it is unreadable)."""
    try:
        return json.loads(read_state(out / MANIFEST_NAME)).get("config")
    except FileNotFoundError:
        return None
    except UnsafeWrite:
        raise  # a link or FIFO planted there: named as such, not as another build's dataset
    except (OSError, ValueError, AttributeError):
        return {"manifest": "unreadable"}
