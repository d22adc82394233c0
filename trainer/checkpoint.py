"""Checkpoints: model + optimizer + step (which fixes the LR schedule) + every rank's data position (and packer
state when packing) and RNG -> a torch.distributed.checkpoint dir RUN/checkpoints/step-NNNNNNNN, its marker written
last and the dir renamed into place only then; a resume takes the newest one still complete. RUN/run.json holds what
those mean (data, model, options): a run resumes only its own; RUN/trainer.lock keeps a second run out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer import locks
from trainer.config import ConfigError
from trainer.metrics import LOG_NAME
from vlmprep_schemas.boundary import UnsafeWrite, fresh_state_dir, open_no_follow, read_state, remove_state, state_dir
from vlmprep_schemas.terminal import for_terminal

_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class TrainState:
    """Where one rank is: the optimizer step and this rank's data position and packer state; what a checkpoint saves
    beside the model, optimizer and RNG states, and where a resume continues."""

    step: int
    epoch: int
    position: int  # this rank's samples consumed in `epoch`
    pack_state: list[int]  # this rank's Packer.state() ([] when the run does not pack)
    versions: tuple = ()  # the version of each dataset `epoch` reads (None: a source without versions); in the marker


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[world, *t.shape], identical on every rank, so DCP stores it once as a replicated tensor."""
    rank, world = _world()
    if world == 1:
        return t[None].clone()
    parts = [torch.empty_like(t, device=device) for _ in range(world)]
    dist.all_gather(parts, t.to(device))
    return torch.stack([p.cpu() for p in parts])


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(run_dir: str | Path) -> Path:
    """RUN/checkpoints, the dir that holds a run's step-NNNNNNNN checkpoints."""
    return Path(run_dir) / "checkpoints"


MARKER = "complete.json"  # written last into a checkpoint: the files it holds and their sizes


def _step_dirs(run_dir: str | Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    return sorted(p for p in root.glob("step-*") if _STEP_DIR.match(p.name)) if root.is_dir() else []


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (None: it is): its marker must list files that all still have the
    sizes they were saved with. A checkpoint from before markers counts as complete when its .metadata is there."""
    marker = path / MARKER
    if not marker.is_file():
        return None if (path / ".metadata").is_file() else f"no {MARKER} (the save did not finish)"
    try:
        files = json.loads(read_state(marker))["files"]  # a link or FIFO there: unreadable, never followed
        for name, size in files.items():
            got = (path / name).stat().st_size
            if got != size:
                return f"{name} has {got} bytes, {size} when saved (cut short)"
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MARKER} ({e})"
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint."""
    done = [p for p in _step_dirs(run_dir) if checkpoint_problem(p) is None]
    return done[-1] if done else None


def _write_marker(path: Path, state: TrainState) -> None:
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    tmp = path / f"{MARKER}.tmp"
    # the epoch and the dataset versions it reads: which data the checkpoint's position counts in
    marker = {"step": state.step, "files": files, "epoch": state.epoch, "versions": list(state.versions)}
    with open_no_follow(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MARKER)


def _gather_ragged(values: list[int], device: torch.device) -> torch.Tensor:
    """Every rank's int list as rows of one [world, longest] tensor, padded with -1 (no state value is negative)."""
    longest = int(max(_gather(torch.tensor(len(values)), device)))
    row = torch.full((longest,), -1, dtype=torch.int64)
    row[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return _gather(row, device)


def save_checkpoint(
    run_dir: str | Path, state: TrainState, *, net, optimizer, device: torch.device, keep_checkpoints: int
) -> Path:
    """Every rank's training state at `state.step` -> RUN/checkpoints/step-NNNNNNNN (returned), collectively: all
    ranks call it. Writes the model and optimizer state (torch.distributed.checkpoint, each rank its own shards), the
    step, every rank's data position (`state.epoch`, `state.position`) and packer state (`state.pack_state`), and
    every rank's RNG state into step-N.tmp, then rank 0 writes the completion marker and renames the dir into place,
    so a cut run leaves no dir a resume would take; the newest `keep_checkpoints` complete checkpoints stay.
    Trade-off: exact resume (same batches, same RNG) costs a full optimizer-state write each time, and ties a resume
    to the same world size."""
    step, epoch, position, pack_state = state.step, state.epoch, state.position, state.pack_state
    rank, world = _world()
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step-{step:08d}", root / f"step-{step:08d}.tmp"
    if rank == 0:  # RUN/checkpoints and step-N.tmp: real dirs of the run's own, a link planted there removed
        state_dir(root, root=run_dir)
        fresh_state_dir(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(net, optimizer)
    train = {
        "step": torch.tensor(step),
        "world": torch.tensor(world),
        "data": _gather(torch.tensor([epoch, position], dtype=torch.int64), device),
    }
    train.update({f"rng_{k}": _gather(v, device) for k, v in _rng_state(device).items()})
    pack = _gather_ragged(pack_state or [], device)
    train["pack_len"] = torch.tensor(pack.shape[1])
    if pack.shape[1]:
        train["pack"] = pack
    dcp.save({"model": model_sd, "optim": optim_sd, "train": train}, checkpoint_id=str(tmp))
    _barrier()
    if rank == 0:
        _write_marker(tmp, state)  # last: every rank's files are written
        remove_state(final)
        tmp.rename(final)
        # The newest `keep_checkpoints` complete ones stay; newer ones (cut short, and skipped by the resume that led
        # here) are left for this run to replace when it reaches their step.
        kept = [p for p in _step_dirs(run_dir) if p.name <= final.name and checkpoint_problem(p) is None]
        kept = kept[-keep_checkpoints:]
        for old in _step_dirs(run_dir):
            if old.name < final.name and old not in kept:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


RUN_LOCK = "trainer.lock"


@contextlib.contextmanager
def own_run_dir(run_dir: str | Path) -> Iterator[None]:
    """One trainer per run dir: rank 0 holds an fcntl.flock on RUN/trainer.lock for the whole run, its pid, host,
    start time and command written in it; when another run holds it, every rank refuses with that holder named
    (the other ranks of this run never take it). The kernel drops the lock when its holder dies, so the file a
    killed run leaves never blocks."""
    run_dir = Path(run_dir)
    rank, world = _world()
    fd, refusal, created = -1, "", not run_dir.exists()
    if rank == 0:
        try:
            state_dir(run_dir)  # --out itself a link (planted where the run is to be): refused, never followed
            fd, holder = locks.take(run_dir / RUN_LOCK)
            if holder:
                refusal = (
                    f"{run_dir} is in use by another trainer ({holder}): wait for it to end (or stop it), or "
                    "pass another --out; two runs in one dir would overwrite each other's checkpoints and "
                    "metrics"
                )
        except UnsafeWrite as e:
            refusal = str(e)
        except OSError as e:  # every rank must hear of it, or the others would wait for rank 0 forever
            refusal = f"--out {run_dir}: cannot create it or its {RUN_LOCK} ({e.strerror}): pass a writable dir"
    if world > 1:
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal:
        if fd >= 0:
            os.close(fd)
        raise ConfigError(refusal)
    try:
        yield
    finally:
        if fd >= 0:
            locks.release(run_dir / RUN_LOCK, fd)
            if created:  # a run that failed before writing anything leaves no dir
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # only where empty


RUN_FILE = "run.json"
# Everything the trainer writes into RUN, run.json first (hf/: the --save-hf export).
RUN_PROCESSOR = "processor"  # RUN/processor/: the run's copy of a processor in a bucket, which its export ships
RUN_STATE = (RUN_FILE, "checkpoints", "metrics.jsonl", LOG_NAME, "config.toml", "tb", "hf", RUN_PROCESSOR)


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _dataset_identity(shards, manifest: dict | None) -> list:
    listed = {s["name"]: s for s in (manifest or {}).get("shards", [])}
    data = [[s.name, listed[s.name].get("sha256"), s.num_bytes] if s.name in listed else [s.url] for s in shards]
    return [data, (manifest or {}).get("processor", {}).get("fingerprint")]


def run_identity(options: dict, *, datasets: list, model: dict, image_config: dict, world: int) -> dict:
    """What a run's checkpoints mean: the data by content (the manifest's per-shard sha256 and processor
    fingerprint, so a moved copy still matches; the URLs when there is no manifest; a mixture's names, weights and
    on_end too), the model, the image processor's settings, the rank count and `options`, every option outside
    RESUME_MAY_CHANGE (TrainConfig.resume_identity()). `datasets`: (DataSpec, DataSource) per source."""
    if len(datasets) == 1 and not datasets[0][0].name:
        data = _sha(_dataset_identity(datasets[0][1].shards, datasets[0][1].manifest))
    else:
        data = _sha([[d.name, d.weight, d.on_end, _dataset_identity(s.shards, s.manifest)] for d, s in datasets])
    return {"data": data, **model, "image_processor": _sha(image_config), "ranks": world, **options}


def _differences(old: dict, new: dict, old_data: str, new_data: str) -> str:
    out = []
    for k in sorted(set(old) | set(new), key=lambda k: (k not in ("data", "model", "model_config"), k)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if k == "data":
            out.append(f"data (--data {old_data} -> {new_data}, dataset fingerprint {str(a)[:12]} -> {str(b)[:12]})")
        elif k in ("model_config", "image_processor"):
            out.append(f"{k} (sha256 {str(a)[:12]} -> {str(b)[:12]})")
        else:
            out.append(f"{k} {a!r} -> {b!r}")
    return "; ".join(out)


def _held(run_dir: Path) -> list[str]:
    """What of a run's state RUN holds: only steps taken are worth protecting (a run that failed before its first
    step left just run.json/config.toml)."""
    return [
        n
        for n, p in ((n, run_dir / n) for n in ("checkpoints", "metrics.jsonl"))
        if p.is_file() and p.stat().st_size or p.is_dir() and any(p.iterdir())
    ]


def recorded_versions(run_dir: str | Path) -> dict | None:
    """The dataset versions a run that holds steps in `run_dir` recorded in RUN/run.json (pins.run_versions), which a
    resume reads again; None for a run dir without steps, without run.json (check_resumable says so) or from before
    versions were recorded. A malformed record is one ConfigError line."""
    from trainer.data import check_pins  # the data path's face: imports pins.py alone

    run_dir = Path(run_dir)
    if not _held(run_dir):
        return None
    try:
        saved = json.loads(read_state(run_dir / RUN_FILE))
    except (OSError, ValueError):
        return None
    try:
        return check_pins(saved.get("versions") if isinstance(saved, dict) else None, str(run_dir / RUN_FILE))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_resumable(run_dir: str | Path, identity: dict, data: str) -> None:
    """Read-only: refuse a run dir holding another run's state, before anything in it is touched."""
    run_dir = Path(run_dir)
    held = _held(run_dir)
    if not held:
        return
    ways_out = f"pass --no-resume to start over in {run_dir} (its run state is deleted), or another --out"
    try:
        saved = json.loads(read_state(run_dir / RUN_FILE))
        old, old_data = saved["identity"], saved["data_source"]
    except UnsafeWrite as e:
        raise ConfigError(str(e)) from None
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{run_dir} holds {', '.join(held)} but no readable {RUN_FILE} saying which data, model "
            f"and options it belongs to, so it cannot be resumed safely: {ways_out}"
        ) from None
    diff = _differences(old, identity, old_data, data)
    if diff:
        raise ConfigError(
            f"{run_dir} holds another run, which a resume would continue with other settings: {diff}; {ways_out}"
        )


def start_run_dir(
    run_dir: str | Path, identity: dict, data: str, *, resume: bool, versions: dict | None = None
) -> None:
    """Rank 0, after check_resumable passed on every rank: --no-resume deletes exactly the trainer's own files
    (run.json first, so an interrupted delete is never mistaken for a resumable run); then run.json is written, with
    the dataset `versions` the run reads (pins.run_versions)."""
    run_dir = Path(run_dir)
    if not resume:
        for name in RUN_STATE:
            p = run_dir / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    state_dir(run_dir)
    record = {"data_source": data, "identity": identity}
    if versions is not None:
        record["versions"] = versions
    _write_run_file(run_dir, record)


def _write_run_file(run_dir: Path, record: dict) -> None:
    tmp = run_dir / (RUN_FILE + ".tmp")
    with open_no_follow(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)


def record_versions(run_dir: str | Path, versions: dict) -> None:
    """Rank 0: RUN/run.json's `versions` replaced (atomically) where a --follow run moved to newer versions, the rest
    of it kept."""
    run_dir = Path(run_dir)
    record = json.loads(read_state(run_dir / RUN_FILE))
    record["versions"] = versions
    _write_run_file(run_dir, record)


def load_latest(
    run_dir: str | Path, *, net, optimizer, device: torch.device, packing: bool = False
) -> tuple[Path, TrainState] | None:
    """The newest checkpoint that is complete and loads, and its state (None: there is none). Each one skipped is
    named in one line on rank 0's stderr, with why (DCP's errors are raised on every rank alike, so all ranks skip
    it); where none is left, ConfigError (a failed load may have changed the model: never train on from there)."""
    skipped = []
    for path in reversed(_step_dirs(run_dir)):
        why = checkpoint_problem(path)
        if why is None:
            quiet = logging.root.manager.disable
            logging.disable(logging.WARNING)  # DCP logs each failed read with its traceback before it raises
            try:
                state = load_checkpoint(path, net=net, optimizer=optimizer, device=device, packing=packing)
                return path, dataclasses.replace(state, versions=_marker_versions(path))
            except ConfigError:
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException), EOF, pickle
                lines = str(e).strip().splitlines() or [type(e).__name__]
                why = f"unreadable ({lines[-1][:200]})"
            finally:
                logging.disable(quiet)
        skipped.append(f"{path.name}: {why}")
        if _world()[0] == 0:
            print(
                for_terminal(f"trainer: skipped checkpoint {path}: {why}; resuming from the one before it"),
                file=sys.stderr,
            )
    if skipped:
        raise ConfigError(
            f"{checkpoint_dir(run_dir)} holds no complete checkpoint ({'; '.join(skipped[:3])}): pass "
            "--no-resume to start over (its run state is deleted), or another --out"
        )
    return None


def _marker_versions(path: Path) -> tuple:
    """The dataset versions a checkpoint's marker names (() for one from before versions or markers were recorded)."""
    if not (path / MARKER).is_file():
        return ()
    versions = json.loads(read_state(path / MARKER)).get("versions", [])
    if not isinstance(versions, list) or not all(v is None or type(v) is int for v in versions):
        raise ConfigError(f"{path / MARKER}: its versions {versions!r} are not dataset version numbers")
    return tuple(versions)


def load_checkpoint(path: Path, *, net, optimizer, device: torch.device, packing: bool = False) -> TrainState:
    """A complete checkpoint dir -> the model and optimizer state loaded into `net` and `optimizer` in place, this
    rank's RNG restored, and its step, data position and packer state returned (TrainState), collectively. Refuses
    (ConfigError) a checkpoint written by another number of ranks, or with --pack-to where this run packs
    differently: the data positions would mean other samples. Checkpoints from before packing existed load as
    unpacked."""
    rank, world = _world()
    head = {"train": {"step": torch.tensor(0), "world": torch.tensor(0), "pack_len": torch.tensor(0)}}
    try:
        dcp.load(head, checkpoint_id=str(path))
    except BaseException as e:  # DCP's CheckpointException; a checkpoint from before packing existed
        if "pack_len" not in str(e):
            raise
        del head["train"]["pack_len"]
        dcp.load(head, checkpoint_id=str(path))
    pack_len = int(head["train"].get("pack_len", 0))
    if packing != (pack_len > 0):
        raise ConfigError(
            f"{path} was written {'with' if pack_len else 'without'} --pack-to: resume with the same "
            "batching options (or start a fresh run dir)"
        )
    saved_world = int(head["train"]["world"])
    if saved_world != world:
        raise ConfigError(
            f"{path} was written by {saved_world} ranks, this run has {world}: exact data resume "
            f"needs the same number of ranks (or start a fresh run dir)"
        )
    model_sd, optim_sd = get_state_dict(net, optimizer)
    rng = _rng_state(device)
    train = {"step": torch.tensor(0), "world": torch.tensor(0), "data": torch.zeros(world, 2, dtype=torch.int64)}
    train.update({f"rng_{k}": torch.zeros((world, *v.shape), dtype=v.dtype) for k, v in rng.items()})
    if pack_len:
        train["pack"] = torch.zeros(world, pack_len, dtype=torch.int64)
    state = {"model": model_sd, "optim": optim_sd, "train": train}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(train["rng_cpu"][rank].clone())  # set_rng_state segfaults on a view with a storage offset
    if "cuda" in rng:
        torch.cuda.set_rng_state(train["rng_cuda"][rank].clone(), device)
    epoch, position = (int(x) for x in train["data"][rank])
    pack_state = [int(x) for x in train["pack"][rank] if x >= 0] if pack_len else []
    return TrainState(step=int(train["step"]), epoch=epoch, position=position, pack_state=pack_state)
