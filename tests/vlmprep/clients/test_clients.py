"""Real clients read a built dataset with vlmprep's one documented line of glue (webdataset, HF datasets,
Megatron-Energon) and get, sample by sample, the arrays and every image occurrence the trainer's own decoder gets,
and every video's stored frames; a plain tarfile reader gets the images right through image_index.npy (and wrong by
sorted img* members)."""

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import zstandard

ARRAYS = ("input_ids", "loss_mask", "mm_token_type_ids", "position_ids", "image_grid_thw")
# The `energon` console script's own two lines, run with this interpreter (no PATH lookup; energon has no __main__).
ENERGON = [sys.executable, "-c", "import sys; from megatron.energon.cli.main import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """8 records, 0-3 small screenshots each, 3 shards; seed 17 repeats an image inside a sample ([0, 1, 0])."""
    from scripts.demo_traces import write_traces
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    tmp = tmp_path_factory.mktemp("clients")
    write_traces(
        tmp / "traces.jsonl.zst",
        n=8,
        seed=17,
        min_images=1,
        max_images=3,
        width=224,
        height=160,
        overlong_fraction=0.0,
        text_only_fraction=0.2,
    )
    build(
        BuildConfig(
            inputs=(str(tmp / "traces.jsonl.zst"),),
            out=str(tmp / "ds"),
            processor="builtin:qwen2-vl",
            seq_len=2048,
            samples_per_shard=3,
            progress=False,
            tool_calls="train-content",
        )
    )
    return tmp / "ds"


@pytest.fixture(scope="module")
def manifest(dataset) -> dict:
    return json.loads((dataset / "manifest.json").read_text())


@pytest.fixture(scope="module")
def expected(dataset, manifest) -> dict:
    """key -> the trainer's own decode (trainer/data/decode.py) of that sample, images expanded per occurrence."""
    from trainer.data.decode import OriginalResizer, decode_sample
    from trainer.data.processors import load_image_processor_config
    from trainer.data.tars import iter_tar_samples
    from trainer.data.vision import ImageSpec

    spec = ImageSpec.from_config(load_image_processor_config(str(dataset / "processor")))
    out = {}
    for shard in manifest["shards"]:
        url = str(dataset / shard["name"])
        for _, key, members in iter_tar_samples(url, lambda i: True):
            s = decode_sample(members, key=key, url=url, spec=spec, resize_original=OriginalResizer(spec))
            out[key] = dict(
                id=s.id,
                input_ids=s.input_ids,
                loss_mask=s.loss_mask,
                mm_token_type_ids=s.mm_token_type_ids,
                position_ids=s.position_ids,
                image_grid_thw=s.image_grid_thw,
                image_index=list(s.image_index),
                images=[s.images[u] for u in s.image_index],
            )
    assert len(out) == manifest["totals"]["samples"] == 8
    # The trap every client meets: a repeated image is stored once, so occurrences != members.
    assert any(len(set(s["image_index"])) < len(s["image_index"]) for s in out.values()), "no sample repeats an image"
    return out


def assert_same(got: dict, want: dict, key: str) -> None:
    """A client's sample equals the trainer's: every array (dtype included) and every image occurrence."""
    assert str(got["id"]) == want["id"], key
    for name in ARRAYS:
        g = got[name]
        assert isinstance(g, np.ndarray) and g.dtype == want[name].dtype, (key, name, type(g))
        np.testing.assert_array_equal(g, want[name], err_msg=f"{key} {name}")
    assert list(np.asarray(got["image_index"]).tolist()) == want["image_index"], key
    assert len(got["images"]) == len(want["images"]), key
    for k, (g, w) in enumerate(zip(got["images"], want["images"])):
        assert g.dtype == np.uint8 and g.shape == w.shape, (key, k, g.shape, w.shape)
        assert np.array_equal(g, w), f"{key}: image occurrence {k} differs from the trainer's"


def plain_decode(name: str, members: dict[str, bytes], prefix: dict[str, str], payloads: dict[str, bytes]):
    """A .npy.zst, .delta.zst or .pdelta.zst image member with zstandard and numpy alone, as docs/other-libraries.md
    shows (a .pdelta.zst member's prefix payload as a raw zstd dictionary, the filter undone with np.cumsum, not
    vlmprep's code); members decode in member order."""
    d = None
    if name in prefix:
        d = zstandard.ZstdCompressionDict(payloads[prefix[name]], dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    payloads[name] = zstandard.ZstdDecompressor(dict_data=d).decompress(members[name])
    arr = np.load(io.BytesIO(payloads[name]), allow_pickle=False)
    if not name.endswith(".npy.zst"):
        h, w, _ = arr.shape
        q = np.cumsum(arr.reshape(h, 3, w), axis=0, dtype=np.uint8)
        arr = np.stack([q[:, 0] + q[:, 1], q[:, 1], q[:, 2] + q[:, 1]], axis=-1)
    return arr


def test_plain_tarfile_reader_maps_occurrences_through_image_index(dataset, manifest, expected):
    wrong_by_sorted_members = with_prefix = 0
    for shard in manifest["shards"]:
        with tarfile.open(dataset / shard["name"]) as tar:
            samples: dict[str, dict[str, bytes]] = {}
            for ti in tar:
                key, _, member = ti.name.partition(".")
                samples.setdefault(key, {})[member] = tar.extractfile(ti).read()
        for key, m in samples.items():
            index = np.load(io.BytesIO(m["image_index.npy"]), allow_pickle=False)
            by_number = {int(name[3:6]): name for name in m if name.startswith("img")}
            prefix = {im["member"]: im["prefix"] for im in json.loads(m["json"])["images"] if "prefix" in im}
            payloads: dict[str, bytes] = {}
            with_prefix += len(prefix)
            stored = {u: plain_decode(name, m, prefix, payloads) for u, name in sorted(by_number.items())}
            images = [stored[int(u)] for u in index]  # the documented mapping
            got = {n: np.load(io.BytesIO(m[n + ".npy"]), allow_pickle=False) for n in ARRAYS}
            assert_same(
                {**got, "id": json.loads(m["json"])["id"], "image_index": index, "images": images}, expected[key], key
            )
            naive = [stored[u] for u in sorted(by_number)]  # the obvious glue, one member per occurrence
            if len(naive) != len(images) or any(not np.array_equal(a, b) for a, b in zip(naive, images)):
                wrong_by_sorted_members += 1
    assert wrong_by_sorted_members >= 1
    assert with_prefix >= 1  # the default zstd-pdelta: a sample's later screenshots need the one before


def test_webdataset_reads_every_sample(dataset, expected):
    import webdataset as wds

    import vlmprep.clients.wds

    ds = wds.WebDataset(vlmprep.clients.wds.shard_urls(dataset), shardshuffle=False).map(vlmprep.clients.wds.decode)
    seen = []
    for s in ds:
        assert_same(s, expected[s["__key__"]], s["__key__"])
        assert s["meta"]["id"] == s["id"] and s["__url__"].endswith(".tar")
        seen.append(s["__key__"])
    assert seen == sorted(expected)


def test_client_decoders_refuse_unknown_members(dataset, manifest):
    """A planted pickle member is refused before anything is decoded, by the webdataset and energon glue alike."""
    from vlmprep.shards.reader import ShardFormatError

    with tarfile.open(dataset / manifest["shards"][0]["name"]) as tar:
        first = tar.next().name.partition(".")[0]
        raw = {ti.name.partition(".")[2]: tar.extractfile(ti).read() for ti in tar if ti.name.startswith(first)}
    bad = {**raw, "evil.pyd": b"\x80\x04N."}
    import vlmprep.clients.wds

    with pytest.raises(ShardFormatError, match="evil.pyd"):
        vlmprep.clients.wds.decode({"__key__": first, "__url__": "x.tar", **bad})
    pytest.importorskip("megatron.energon")
    from vlmprep.clients.energon import sample_loader

    with pytest.raises(ShardFormatError, match="evil.pyd"):
        sample_loader({"__key__": first, "__shard__": "x.tar", **bad})


def test_hf_iterable_dataset_reads_every_sample(dataset, expected, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import torch
    from datasets.distributed import split_dataset_by_node

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))  # its lock file, not ~/.cache

    import vlmprep.clients.hf

    ds = vlmprep.clients.hf.iterable_dataset(dataset)
    assert isinstance(ds, datasets.IterableDataset) and ds.n_shards == 3
    keys = []
    for s in ds:
        assert_same(s, expected[s["__key__"]], s["__key__"])
        keys.append(s["__key__"])
    assert keys == sorted(expected)
    mapped = ds.map(lambda s: {"num_trained": int(s["loss_mask"].sum())})  # user code sees numpy arrays
    assert [s["num_trained"] for s in mapped] == [int(expected[k]["loss_mask"].sum()) for k in keys]
    shuffled = [s["__key__"] for s in ds.shuffle(seed=0, buffer_size=4)]
    assert sorted(shuffled) == keys and shuffled != keys
    for world in (2, 3):  # 3 shards: by shard for world 3, every world-th sample for world 2
        parts = [[s["__key__"] for s in split_dataset_by_node(ds, rank=r, world_size=world)] for r in range(world)]
        assert sorted(sum(parts, [])) == keys and all(parts)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)  # workers split by shard
    assert sorted(s["__key__"] for s in loader) == keys


@pytest.mark.slow  # ~25 s: energon prepare/info/lint processes (the webdataset and HF readers stay in make test)
def test_energon_reads_every_sample_and_info_lint_pass(dataset, manifest, expected, tmp_path):
    pytest.importorskip("megatron.energon")
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
    from megatron.energon.errors import reraise_exception

    from vlmprep.clients import energon_meta
    from vlmprep.clients.energon import VlmprepSample, prepare

    d = tmp_path / "ds"
    shutil.copytree(dataset, d)
    assert sorted(p.name for p in (d / ".nv-meta").iterdir()) == ["dataset.yaml"]  # the build wrote only this
    assert (d / ".nv-meta" / "dataset.yaml").read_text() == energon_meta.DATASET_YAML
    cmd = energon_meta.PREPARE_COMMAND.split()
    run = lambda args: subprocess.run(ENERGON + args, capture_output=True, text=True, timeout=300)  # noqa: E731
    p = run([a if a != "DIR" else str(d) for a in cmd[1:]])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    info = json.loads((d / ".nv-meta" / ".info.json").read_text())
    assert info["shard_counts"] == {s["name"]: s["num_samples"] for s in manifest["shards"]}

    p = run(["info", str(d)])
    assert p.returncode == 0 and "8 samples" in p.stdout and "vlmprep.clients.energon.VlmprepSample" in p.stdout, (
        p.stdout[-2000:] + p.stderr[-3000:]
    )
    p = run(["lint", str(d)])
    # energon 7.4.1's lint logs a failing sample and still exits 0 (its handler argument is ignored): check both.
    assert p.returncode == 0 and "Traceback" not in p.stderr + p.stdout, p.stdout[-2000:] + p.stderr[-3000:]

    for workers in (0, 2):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers, global_error_handler=reraise_exception)
        ds = get_train_dataset(
            d, worker_config=wc, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False
        )
        keys = []
        for s in get_savable_loader(ds):
            assert isinstance(s, VlmprepSample)
            fields = ("id", "image_index", "images", *ARRAYS)
            assert_same({f: getattr(s, f) for f in fields}, expected[s.__key__], s.__key__)
            keys.append(s.__key__)
        # a loader that energon cannot restore (e.g. a cooker without @stateless) ends early with no exception
        assert sorted(keys) == sorted(expected), (workers, keys)

    again = tmp_path / "py"  # the Python form of the same command indexes the same way
    shutil.copytree(dataset, again)
    assert prepare(again) == manifest["totals"]["samples"]
    for name in ("split.yaml", ".info.json"):
        assert (again / ".nv-meta" / name).read_text() == (d / ".nv-meta" / name).read_text()


def test_rebuild_drops_a_stale_energon_index(tmp_path):
    from vlmprep.clients.energon_meta import DATASET_YAML, write_energon_meta

    (tmp_path / ".nv-meta").mkdir()
    for name in (".nv-meta/.info.json", ".nv-meta/split.yaml", ".nv-meta/index.sqlite", "shard-000000.tar.idx"):
        (tmp_path / name).write_text("old")
    write_energon_meta(tmp_path)
    assert sorted(p.name for p in (tmp_path / ".nv-meta").iterdir()) == ["dataset.yaml"]
    assert not list(tmp_path.glob("*.idx")) and (tmp_path / ".nv-meta/dataset.yaml").read_text() == DATASET_YAML


def test_vlmprep_imports_no_client_library():
    """The build writes energon's dataset.yaml without energon; `import vlmprep` needs none of the client extras,
    and nothing in vlmprep imports the trainer (the shard format is their only contract)."""
    code = (
        "import sys, vlmprep.cli, vlmprep.builder.pipeline, vlmprep.clients.energon_meta, vlmprep.clients.wds, "
        "vlmprep.clients.hf, vlmprep.clients.collate; "
        "print(sorted(m for m in ('datasets', 'megatron', 'webdataset', 'trainer') if m in sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]


def _stored_videos(d: Path) -> dict[str, dict]:
    """key -> the videos a build stored, read with plain tarfile, zstandard, numpy and PIL (not vlmprep's reader):
    per video (vidVVV in the meta's token order) its frames stacked, and the stored video arrays."""
    from PIL import Image

    def frame(name: str, data: bytes) -> np.ndarray:
        if name.endswith(".npy.zst"):
            return np.load(io.BytesIO(zstandard.ZstdDecompressor().decompress(data)), allow_pickle=False)
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

    out = {}
    for shard in sorted(d.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            samples: dict[str, dict[str, bytes]] = {}
            for ti in tar:
                key, _, member = ti.name.partition(".")
                samples.setdefault(key, {})[member] = tar.extractfile(ti).read()
        for key, m in samples.items():
            meta = json.loads(m["json"])
            videos = [
                np.stack(
                    [frame(n, m[n]) for f in range(v["frames"]) for n in m if n.startswith(f"{v['member']}.{f:04d}.")]
                )
                for v in meta.get("videos", [])
            ]
            out[key] = dict(
                videos=videos,
                meta=meta,
                **{
                    a: np.load(io.BytesIO(m[a + ".npy"]), allow_pickle=False)
                    for a in ("video_grid_thw", "second_per_grid_ts")
                },
            )
    return out


def _assert_same_videos(got, want: dict, key: str) -> None:
    g = (
        dict(got)
        if isinstance(got, dict)
        else {f: getattr(got, f) for f in ("videos", "video_grid_thw", "second_per_grid_ts")}
    )
    for name in ("video_grid_thw", "second_per_grid_ts"):
        assert g[name].dtype == want[name].dtype and np.array_equal(g[name], want[name]), (key, name)
    assert len(g["videos"]) == len(want["videos"]) == len(want["video_grid_thw"]), key
    for v, (a, b) in enumerate(zip(g["videos"], want["videos"])):
        entry = want["meta"]["videos"][v]
        assert isinstance(a, np.ndarray) and a.dtype == np.uint8, (key, v, type(a))
        assert a.shape == b.shape == (entry["frames"], entry["height"], entry["width"], 3), (key, v, a.shape)
        assert np.array_equal(a, b), f"{key}: video {v} differs from the frames the build stored"


@pytest.mark.parametrize("fmt", ["zstd", "png"])
def test_adapters_give_the_stored_video_frames(video_dataset, fmt, tmp_path, monkeypatch):
    """webdataset's decode, the HF datasets reader and energon's sample loader give each sample's videos in token
    order, one uint8 frames x H x W x 3 array each, bit-equal to the frames the build stored (decoded here
    independently), with video_grid_thw and second_per_grid_ts as stored; a sample without videos has none."""
    import webdataset as wds

    import vlmprep.clients.wds

    d = video_dataset("qwen2.5-vl", fmt)
    want = _stored_videos(d)
    by_id = {w["meta"]["id"]: w for w in want.values()}
    assert [len(by_id[i]["videos"]) for i in ("v", "i", "t", "vi")] == [1, 0, 0, 2]
    assert by_id["vi"]["videos"][0].shape != by_id["vi"]["videos"][1].shape  # two sizes: token order shows
    got = {
        s["__key__"]: s
        for s in wds.WebDataset(vlmprep.clients.wds.shard_urls(d), shardshuffle=False).map(vlmprep.clients.wds.decode)
    }
    assert sorted(got) == sorted(want)
    for key, s in got.items():
        _assert_same_videos(s, want[key], key)
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    import vlmprep.clients.hf

    keys = []
    for s in vlmprep.clients.hf.iterable_dataset(d):
        _assert_same_videos(s, want[s["__key__"]], s["__key__"])
        keys.append(s["__key__"])
    assert keys == sorted(want)
    pytest.importorskip("megatron.energon")
    from vlmprep.clients.energon import VlmprepSample, sample_loader

    for shard in sorted(d.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            raw: dict[str, dict] = {}
            for ti in tar:
                key, _, member = ti.name.partition(".")
                raw.setdefault(key, {"__key__": key, "__shard__": shard.name})[member] = tar.extractfile(ti).read()
        for key, r in raw.items():
            s = VlmprepSample(__key__=key, __restore_key__=(), __subflavors__={}, **sample_loader(r))
            _assert_same_videos(s, want[key], key)


def test_reader_refuses_a_video_whose_frames_disagree_with_the_meta(video_dataset):
    """A frame member missing (inside a video or its last), or one stored twice, is one named ShardFormatError from
    the client decoders, never a short video."""
    import vlmprep.clients.wds
    from vlmprep.shards.reader import ShardFormatError

    d = video_dataset("qwen2.5-vl", "zstd")
    with tarfile.open(sorted(d.glob("shard-*.tar"))[-1]) as tar:
        raw: dict[str, dict] = {}
        for ti in tar:
            key, _, member = ti.name.partition(".")
            raw.setdefault(key, {"__key__": key, "__url__": "u.tar"})[member] = tar.extractfile(ti).read()
    s = next(r for r in raw.values() if b'"vi"' in r["json"])
    last = max(n for n in s if n.startswith("vid001."))
    cases = {"vid001.0001.npy.zst": None, last: None, "vid001.0002.png": s["vid001.0002.npy.zst"]}
    for name, data in cases.items():
        bad = {k: v for k, v in s.items() if k != name} if data is None else {**s, name: data}
        with pytest.raises(ShardFormatError, match="video 1: frame members .* one member each"):
            vlmprep.clients.wds.decode(bad)
    assert len(vlmprep.clients.wds.decode(s)["videos"]) == 2


@pytest.mark.slow  # energon's index and loader set-up (~10 s); its sample_loader on videos stays in make test above
def test_energon_loader_gives_the_stored_video_frames(video_dataset, tmp_path):
    """Through energon's own loader (prepare, get_train_dataset, savable loader) the VlmprepSamples hold the
    stored videos bit for bit, as the webdataset and HF readers do."""
    pytest.importorskip("megatron.energon")
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
    from megatron.energon.errors import reraise_exception

    from vlmprep.clients.energon import VlmprepSample, prepare

    d = tmp_path / "ds"
    shutil.copytree(video_dataset("qwen2.5-vl", "zstd"), d)
    want = _stored_videos(d)
    assert prepare(d) == len(want) == 4
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    ds = get_train_dataset(
        d, worker_config=wc, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False
    )
    keys = []
    for s in get_savable_loader(ds):
        assert isinstance(s, VlmprepSample)
        _assert_same_videos(s, want[s.__key__], s.__key__)
        keys.append(s.__key__)
    assert sorted(keys) == sorted(want) and sum(len(want[k]["videos"]) for k in keys) == 3


def test_a_pdelta_member_decodes_alone_and_in_any_order(dataset):
    """vlmprep's reader decodes a .pdelta.zst member on its own (inspect's lazy views, verify's per-member check):
    the prefixes it needs are decoded first, so last-to-first gives the pixels first-to-last gives."""
    from vlmprep.shards.reader import iter_dataset

    checked = 0
    for s in iter_dataset(dataset):
        if not s.prefixes():
            continue
        sizes, names = s.stored_sizes(), list(dict.fromkeys(s.image_members()))
        forward = {n: s.decode(n, sizes[n]) for n in names}
        fresh = next(t for t in iter_dataset(dataset) if t.key == s.key)
        for n in reversed(names):
            np.testing.assert_array_equal(fresh.decode(n, sizes[n]), forward[n])
        checked += 1
    assert checked >= 1
