"""The dataset versions a run reads, epoch by epoch (docs/datasets-that-grow.md): RUN/run.json's `versions` record ->
a resume reads the version its checkpoint's epoch was read at (checked unchanged) -> with --follow, at each epoch
boundary rank 0 reads each followed dataset's manifest.json (one bounded read; nothing waits for a version) and tells
the other ranks of a newer one -> every rank reads that version's record, checked to extend the one it read
(datasets.reopen), and makes the epoch's streams over it (the order: a function of seed, epoch and version) -> the
choice recorded in run.json for every epoch (a resume replays it) and logged: `epoch 3: version v7 (+12,345
samples)`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import TrainState, record_versions, run_identity
from trainer.config import ConfigError
from trainer.data import (
    DataError,
    ReadPlan,
    RunData,
    StepLoader,
    data_streams,
    epoch_entry,
    newer_version,
    reopen,
    replaced_samples,
    run_versions,
)
from trainer.options import Batching, DataOptions, RunLength


def _samples(ds) -> int:
    return sum(s.num_samples or 0 for s in ds.shards)


@dataclass(kw_only=True, eq=False)
class RunVersions:
    """The run's `versions` record (pins.run_versions: the versions its datasets were read at, one entry per epoch
    where a --follow run read them; a pinned run's one entry, at epoch 0) and what reading another version takes: the
    options, read plan, batching and length the streams are made with, the model's type and --pack-to (the checks a
    version passes), the run dir run.json is in, this rank and the device."""

    record: dict
    options: DataOptions
    plan: ReadPlan
    batching: Batching
    length: RunLength
    device: torch.device
    model_type: str
    moved: list[str] = field(default_factory=list)  # the lines logged at switches (tests read them)

    @classmethod
    def of(cls, data: RunData, pins: dict | None, options: DataOptions, plan: ReadPlan, **parts) -> "RunVersions":
        """The versions of a run that opened `data` (`pins`: a resumed run's record, pins.recorded_versions; None: a
        fresh start), read with `options` and `plan` (`parts`: batching, length, device, model_type); --follow
        refused where no dataset of it can grow."""
        if options.follow:
            check_follow(data)
        eval_specs = options.eval_sources
        return cls(
            record=run_versions(data.specs, data.datasets, eval_specs, data.eval_datasets, pins),
            options=options,
            plan=plan,
            **parts,
        )

    @property
    def out(self) -> Path:
        """The run dir, whose run.json holds the record."""
        return Path(self.options.out)

    @property
    def rank(self) -> int:
        """This rank."""
        return self.plan.rank

    def identity(self, options: dict, data: RunData, *, model: dict, world: int) -> dict:
        """checkpoint.run_identity of the run: its data as its first epoch read it (a later version's first shards
        are that version's, checked as it is read), so a resumed --follow run on a grown dataset is the same run."""
        first = self.history[0]["datasets"]
        datasets = []
        for i, (spec, ds) in enumerate(zip(data.specs, data.datasets)):
            n = first[i]["shards"] if i < len(first) and first[i]["version"] is not None else len(ds.shards)
            datasets.append((spec, dataclasses.replace(ds, shards=ds.shards[:n])))
        return run_identity(options, datasets=datasets, model=model, image_config=data.image.config, world=world)

    @property
    def history(self) -> list[dict]:
        """The epoch entries, oldest first (pins.epoch_entry)."""
        return self.record["data"]

    def entry_for(self, epoch: int) -> dict:
        """The entry `epoch` was read at: the newest one that begins at or before it."""
        return [h for h in self.history if h["epoch"] <= epoch][-1]

    def lengths(self, total: int | None, schedule_len: int) -> tuple[int | None, int]:
        """The run's step bound and LR schedule length. A --follow run of --epochs has no step bound (its epochs
        end it, however the data grows), and its schedule's length is fixed when it starts (--schedule-steps, else
        --max-steps, else the steps predicted then for every epoch on the starting versions: recorded, so a resume
        keeps it); past it the LR stays at lr x min_lr_ratio."""
        if not self.options.follow or self.length.max_steps:
            return total, schedule_len
        if not self.length.schedule_steps and "schedule_steps" not in self.record:
            self.record["schedule_steps"] = schedule_len
            if self.rank == 0:  # now, not at the first switch: a resume before it keeps this length too
                record_versions(self.out, self.record)
        return None, int(self.length.schedule_steps or self.record["schedule_steps"])

    def resume(self, state: TrainState, data: RunData, loader: StepLoader) -> RunData:
        """`data` at the versions the resumed checkpoint's epoch was read at (RUN/run.json; its marker names them
        too): the streams move to them where a --follow run opened newer ones."""
        entry = self.entry_for(state.epoch)
        want = tuple(e["version"] for e in entry["datasets"])
        if state.versions and tuple(state.versions) != want:
            raise ConfigError(
                f"{self.out}: its checkpoint of step {state.step} read dataset versions {list(state.versions)}, but "
                f"RUN/run.json records {list(want)} for its epoch {state.epoch}: the run dir was edited; pass "
                "--no-resume to start over, or another --out"
            )
        if data.versions() == want:
            return data
        return self._read_at(entry["datasets"], data, loader, epoch=state.epoch)

    def at_epoch(self, epoch: int, step: int, data: RunData, loader: StepLoader, log) -> RunData:
        """A --follow run at the start of `epoch` (after `step` steps): the versions recorded for it (a resumed run
        replays them), else each followed dataset's newest (rank 0 reads, every rank gets it), recorded; the streams
        move to them where they changed, and rank 0 logs each change (`log`: its RunLog, None elsewhere)."""
        recorded = [h for h in self.history if h["epoch"] == epoch]
        pins = recorded[0]["datasets"] if recorded else self._poll(data)
        new = self._read_at(pins, data, loader, epoch=epoch) if pins != [None] * len(pins) else data
        if not recorded:
            self.history.append(epoch_entry(epoch, step, data.specs, new.datasets))
            if self.rank == 0:
                record_versions(self.out, self.record)
        for spec, old, ds in zip(new.specs, data.datasets, new.datasets):
            if ds is not old and self.rank == 0:
                added, gone = replaced_samples(old, ds)
                said = (
                    f"+{added:,} samples, -{gone:,} replaced" if gone else f"{_samples(ds) - _samples(old):+,} samples"
                )
                name = f"{spec.name} " if spec.name else ""
                line = f"trainer: epoch {epoch}: {name}version v{ds.version.number} ({said})"
                self.moved.append(line)
                print(line, file=sys.stderr)
                if log is not None:
                    log.note(line)
        return new

    def _poll(self, data: RunData) -> list[dict | None]:
        """Rank 0 reads the newest version of each followed dataset (a plain DIR or URL: `DIR@vN` stays) and the
        others get its answer, or its one-line error (no rank is left waiting on another)."""
        answer: list = [None]
        if self.rank == 0:
            try:
                answer = [
                    [
                        newer_version(ds, option=f"--data {spec.name}:" if spec.name else "--data")
                        if ds.version is not None and ds.version.ref is None
                        else None
                        for spec, ds in zip(data.specs, data.datasets)
                    ]
                ]
            except DataError as e:
                answer = [str(e)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], str):
            raise DataError(answer[0])
        return answer[0]

    def _read_at(self, pins: list[dict | None], data: RunData, loader: StepLoader, *, epoch: int) -> RunData:
        new = reopen(data, pins, model_type=self.model_type, pack_to=self.batching.pack_to)
        if new.versions() != data.versions():
            streams, _ = data_streams(
                self.options,
                self.plan,
                new,
                batching=self.batching,
                length=self.length,
                device=self.device,
                epoch=epoch,
                announce=False,
            )
            loader.swap(streams)
        return new


def check_follow(data: RunData) -> None:
    """--follow needs a dataset to follow: a dataset dir or URL named plainly (`DIR@vN` and `DIR@TAG` stay pinned;
    shard patterns and pipe: name fixed shards)."""
    if not any(ds.version is not None and ds.version.ref is None for ds in data.datasets):
        raise ConfigError(
            f"--follow: no dataset of --data {data.label} can grow (a pinned DIR@vN or DIR@TAG stays at its version; "
            "a shard pattern or pipe: names fixed shards): pass a dataset dir or URL plainly, or drop --follow"
        )
