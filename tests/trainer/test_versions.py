"""The trainer on datasets that grow (issue 55.2-3, docs/datasets-that-grow.md): `--data DIR@vN` / `DIR@TAG` / plain
`DIR` (the latest, resolved once); a run records the version and its record's sha256 in RUN/run.json, is unchanged by
appends (same ids, same losses), and a resume of a removed or changed version is refused in one line; --follow takes
each newer version at the next epoch boundary, logs it, records it per epoch, keeps eval sets and pinned members of a
mixture at their versions, and stops in one line on a dataset that goes back or is replaced."""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.trainer import test_remote
from tests.trainer.conftest import read_metrics
from tests.trainer.test_run_safety import _after_step, _error
from tests.vlmprep.builder.test_append import OPTS
from trainer.data import DataError
from trainer.data.sources import resolve_data
from trainer.train import main
from vlmprep_schemas.versions import version_name

BUILD = {**OPTS, "samples_per_shard": 4}  # tiny:qwen2-vl, the agent traces' tool template
TRACES = dict(min_images=1, max_images=2, width=160, height=128, overlong_fraction=0.0, text_only_fraction=0.3)
s3_server = test_remote.s3_server  # moto's S3 server on loopback, module-scoped
COMMON = ["--tiny-random", "qwen2-vl", "--no-progress", "--num-workers", "0", "--micro-batch-size", "2"]


def build(inputs, out: Path, *, append: bool = False) -> None:
    from vlmprep.builder.pipeline import build as vlmprep_build
    from vlmprep.config import BuildConfig

    vlmprep_build(BuildConfig(inputs=tuple(map(str, inputs)), out=str(out), append=append, **BUILD))


@pytest.fixture(scope="module")
def batches(tmp_path_factory) -> list[Path]:
    """Four batches of 6 agent traces, ids b0-... to b3-..."""
    from scripts.demo_traces import write_traces

    root = tmp_path_factory.mktemp("batches")
    out = []
    for k in range(4):
        out.append(root / f"b{k}.jsonl.zst")
        write_traces(out[-1], n=6, seed=k + 1, id_prefix=f"b{k}", **TRACES)
    return out


@pytest.fixture(scope="module")
def day1(tmp_path_factory, batches) -> Path:
    """Batch 0 built: 6 samples in 2 shards, no version records yet (version 1 is its manifest.json)."""
    out = tmp_path_factory.mktemp("day1") / "ds"
    build([batches[0]], out)
    return out


@pytest.fixture
def grown(day1, batches, tmp_path):
    """A fresh copy of day1 and a function that appends batch k to it."""
    d = tmp_path / "ds"
    shutil.copytree(day1, d)

    def grow(k: int) -> None:
        build([batches[k]], d, append=True)

    return d, grow


def _args(data, out, *extra) -> list[str]:
    return ["--data", str(data), "--out", str(out), *COMMON, *map(str, extra)]


def _rows(run: Path, keys=("step", "epoch", "sample_ids", "loss", "grad_norm")) -> list[list]:
    return [[m[k] for k in keys] for m in read_metrics(run) if "loss" in m]


def _versions(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["versions"]


def _ids(rows) -> list[str]:
    return [i for r in rows for i in r[2]]


def test_data_refs_read_that_version_and_plain_dir_the_latest(grown):
    d, grow = grown
    grow(1)
    grow(2)
    for ref, shards, number in ((f"{d}@v1", 2, 1), (f"{d}@v2", 4, 2), (f"{d}@v000003", 6, 3), (str(d), 6, 3)):
        ds = resolve_data(ref)
        assert len(ds.shards) == shards and ds.version.number == number, ref
        assert ds.version.sha256 == __import__("hashlib").sha256((d / version_name(number)).read_bytes()).hexdigest()
    for bad, named in ((f"{d}@v9", "no such version (the latest is v3"), (f"{d}@nosuch", "no version or tag 'nosuch'")):
        with pytest.raises(DataError, match="^--data ") as e:
            resolve_data(bad)
        assert named in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="a version names a dataset dir"):
        resolve_data(f"{d}/shard-{{000000..000001}}.tar@v1")


def test_a_pinned_run_is_unchanged_by_two_appends_between_its_start_and_its_resume(grown, tmp_path, capsys):
    """Plain DIR is resolved once: the resumed run reads the version it started on (same ids, same losses as an
    uninterrupted run, across an epoch boundary), while a new run reads the latest; the run records the version and
    its record's sha256; DIR@v3 on resume is refused in one line."""
    d, grow = grown
    schedule = ("--schedule-steps", 8, "--save-every", 2)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(_args(d, ref, "--max-steps", 5, *schedule)) == 0  # 3 steps an epoch: into epoch 1
    assert main(_args(d, run, "--max-steps", 2, *schedule)) == 0
    grow(1)
    grow(2)
    assert main(_args(d, run, "--max-steps", 5, *schedule)) == 0
    assert _rows(run) == _rows(ref) and max(r[1] for r in _rows(run)) == 1
    assert {i.split("-")[0] for i in _ids(_rows(run))} == {"b0"}
    pinned = _versions(run)["data"]
    assert len(pinned) == 1 and pinned[0]["datasets"][0]["version"] == 1
    assert (
        pinned[0]["datasets"][0]["sha256"]
        == __import__("hashlib").sha256((d / version_name(1)).read_bytes()).hexdigest()
    )
    fresh = tmp_path / "fresh"
    assert main(_args(d, fresh, "--max-steps", 1)) == 0
    assert _versions(fresh)["data"][0]["datasets"][0]["version"] == 3
    capsys.readouterr()
    assert main(_args(f"{d}@v3", run, "--max-steps", 6, *schedule)) == 1
    line = _error(capsys.readouterr().err)
    assert f"{d}@v3 is version 3, but this run trained on version 1" in line and "--no-resume" in line, line
    assert main(_args(f"{d}@v1", run, "--max-steps", 6, *schedule)) == 0  # the run's own version, named


def test_a_resume_of_a_removed_or_changed_version_is_refused_in_one_line(grown, tmp_path, capsys):
    d, grow = grown
    grow(1)
    run = tmp_path / "run"
    assert main(_args(f"{d}@v2", run, "--max-steps", 1)) == 0
    grow(2)
    record = d / version_name(2)
    original = record.read_bytes()
    record.write_bytes(original.replace(b'"created":', b'"created" :'))  # the same JSON, other bytes
    for data in (f"{d}@v2", d):
        assert main(_args(data, run, "--max-steps", 2)) == 1
        line = _error(capsys.readouterr().err)
        assert "is not the record this run trained on (sha256" in line and "--no-resume" in line, line
    record.unlink()  # as `vlmprep gc` removes a version it does not keep
    assert main(_args(d, run, "--max-steps", 2)) == 1
    line = _error(capsys.readouterr().err)
    assert "this run trained on its version 2 (RUN/run.json), which the dataset no longer holds" in line, line
    assert [m["step"] for m in read_metrics(run)] == [1]  # nothing trained on other data


def test_an_append_under_a_running_pinned_run_changes_nothing_and_removing_its_version_stops_it(
    grown, tmp_path, capsys, monkeypatch
):
    """The watch of a dataset without records starts on manifest.json and moves to versions/v000001.json when the
    first append records it; the run reads version 1 throughout. Its record removed under it stops it."""
    d, grow = grown
    _after_step(monkeypatch, 1, lambda: grow(1))
    assert main(_args(d, tmp_path / "run", "--epochs", 2)) == 0
    rows = _rows(tmp_path / "run")
    assert len(rows) == 6 and {i.split("-")[0] for i in _ids(rows)} == {"b0"}
    _after_step(monkeypatch, 1, lambda: (d / version_name(2)).unlink())
    assert main(_args(f"{d}@v2", tmp_path / "run2", "--epochs", 2)) == 1
    line = _error(capsys.readouterr().err)
    assert f"{d / version_name(2)} changed or was removed while this run reads it" in line, line


def _marker(run: Path) -> dict:
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    return json.loads((newest / "complete.json").read_text())


def test_follow_takes_each_newer_version_at_the_next_epoch_boundary_and_records_it(
    grown, tmp_path, capsys, monkeypatch
):
    """Epoch 0 reads version 1; the append during it is read from epoch 1 on (every sample of both, once an epoch),
    said in one line (stderr and train.log), recorded per epoch in run.json and in the checkpoint's marker; the eval
    set (the same dir, plain) stays at the version the run started with."""
    d, grow = grown
    _after_step(monkeypatch, 1, lambda: grow(1))
    run = tmp_path / "run"
    assert main(_args(d, run, "--follow", "--epochs", 3, "--eval-data", d)) == 0
    err = capsys.readouterr().err
    rows = _rows(run)
    by_epoch = [sorted(_ids([r for r in rows if r[1] == e])) for e in range(3)]
    assert len(by_epoch[0]) == len(set(by_epoch[0])) == 6 and {i.split("-")[0] for i in by_epoch[0]} == {"b0"}
    assert by_epoch[1] == by_epoch[2] and len(set(by_epoch[1])) == 12 and set(by_epoch[0]) < set(by_epoch[1])
    moved = [line for line in err.splitlines() if ": version v" in line]
    assert moved == ["trainer: epoch 1: version v2 (+6 samples)"], err[-3000:]
    assert moved[0] in (run / "train.log").read_text()
    history = _versions(run)["data"]
    assert [(h["epoch"], h["step"], h["datasets"][0]["version"]) for h in history] == [(0, 0, 1), (1, 3, 2), (2, 9, 2)]
    assert _marker(run)["versions"] == [2] and _marker(run)["epoch"] == 3
    evals = [m for m in read_metrics(run) if "eval_loss" in m]
    assert evals[-1]["eval_samples"] == 6 and _versions(run)["eval_data"][0]["version"] == 1


@pytest.mark.slow  # ~30 s on 2 cores: four runs and a SIGKILL
def test_a_sigkill_and_resume_across_a_version_switch_replays_the_same_ids_and_losses(grown, tmp_path):
    """Two runs end epoch 0 on version 1; version 2 lands; the reference goes on uninterrupted through epoch 1, the
    other is SIGKILLed in epoch 1 (its newest checkpoint is still in epoch 0), version 3 lands, and its resume reads
    epoch 1 at version 2 as recorded (not the newest, 3), as the reference did: the same ids, losses and grad norms,
    step by step, and the same record of versions."""
    from tests.trainer.conftest import kill_at_step

    d, grow = grown
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = ["--data", str(d), *COMMON, "--follow", "--schedule-steps", 20, "--save-every", 100]
    for out in (ref, run):
        assert main([*map(str, common), "--out", str(out), "--max-steps", "3"]) == 0  # epoch 0, version 1
    grow(1)
    assert main([*map(str, common), "--out", str(ref), "--max-steps", "9"]) == 0  # epoch 1 at version 2
    kill_at_step([*common, "--max-steps", 9], run, 5, tmp_path / "killed.log")
    assert [h["datasets"][0]["version"] for h in _versions(run)["data"]] == [1, 2]  # recorded before it was killed
    grow(2)
    assert main([*map(str, common), "--out", str(run), "--max-steps", "9"]) == 0
    assert _rows(run) == _rows(ref) and [r[1] for r in _rows(run)] == [0] * 3 + [1] * 6
    assert _versions(run)["data"] == _versions(ref)["data"]


def test_a_mixture_follows_its_plain_datasets_and_keeps_its_pinned_ones(
    grown, day1, batches, tmp_path, capsys, monkeypatch
):
    d, grow = grown
    other = tmp_path / "other"
    shutil.copytree(day1, other)
    _after_step(monkeypatch, 1, lambda: (grow(1), build([batches[2]], other, append=True)))
    run = tmp_path / "run"
    mixture = ["--data", f"name=a,path={d}", "--data", f"name=b,path={other}@v1"]
    assert main([*mixture, "--out", str(run), *COMMON, "--follow", "--max-steps", "12"]) == 0
    moved = [line for line in capsys.readouterr().err.splitlines() if ": a version v" in line or ": b version" in line]
    assert moved == ["trainer: epoch 1: a version v2 (+6 samples)"]
    assert [[e["version"] for e in h["datasets"]] for h in _versions(run)["data"]] == [[1, 1], [2, 1]]
    late = _ids([r for r in _rows(run) if r[1] == 1])  # epoch 1, a few steps of it
    assert {i.split("-")[0] for i in late if i.startswith("a/")} == {"a/b0", "a/b1"}
    assert {i.split("-")[0] for i in late if i.startswith("b/")} == {"b/b0"}
    assert {i.split("-")[0] for i in _ids([r for r in _rows(run) if r[1] == 0])} == {"a/b0", "b/b0"}


def test_follow_needs_a_dataset_that_can_grow(grown, tmp_path, capsys):
    d, _ = grown
    assert main(_args(f"{d}@v1", tmp_path / "run", "--follow", "--max-steps", 1)) == 1
    assert "--follow: no dataset of --data" in _error(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_a_followed_dataset_that_goes_back_stops_the_run_at_the_epoch_boundary_in_one_line(
    grown, tmp_path, capsys, monkeypatch
):
    d, grow = grown
    grow(1)
    _after_step(monkeypatch, 1, lambda: shutil.copy(d / version_name(1), d / "manifest.json"))
    assert main(_args(d, tmp_path / "run", "--follow", "--epochs", 2)) == 1
    line = _error(capsys.readouterr().err)
    assert "manifest.json went back to version 1, but this run already reads version 2" in line, line
    assert "never" not in line and {r[1] for r in _rows(tmp_path / "run")} == {0}  # epoch 0 only, nothing switched


def _opened(ref, world: int = 1):
    from tests.trainer.conftest import open_data_of
    from trainer.config import TrainConfig

    return open_data_of(TrainConfig(data=str(ref), tiny_random="qwen2-vl", follow=True), world)


def _reopen(data, pin):
    from trainer.data import reopen

    return reopen(data, [pin], model_type="qwen2_vl", pack_to=0)


def _newer(data):
    from trainer.data import newer_version

    return newer_version(data.datasets[0])


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_a_follow_poll_takes_a_newer_version_and_refuses_one_that_went_back_or_was_replaced(
    grown, day1, batches, tmp_path
):
    d, grow = grown
    data = _opened(d)
    assert _newer(data) is None  # nothing new: the run goes on, nothing waits
    grow(1)
    pin = _newer(data)
    moved = _reopen(data, pin)
    assert pin["version"] == 2 and moved.versions() == (2,) and len(moved.datasets[0].shards) == 4
    assert moved.watch.watched[0].path == d / version_name(2)  # the watch moves to the new record
    original = (d / "manifest.json").read_bytes()
    shutil.copy(d / version_name(1), d / "manifest.json")
    with pytest.raises(DataError) as e:
        _newer(moved)
    assert "went back to version 1, but this run already reads version 2" in _one_line(e)
    (d / "manifest.json").write_bytes(original.replace(b'"created":', b'"created" :'))
    with pytest.raises(DataError) as e:
        _newer(moved)
    assert "names version 2, the version this run reads, with other bytes than its record" in _one_line(e)
    # another dataset's manifest.json: a version this one never had, then with its record too
    other = tmp_path / "other"
    shutil.copytree(day1, other)
    for k in (3, 2):
        build([batches[k]], other, append=True)
    shutil.copy(other / "manifest.json", d / "manifest.json")
    with pytest.raises(DataError) as e:
        _newer(moved)
    assert "says version 3, but versions/v000003.json is not there" in _one_line(e)
    shutil.copy(other / version_name(3), d / version_name(3))
    with pytest.raises(DataError) as e:
        _reopen(moved, _newer(moved))
    assert "version 3 (versions/v000003.json) does not start with the shards of version 2" in _one_line(e)


def _lying_record(d: Path, edit) -> None:
    """Version 3 of `d` written by hand from version 2's record (and manifest.json its copy), edited by `edit`."""
    record = json.loads((d / version_name(2)).read_text())
    record["version"] = {**record["version"], "number": 3, "parent": 2}
    edit(record)
    data = json.dumps(record).encode()
    (d / version_name(3)).write_bytes(data)
    (d / "manifest.json").write_bytes(data)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda r: r["shards"].reverse(), "does not start with the shards of version 2"),
        (lambda r: r["shards"][0].update(sha256="0" * 64), "does not start with the shards of version 2"),
        (lambda r: r["shards"].append({**r["shards"][-1], "name": "../outside.tar"}), "is not a plain .tar file name"),
        (lambda r: r["processor"].update(fingerprint="f" * 64), "was rendered with another processor"),
    ],
    ids=["reordered", "an-old-shard-changed", "a-shard-outside", "another-processor"],
)
def test_a_version_record_that_lies_is_refused_in_one_line_at_the_switch(grown, edit, named):
    d, grow = grown
    grow(1)
    data = _opened(d)
    _lying_record(d, edit)
    with pytest.raises(DataError) as e:
        _reopen(data, _newer(data))
    assert named in _one_line(e)


def test_a_version_record_with_lying_sizes_is_refused_when_its_shards_are_indexed(grown, tmp_path):
    from trainer.data.pipeline import rank_sources

    d, grow = grown
    grow(1)
    data = _opened(d)

    def new_shard_size(r):  # a new shard (a copy of one, with its sidecar) whose size the record gets wrong
        shard, index = "shard-v000003-000000.tar", "shard-v000003-000000.tar.index.npy"
        shutil.copy(d / r["shards"][-1]["name"], d / shard)
        shutil.copy(d / r["shards"][-1]["index"]["name"], d / index)
        last = r["shards"][-1]
        r["shards"].append(
            {**last, "name": shard, "bytes": last["bytes"] + 1, "index": {**last["index"], "name": index}}
        )
        del r["sample_index"]  # each shard's own sidecar, so its rows are not the dataset index's

    _lying_record(d, new_shard_size)
    moved = _reopen(data, _newer(data))
    with pytest.raises(DataError) as e:
        rank_sources(moved.specs, moved.datasets, moved.plans, rank=0, world=1, cache=tmp_path / "cache")
    assert "shard-v000003-000000.tar: " in _one_line(e) and "but its manifest says" in str(e.value)


def test_a_tag_reads_its_version_and_one_planted_as_a_link_or_fifo_is_one_line(grown, tmp_path):
    import hashlib
    import threading

    from vlmprep_schemas.versions import Tag, tag_file

    d, grow = grown
    grow(1)
    (d / "versions" / "tags").mkdir()
    sha = hashlib.sha256((d / version_name(1)).read_bytes()).hexdigest()
    (d / tag_file("day-one")).write_bytes(Tag("day-one", 1, sha, "2026-12-01T00:00:00Z").to_bytes())
    ds = resolve_data(f"{d}@day-one")
    assert ds.version.number == 1 and ds.version.ref == "day-one" and len(ds.shards) == 2
    outside = tmp_path / "outside.json"
    outside.write_bytes((d / tag_file("day-one")).read_bytes())
    os.symlink(outside, d / tag_file("linked"))
    os.mkfifo(d / tag_file("piped"))
    for ref, named in (("linked", "outside the dataset"), ("piped", "not a plain file")):
        done: list = []
        t = threading.Thread(target=lambda ref=ref, done=done: done.append(_catch(lambda: resolve_data(f"{d}@{ref}"))))
        t.start()
        t.join(10)
        assert done and isinstance(done[0], DataError), f"{ref}: no one-line refusal within 10 s"
        assert named in str(done[0]) and "\n" not in str(done[0]), done[0]


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the kind
        return e
    return None


def test_versions_of_a_dataset_in_s3_and_over_http_are_read_and_followed(grown, s3_server, tmp_path, capsys):
    from tests.support.range_server import RangeServer

    d, grow = grown
    grow(1)
    url = test_remote._to_s3(d, "grown-bucket")
    for ref, shards, number in ((f"{url}@v1", 2, 1), (url, 4, 2)):
        ds = resolve_data(ref)
        assert len(ds.shards) == shards and ds.version.number == number and ds.shards[0].url.startswith(url + "/")
    with pytest.raises(DataError) as e:
        resolve_data(f"{url}@v9")
    assert "no such version (the latest is v2" in _one_line(e)
    run = tmp_path / "run"
    assert main(_args(f"{url}@v1", run, "--max-steps", 1)) == 0
    assert _versions(run)["data"][0]["datasets"][0] | {"sha256": None} == {
        "name": "",
        "path": f"{url}@v1",
        "dataset": url,
        "shards": 2,
        "samples": 6,
        "version": 1,
        "record": version_name(1),
        "sha256": None,
        "ref": "v1",
    }
    with RangeServer(d.parent) as srv:
        data = _opened(f"{srv.url}/ds")
        assert data.versions() == (2,) and _newer(data) is None
        grow(2)
        moved = _reopen(data, _newer(data))
        assert moved.versions() == (3,) and len(moved.datasets[0].shards) == 6
        assert moved.datasets[0].shards[-1].url == f"{srv.url}/ds/shard-v000003-000001.tar"


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_a_follow_run_of_epochs_resumed_after_a_switch_keeps_the_lr_schedule_it_started_with(
    grown, day1, batches, tmp_path, monkeypatch
):
    """--follow --epochs: the LR schedule's length is the steps predicted at the start (2 epochs of version 1: 6),
    recorded in run.json at once; a run cut in epoch 1 (at version 2, 6 steps an epoch) resumes with that length,
    not one predicted over version 2, so its rows (ids, losses, learning rates) are the uninterrupted run's."""
    d, grow = grown
    other = tmp_path / "other"
    shutil.copytree(day1, other)
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = ("--follow", "--epochs", 2, "--save-every", 1)
    _after_step(monkeypatch, 1, lambda: grow(1))
    assert main(_args(d, ref, *common)) == 0
    assert _versions(ref)["schedule_steps"] == 6
    monkeypatch.undo()

    def cut():
        raise KeyboardInterrupt  # the run stopped by hand in epoch 1, after its switch to version 2

    _after_step(monkeypatch, 1, lambda: build([batches[1]], other, append=True))
    _after_step(monkeypatch, 5, cut)
    with pytest.raises(KeyboardInterrupt):
        main(_args(other, run, *common))
    monkeypatch.undo()
    assert _versions(run)["schedule_steps"] == 6
    assert main(_args(other, run, *common)) == 0
    keys = ("step", "epoch", "sample_ids", "loss", "lr")
    assert _rows(run, keys) == _rows(ref, keys) and len(_rows(ref)) == 9


@pytest.mark.slow  # two torchrun launches of 2 ranks: ~1-2 min on 2 cores
def test_two_ranks_take_a_new_version_together_at_the_epoch_boundary(grown, tmp_path):
    """Rank 0 reads manifest.json at the boundary and tells rank 1 (broadcast); both read the new version's shards,
    planned over the ranks anew: each epoch from then on reads every sample of version 2 once, across the ranks."""
    from tests.trainer.conftest import run_trainer

    d, grow = grown
    run = tmp_path / "run"
    args = ["--data", d, "--out", run, *COMMON, "--follow", "--save-every", 1]
    run_trainer([*args, "--max-steps", 2], nproc=2, timeout=300)  # epoch 0 at version 1: 4 + 2 samples a rank
    assert {r[1] for r in _rows(run)} == {0}
    grow(1)
    proc = run_trainer([*args, "--max-steps", 12], nproc=2, timeout=300)
    assert "trainer: epoch 1: version v2 (+6 samples)" in proc.stderr, proc.stderr[-3000:]
    rows = _rows(run)
    v1, v2 = sorted(_ids([r for r in rows if r[1] == 0])), sorted(_ids([r for r in rows if r[1] == 1]))
    assert len(v1) == len(set(v1)) == 6 and len(v2) == len(set(v2)) == 12 and set(v1) < set(v2)
    assert sorted(_ids([r for r in rows if r[1] == 2])) == v2
    history = [(h["epoch"], h["datasets"][0]["version"]) for h in _versions(run)["data"]]  # an entry an epoch
    assert history[:2] == [(0, 1), (1, 2)] and {v for _, v in history[1:]} == {2}


def _rebuilding(batches, tmp_path):
    """A dataset of a copy of batch 0 (v1), and a function that rebuilds it (3 records now, ids b0-...1..3 again,
    other content) with batch 1 added, as `vlmprep watch --on-change rebuild` does: v2."""
    from scripts.demo_traces import write_traces
    from vlmprep.builder.pipeline import build as vlmprep_build
    from vlmprep.config import BuildConfig

    src, d = tmp_path / "b0.jsonl.zst", tmp_path / "ds"
    shutil.copyfile(batches[0], src)
    build([src], d)

    def rebuild():
        write_traces(src, n=3, seed=77, id_prefix="b0", **TRACES)
        cfg = BuildConfig(inputs=(str(src), str(batches[1])), out=str(d), append=True, **BUILD)
        res = vlmprep_build(cfg, replace=True)
        assert res.manifest.version["removed"]["totals"]["samples"] == 6

    return d, rebuild


def test_a_follow_poll_takes_a_version_that_replaced_samples(batches, tmp_path):
    from trainer.data import replaced_samples

    d, rebuild = _rebuilding(batches, tmp_path)
    data = _opened(d)
    rebuild()
    moved = _reopen(data, _newer(data))
    assert moved.versions() == (2,)
    assert replaced_samples(data.datasets[0], moved.datasets[0]) == (9, 6)
    names = [s.name for s in moved.datasets[0].shards]  # v1's two shards held only b0's samples: emptied, dropped
    assert len(names) == 3 and all(n.startswith("shard-v000002-") and "-r-" not in n for n in names), names


@pytest.mark.slow  # ~27 s on 2 cores: four runs
def test_a_rebuild_leaves_a_pinned_run_unchanged_and_a_follow_run_takes_the_rebuilt_samples(
    batches, tmp_path, capsys, monkeypatch
):
    """Version 2 rebuilds input b0 (its content changed: 3 records now, ids b0-...1..3 again, other content) and adds
    b1: a run on plain DIR started at v1 resumes on v1 with the ids and losses of an uninterrupted run of DIR@v1; a
    --follow run takes v2 at the epoch boundary, says what it replaced, and from then on trains on v2's samples alone
    (b0's removed ids 4..6 never again)."""
    d, rebuild = _rebuilding(batches, tmp_path)
    schedule = ("--schedule-steps", 8, "--save-every", 2)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(_args(f"{d}@v1", ref, "--max-steps", 5, *schedule)) == 0
    assert main(_args(d, run, "--max-steps", 2, *schedule)) == 0
    _after_step(monkeypatch, 1, rebuild)  # during the follow run's epoch 0
    follow = tmp_path / "follow"
    assert main(_args(d, follow, "--follow", "--epochs", 2)) == 0
    assert main(_args(d, run, "--max-steps", 5, *schedule)) == 0  # resumed after the rebuild: still v1
    assert _rows(run) == _rows(ref) and _versions(run)["data"][0]["datasets"][0]["version"] == 1
    err = capsys.readouterr().err
    moved = [line for line in err.splitlines() if ": version v" in line]
    assert moved == ["trainer: epoch 1: version v2 (+9 samples, -6 replaced)"], err[-3000:]
    rows = _rows(follow)
    v1_ids = sorted(_ids([r for r in rows if r[1] == 0]))
    v2_ids = sorted(_ids([r for r in rows if r[1] == 1]))
    assert len(v1_ids) == 6 and {i.split("-")[0] for i in v1_ids} == {"b0"}
    assert len(v2_ids) == len(set(v2_ids)) == 9
    assert sorted(i for i in v2_ids if i.startswith("b0")) == sorted(v1_ids)[:3]  # the rebuilt ones, not 4..6
    assert not set(v2_ids) & set(sorted(v1_ids)[3:])
