"""Hostile or damaged shards at training time, through the real `python -m trainer` entry point: planted pickle
members are refused before anything is deserialized, and every damaged shard is named in a one-line error."""

import hashlib
import io
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest

from tests.trainer.conftest import ROOT, trainer_cmd, trainer_env


class _Boom:
    """Unpickling this creates a file: the proof that nothing was unpickled or torch.load-ed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickle_bytes(marker) -> bytes:
    import pickle  # only to forge the hostile input; vlmprep and trainer never import it

    return pickle.dumps(_Boom(str(marker)))


def _object_npy(marker) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array([_Boom(str(marker))], dtype=object), allow_pickle=True)
    return buf.getvalue()


def _rewrite_shard(dataset, dst, edit, *, fix_manifest=True):
    """Copy the dataset and rewrite shard-000000.tar; with fix_manifest the attacker also updates bytes/sha256 and
    drops the shard's and the dataset's now stale sample index (the trainer indexes the tars itself, as for an older
    dataset), so only
    the decoder stands between the member and the trainer."""
    shutil.copytree(dataset, dst)
    tar = dst / "shard-000000.tar"
    with tarfile.open(tar) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in edit(members):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    tar.write_bytes(buf.getvalue())
    if fix_manifest:
        m = json.loads((dst / "manifest.json").read_text())
        m["shards"][0].update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
        for index in (m["shards"][0].pop("index", None), m.pop("sample_index", None)):
            if index:
                (dst / index["name"]).unlink()
        (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _train(data, out, workers=1) -> subprocess.CompletedProcess:
    args = ["--data", data, "--out", out, "--max-steps", 2, "--micro-batch-size", 2, "--num-workers", workers]
    return subprocess.run(
        trainer_cmd(args, 1), cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300
    )


def _one_line_error(proc) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainer: error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "member,forge",
    [
        ("0000000000.state.pyd", _pickle_bytes),  # webdataset's default decoders would unpickle this
        # The same refusal end to end for the other kinds (test_decode.py checks each kind cheaply in make test):
        pytest.param("0000000000.weights.pth", _pickle_bytes, marks=pytest.mark.slow),  # torch.load would run this
        pytest.param("0000000000.input_ids.npy", _object_npy, marks=pytest.mark.slow),  # np.load(allow_pickle=True)
    ],
)
def test_planted_pickle_members_are_refused_and_never_run(dataset, tmp_path, member, forge):
    marker = tmp_path / "unpickled"
    evil = forge(marker)

    def plant(members):
        return [(n, d) for n, d in members if n != member] + [(member, evil)]

    data = _rewrite_shard(dataset, tmp_path / "d", lambda ms: sorted(plant(ms), key=lambda x: x[0]))
    err = _one_line_error(_train(data, tmp_path / "run", workers=1))
    assert "shard-000000.tar" in err and member.split(".", 1)[1] in err and "refus" in err, err
    assert not marker.exists()


@pytest.mark.slow  # ~12 s, a trainer process: make test keeps test_integrity's cut shard refused at start-up
def test_truncated_shard_is_caught_at_start_up(dataset, tmp_path):
    data = tmp_path / "d"
    shutil.copytree(dataset, data)
    tar = data / "shard-000003.tar"
    tar.write_bytes(tar.read_bytes()[:5000])
    err = _one_line_error(_train(data, tmp_path / "run"))
    assert "shard-000003.tar" in err and "vlmprep verify" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before a single step


@pytest.mark.slow  # ~20 s: a trainer process (the start-up refusals stay in make test)
def test_corrupted_shard_at_training_time_names_the_shard(dataset, tmp_path):
    """Same size, garbage inside (a bit-rotted copy): found when the tar is read, with the shard in the error."""

    def corrupt(members):
        return [(n, b"\x00garbage" * (len(d) // 8 + 1) if n.endswith("input_ids.npy") else d) for n, d in members]

    data = _rewrite_shard(dataset, tmp_path / "d", corrupt)
    err = _one_line_error(_train(data, tmp_path / "run", workers=2))
    assert "shard-000000.tar" in err, err


def _first_image_sample(members) -> str:
    return next(n.split(".")[0] for n, d in members if n.endswith(".json") and b'"images": [{' in d)


def _hostile(kind):
    """Issue 32: a member claiming far more than it holds, in the first sample with an image."""
    from tests.support.hostile import deep_json, npy_claiming, png_claiming

    def edit(members):
        key = _first_image_sample(members)
        meta = json.loads(dict(members)[f"{key}.json"])
        if kind == "png":  # a PNG header claiming 40000x40000 in place of the stored image (its meta updated)
            meta["images"] = [
                {**im, "member": "img000.png"} if im["member"] == "img000.npy.zst" else im for im in meta["images"]
            ]
            new = {
                f"{key}.img000.npy.zst": (f"{key}.img000.png", png_claiming(40000, 40000)),
                f"{key}.json": (f"{key}.json", json.dumps(meta).encode()),
            }
        else:
            new = (
                {f"{key}.json": (f"{key}.json", deep_json(200_000))}
                if kind == "deep_json"
                else {f"{key}.loss_mask.npy": (f"{key}.loss_mask.npy", npy_claiming((10**12,), "|u1"))}
            )
        return [new.get(n, (n, d)) for n, d in members]

    return edit


def _address_space(limit: int):
    """A preexec_fn capping the trainer's address space (its DataLoader workers inherit it)."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


@pytest.mark.parametrize(
    "kind",
    [
        # json.loads recursed: a RecursionError traceback. Slow (~15 s, a trainer process): make test keeps the deep
        # meta through every reader in process (tests/test_hostile_shards.py) and the planted pickle through the CLI.
        pytest.param("deep_json", marks=pytest.mark.slow),
        pytest.param("npy_shape", marks=pytest.mark.slow),  # np.load allocated a terabyte: MemoryError
        pytest.param("png", marks=pytest.mark.slow),  # PIL's DecompressionBombError, or 4.8 GB decoded
    ],
)
def test_a_member_that_claims_more_than_it_holds_is_one_line_from_the_trainer(dataset, tmp_path, kind):
    """The trainer CLI (2 DataLoader workers), its address space capped at 6 GiB (torch maps about 3.3 GiB), names
    the shard in one line."""
    data = _rewrite_shard(dataset, tmp_path / "d", _hostile(kind))
    args = ["--data", data, "--out", tmp_path / "run", "--max-steps", 2, "--micro-batch-size", 2, "--num-workers", 2]
    proc = subprocess.run(
        trainer_cmd(args, 1),
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_address_space(6 << 30),
    )
    err = _one_line_error(proc)
    assert "shard-000000.tar" in err, err


def _within(fn, seconds: float = 10.0):
    """fn's exception (None if it returned), or a failure where it still waits after `seconds` (a FIFO read)."""
    import threading

    done: list = []

    def call():
        try:
            fn()
            done.append(None)
        except Exception as e:  # noqa: BLE001 - the test reads the kind
            done.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert done, f"still waiting after {seconds} s: a read waited on a FIFO"
    return done[0]


def test_a_fifo_planted_as_a_manifest_or_processor_file_is_one_line_never_waited_on(tmp_path):
    """The trainer's reads of a dataset's small files (manifest.json, a version record, a processor's config or
    tokenizer) open without waiting on a writer and refuse what is not a plain file; an oversized one too."""
    import os

    from trainer.data import DataError
    from trainer.data.processors import load_image_processor_config
    from trainer.data.sources import read_dataset_file, resolve_data

    d = tmp_path / "ds"
    (d / "processor").mkdir(parents=True)
    os.mkfifo(d / "manifest.json")
    os.mkfifo(d / "processor" / "tokenizer.json")
    os.symlink("tokenizer.json", d / "processor" / "preprocessor_config.json")  # a link to the FIFO
    for fn, named in (
        (lambda: resolve_data(str(d)), "not a plain file"),
        (lambda: read_dataset_file(str(d / "processor" / "tokenizer.json")), "not a plain file"),
        (lambda: read_dataset_file(str(d / "processor" / "preprocessor_config.json")), "not a plain file"),
    ):
        e = _within(fn)
        assert isinstance(e, DataError) and named in str(e) and "\n" not in str(e), e
    e = _within(lambda: load_image_processor_config(str(d / "processor")))
    assert isinstance(e, DataError) and "\n" not in str(e), e
    (d / "processor" / "big.json").write_bytes(b" " * 101)
    e = _within(lambda: read_dataset_file(str(d / "processor" / "big.json"), 100))
    assert isinstance(e, DataError) and "more than a reader accepts" in str(e), e
