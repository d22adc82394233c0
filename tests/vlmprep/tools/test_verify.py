import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from vlmprep.builder.pipeline import build
from vlmprep.cli import app
from vlmprep.config import BuildConfig
from vlmprep.tools.verify import verify_dataset


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from scripts.demo_traces import write_traces

    d = tmp_path_factory.mktemp("verify")
    write_traces(
        d / "t.jsonl.zst",
        n=6,
        seed=2,
        min_images=1,
        max_images=3,
        width=320,
        height=200,
        overlong_fraction=0.0,
        text_only_fraction=0.2,
    )
    # The demo's agent turns are tool calls: the tool-aware template renders them (the default would reject).
    template = Path(__file__).resolve().parents[3] / "vlmprep" / "templates" / "qwen2_vl_tools.jinja"
    build(
        BuildConfig(
            inputs=(str(d / "t.jsonl.zst"),),
            out=str(d / "ds"),
            samples_per_shard=3,
            seq_len=4096,
            progress=False,
            chat_template=str(template),
            processor="tiny:qwen2-vl",  # Qwen2-VL's classes over a small vocabulary: each verify loads it fast
        )
    )
    assert len(list((d / "ds").glob("shard-*.tar"))) >= 2
    return d / "ds"


@pytest.fixture
def ds(built, tmp_path):
    shutil.copytree(built, tmp_path / "ds")
    return tmp_path / "ds"


def read_samples(path):
    """(key, {member: bytes}) per sample, straight from the tar: these tests forge shards behind the reader's back."""
    out = []
    with tarfile.open(path) as tf:
        for m in tf:
            key, _, ext = m.name.partition(".")
            if not out or out[-1][0] != key:
                out.append((key, {}))
            out[-1][1][ext] = tf.extractfile(m).read()
    return out


def npy(a):
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=True)
    return buf.getvalue()


def rewrite_first_image_sample(ds, mutate):
    """Mutate the first sample with an image in shard 0, rewrite the tar and re-seal the manifest, so only
    the per-sample checks can catch it."""
    name = "shard-000000.tar"
    samples = list(read_samples(ds / name))
    k = next(i for i, (_, m) in enumerate(samples) if json.loads(m["json"])["num_images"])
    mutate(samples[k][1])
    with tarfile.open(ds / name, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key, members in samples:
            for ext, data in members.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    manifest = json.loads((ds / "manifest.json").read_text())
    data = (ds / name).read_bytes()
    manifest["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ds / "manifest.json").write_text(json.dumps(manifest))


def test_clean_dataset_verifies_via_cli(built):
    res = CliRunner().invoke(app, ["verify", str(built)])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output


def test_shard_level_faults(ds):
    data = bytearray((ds / "shard-000000.tar").read_bytes())
    data[700] ^= 0xFF
    (ds / "shard-000000.tar").write_bytes(bytes(data))
    (ds / "shard-000009.tar").write_bytes(b"stray")
    (ds / "shard-000001.tar").unlink()
    got = sorted(str(v) for v in verify_dataset(ds))
    assert got == [
        "shard-000000.tar: sha256 differs from the manifest",
        "shard-000001.tar: missing",
        "shard-000009.tar: shard file not listed in the manifest",
    ]
    res = CliRunner().invoke(app, ["verify", str(ds)])
    assert res.exit_code == 1 and "FAIL shard-000001.tar: missing" in res.output


def test_manifest_faults(ds):
    m = json.loads((ds / "manifest.json").read_text())
    (ds / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    assert "format_version 99" in str(verify_dataset(ds)[0])
    del m["totals"]
    (ds / "manifest.json").write_text(json.dumps(m))
    assert "schema" in str(verify_dataset(ds)[0])
    (ds / "manifest.json").unlink()
    assert "missing" in str(verify_dataset(ds)[0])


def _set_array(ext, fn):
    def mutate(members):
        members[ext] = npy(fn(np.load(io.BytesIO(members[ext]))))

    return mutate


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (_set_array("loss_mask.npy", lambda m: np.ones_like(m)), "loss_mask trains image placeholder tokens"),
        (_set_array("loss_mask.npy", lambda m: m[:-1]), "loss_mask.npy declares shape"),
        (
            _set_array("image_grid_thw.npy", lambda g: g * np.array([1, 2, 1], np.int32)),
            "image placeholders, grid rows need",
        ),
        (_set_array("input_ids.npy", lambda a: a.astype(np.int64)), "input_ids.npy is int64"),
        (_set_array("image_index.npy", lambda a: a + 1), "image_index"),
        (lambda m: m.update({"json": b'{"id": 1}'}), "meta:"),
        (lambda m: m.update({"evil.pyd": b"cos\nsystem\n(S'touch /tmp/pwned'\ntR."}), "refused, not decoded"),
        (lambda m: m.update({"model.pth": b"PK\x03\x04"}), "refused, not decoded"),
        (
            lambda m: m.update({"input_ids.npy": npy(np.array([object()], dtype=object))}),
            "input_ids.npy is not a plain numeric .npy",
        ),
        (lambda m: m.update({k: b"garbage" for k in m if k.startswith("img")}), "undecodable"),
    ],
)
def test_per_sample_faults(ds, mutate, expect):
    rewrite_first_image_sample(ds, mutate)
    assert verify_dataset(ds, deep=False) == []  # re-sealed: only the deep checks can see it
    got = [str(v) for v in verify_dataset(ds)]
    assert any(expect in g for g in got), got


@pytest.mark.parametrize(
    "name", ["qwen2-vl"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("qwen2.5-vl", "qwen3-vl", "qwen3.5")]
)  # make-test budget
def test_every_builtin_family_gets_the_per_sample_grid_checks(name, tmp_path):
    """The family registry tells verify which datasets have patch grids: a planted grid fault is caught for each
    builtin (Qwen3-VL / Qwen3.5 share Qwen2-VL's checks, with their own 16 px patch from the saved processor)."""
    from tests.conftest import LLAMAFACTORY

    records = json.loads((LLAMAFACTORY / "mllm_demo.json").read_text())
    rec = next(r for r in records if r.get("images"))
    rec["images"] = [str(LLAMAFACTORY / p) for p in rec["images"]]
    (tmp_path / "one.json").write_text(json.dumps([rec]))
    out = tmp_path / "ds"
    build(
        BuildConfig(
            inputs=(str(tmp_path / "one.json"),),
            out=str(out),
            processor=f"builtin:{name}",
            image_root=str(LLAMAFACTORY),
            progress=False,
        )
    )
    assert verify_dataset(out) == []
    rewrite_first_image_sample(out, _set_array("image_grid_thw.npy", lambda g: g * np.array([1, 2, 1], np.int32)))
    assert any("grid rows need" in str(v) for v in verify_dataset(out)), verify_dataset(out)


def test_a_sample_index_that_is_not_the_manifests_or_not_the_shards_is_a_violation(ds):
    side = ds / "shard-000000.tar.index.npy"
    good = side.read_bytes()
    side.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert [str(v) for v in verify_dataset(ds, deep=False)] == [
        "shard-000000.tar.index.npy: size or sha256 differs from the manifest"
    ]
    rows = np.load(io.BytesIO(good))
    rows["num_tokens"][0] += 1  # re-sealed in the manifest: only the deep check sees the row is wrong
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    side.write_bytes(buf.getvalue())
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][0]["index"].update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    (ds / "manifest.json").write_text(json.dumps(manifest))
    assert verify_dataset(ds, deep=False) == []
    got = [str(v) for v in verify_dataset(ds)]
    assert len(got) == 2 and got[0].startswith("shard-000000.tar.index.npy: row 0 ") and "does not describe" in got[0]
    assert got[1] == "samples.index.npy: rows 0..2 are not shard-000000.tar's sample index"  # it holds the build's rows


def test_the_dataset_index_is_every_sidecar_and_verify_checks_it(ds):
    """merge writes samples.index.npy (every shard's sidecar rows in manifest order, listed with its sha256); verify
    checks its size and sha256, and (deep) that its rows are the sidecars'."""
    from vlmprep.shards.manifest import ShardEntry
    from vlmprep.shards.reader import load_sample_index

    manifest = json.loads((ds / "manifest.json").read_text())
    listed = manifest["sample_index"]
    path = ds / listed["name"]
    assert listed["name"] == "samples.index.npy" and listed["bytes"] == path.stat().st_size
    assert listed["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    rows = np.load(path, allow_pickle=False)
    np.testing.assert_array_equal(
        rows, np.concatenate([load_sample_index(ds, ShardEntry.from_json(s)) for s in manifest["shards"]])
    )
    rows["start"][1] += 512  # re-sealed: only the deep check sees the rows are not the sidecars'
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    path.write_bytes(buf.getvalue())
    assert [str(v) for v in verify_dataset(ds, deep=False)] == [
        "samples.index.npy: size or sha256 differs from the manifest"
    ]
    listed.update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    (ds / "manifest.json").write_text(json.dumps(manifest))
    assert verify_dataset(ds, deep=False) == []
    got = [str(v) for v in verify_dataset(ds)]
    assert got == [
        f"samples.index.npy: rows 0..{manifest['shards'][0]['num_samples'] - 1} are not shard-000000.tar's sample index"
    ]


def test_the_commands_that_read_every_sample_say_so_in_their_help():
    """merge, stats and verify cost time in proportion to the data (docs/scale.md): their --help says so."""
    for command in ("merge", "stats", "verify"):
        res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        text = " ".join(res.output.split())
        assert res.exit_code == 0 and "Reads every sample" in text and "time grows with" in text, (command, text)


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_workers_check_shards_in_processes_and_report_the_same_in_manifest_order(ds, monkeypatch):
    """--workers N checks shards in N forked processes: the same violations, in manifest order, as one process, the
    progress counting every shard; a worker that dies is one line, not a hang or a traceback."""
    import os

    import vlmprep.tools.verify as verify

    rewrite_first_image_sample(ds, _set_array("loss_mask.npy", lambda m: np.ones_like(m)))  # shard 0, one sample
    last = sorted(ds.glob("shard-*.tar"))[-1]
    last.write_bytes(last.read_bytes() + b"\0" * 512)
    n = len(json.loads((ds / "manifest.json").read_text())["shards"])
    assert n >= 2 and last.name != "shard-000000.tar"
    runs = {}
    for workers in (1, 3):
        seen = []
        found = verify_dataset(ds, workers=workers, on_shard=lambda done, total, seen=seen: seen.append((done, total)))
        runs[workers] = [str(v) for v in found]
        assert seen == [(k, n) for k in range(1, n + 1)]
    assert runs[1] == runs[3]
    assert runs[1][0].startswith("shard-000000.tar:") and "loss_mask trains image placeholder tokens" in runs[1][0]
    assert f"{last.name}: size " in runs[1][-1]
    cli = [CliRunner().invoke(app, ["verify", str(ds), "--workers", w]) for w in ("1", "2")]
    assert cli[0].exit_code == cli[1].exit_code == 1 and cli[0].output == cli[1].output

    parent, real = os.getpid(), verify.sha256_file

    def dies(path):  # (a forked worker runs it too: nothing is pickled but shard numbers)
        if os.getpid() != parent and Path(path).name == "shard-000000.tar":
            os._exit(9)  # what the OOM killer does
        return real(path)

    monkeypatch.setattr(verify, "sha256_file", dies)
    res = CliRunner().invoke(app, ["verify", str(ds), "--workers", "2"])
    assert res.exit_code == 1 and res.output.strip().splitlines() == [
        "error: a verify worker process stopped abruptly (killed, out of memory, or crashed): run it again with "
        "--workers 1 to read the shards in this process"
    ]
    assert verify_dataset(ds, workers=1) != []  # in this process the patch never dies


def test_an_undecodable_sample_is_reported_and_its_correct_index_row_is_not(tmp_path):
    """A sample whose image member is garbage (the same size, resealed): verify names the sample; the sidecar's row,
    which still describes the sample's bytes, is not reported too (before: 'row N does not describe sample ...')."""
    from tests.support.hostile import copy_dataset, patch_members, reseal, small_dataset

    (tmp_path / "src").mkdir()
    src = small_dataset(tmp_path / "src")
    ds = copy_dataset(src, tmp_path / "ds", indexes=True)
    with tarfile.open(ds / "shard-000000.tar") as tf:
        image = next(
            m
            for m in tf.getmembers()
            if ".img" in m.name
            or m.name.endswith((".png", ".zst"))
            and ".npy" not in m.name
            and not m.name.endswith(".json")
        )
    patch_members(ds / "shard-000000.tar", {image.name: b"\x00" * image.size})
    reseal(ds)
    found = [str(v) for v in verify_dataset(ds)]
    assert found and all("index" not in v for v in found), found
    assert any(image.name.split(".")[0] in v for v in found), found


def test_a_source_image_whose_bytes_are_not_the_metas_sha256_is_refused_in_one_line(tmp_path):
    """The default --image-format auto stores the LLaMA-Factory demo's JPEG photos as their bytes (`orig.jpg`), each
    with its sha256 in the meta: a byte changed in one (the shard re-sealed, so only the member check can see it)
    is one line naming the member, and the sample's other checks do not decode it."""
    from tests.conftest import LLAMAFACTORY

    demo = (str(LLAMAFACTORY / "mllm_demo.json"),)
    build(BuildConfig(inputs=demo, out=str(tmp_path / "ds"), processor="tiny:qwen2-vl", progress=False))
    ds = tmp_path / "ds"
    assert verify_dataset(ds) == []
    [(key, members)] = read_samples(ds / "shard-000000.tar")[:1]
    assert "img000.orig.jpg" in members and "sha256" in json.loads(members["json"])["images"][0]

    def flip(m):
        data = bytearray(m["img000.orig.jpg"])
        data[len(data) // 2] ^= 0x01  # same length: the JPEG may even still decode
        m["img000.orig.jpg"] = bytes(data)

    rewrite_first_image_sample(ds, flip)
    assert verify_dataset(ds, deep=False) == []
    got = [str(v) for v in verify_dataset(ds)]
    assert len(got) == 1 and got[0].startswith(f"shard-000000.tar:{key}: img000.orig.jpg: its bytes' sha256 "), got
    assert "a corrupt or replaced source image" in got[0]
    res = CliRunner().invoke(app, ["verify", str(ds)])
    fails = [line for line in res.output.splitlines() if line.startswith("FAIL")]
    assert res.exit_code == 1 and fails == [f"FAIL {got[0]}"]
