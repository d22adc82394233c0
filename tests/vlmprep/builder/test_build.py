import base64
import hashlib
import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import zstandard
from PIL import Image

from tests.conftest import LLAMAFACTORY
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.shards.decode import decode_stored_image

# The demo traces act through tool_calls, which the stock Qwen2-VL template does not render (rejected by default).
TOOLS_TEMPLATE = str(Path(__file__).parents[3] / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")


def schema(name):
    from vlmprep.tools.verify import schema_validator

    return schema_validator(name)


def cfg(inputs, out, **kw):
    kw.setdefault("progress", False)
    return BuildConfig(inputs=tuple(str(i) for i in inputs), out=str(out), **kw)


@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory):
    from scripts.demo_traces import write_traces

    p = tmp_path_factory.mktemp("demo") / "traces.jsonl.zst"
    write_traces(
        p,
        n=12,
        seed=1,
        min_images=1,
        max_images=5,
        width=480,
        height=270,
        overlong_fraction=0.1,
        text_only_fraction=0.1,
    )
    return p


# Truncated samples on purpose (the generator's over-long traces), their lost turns accepted.
DEMO = dict(
    seq_len=4096, samples_per_shard=5, chat_template=TOOLS_TEMPLATE, long_traces="truncate", min_turn_coverage=0.0
)


@pytest.fixture(scope="module")
def demo_build(demo_traces, tmp_path_factory, qwen2vl_processor):
    out = tmp_path_factory.mktemp("b") / "shards"
    res = build(cfg([demo_traces], out, **DEMO))
    return out, res


def read_tar(path):
    """Plain tarfile reader: group members by key (up to the first dot)."""
    samples = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            key, ext = m.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return samples


def npy(b):
    return np.load(io.BytesIO(b), allow_pickle=False)


def file_hashes(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).iterdir()) if p.is_file()}


def test_manifest_and_meta_match_schemas_and_shards(demo_build):
    out, res = demo_build
    manifest = json.loads((out / "manifest.json").read_text())
    schema("manifest.schema.json").validate(manifest)
    assert manifest == res.manifest.to_json()
    meta_schema = schema("sample_meta.schema.json")
    total_samples = total_tokens = 0
    for sh in manifest["shards"]:
        data = (out / sh["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sh["sha256"] and len(data) == sh["bytes"]
        samples = read_tar(out / sh["name"])
        assert len(samples) == sh["num_samples"] <= 5
        for key, s in samples.items():
            assert "." not in key
            meta = json.loads(s["json"])
            meta_schema.validate(meta)
            ids, mask = npy(s["input_ids.npy"]), npy(s["loss_mask.npy"])
            assert ids.dtype == np.int32 and mask.dtype == np.uint8
            assert npy(s["position_ids.npy"]).shape == (3, len(ids))
            assert npy(s["image_grid_thw.npy"]).shape == (meta["num_images"], 3)
            assert meta["num_tokens"] == len(ids) <= 4096 and meta["num_trainable_tokens"] == mask.sum()
            total_samples += 1
            total_tokens += len(ids)
    assert manifest["totals"]["samples"] == total_samples and manifest["totals"]["tokens"] == total_tokens
    assert manifest["totals"]["truncated_samples"] >= 1  # the generator's over-long traces
    assert (out / "processor" / "tokenizer.json").exists()
    assert not list(out.glob("*.tmp"))


def test_webdataset_and_tarfile_read_the_same_arrays(demo_build):
    import webdataset as wds

    out, _ = demo_build
    urls = sorted(str(p) for p in out.glob("shard-*.tar"))
    by_tar = {}
    for u in urls:
        by_tar.update(read_tar(u))
    # No decoders: raw bytes only (webdataset's defaults would unpickle .pyd members).
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    seen = 0
    for s in ds:
        ref = by_tar[s["__key__"]]
        for ext in (
            "input_ids.npy",
            "loss_mask.npy",
            "mm_token_type_ids.npy",
            "position_ids.npy",
            "image_grid_thw.npy",
        ):
            np.testing.assert_array_equal(npy(s[ext]), npy(ref[ext]))
        assert json.loads(s["json"]) == json.loads(ref["json"])
        seen += 1
    assert seen == len(by_tar)


def test_build_twice_and_with_two_workers_is_byte_identical(demo_traces, demo_build, tmp_path):
    out1, _ = demo_build
    out2 = tmp_path / "again"
    build(cfg([demo_traces], out2, workers=2, **DEMO))
    h1, h2 = file_hashes(out1), file_hashes(out2)
    assert h1 == h2 and any(k.startswith("shard-") for k in h1)
    assert file_hashes(out1 / "processor") == file_hashes(out2 / "processor")


@pytest.mark.parametrize("fmt", ["zstd-pdelta", "zstd-delta", "zstd", "png", "webp", "original"])
def test_pixel_parity_per_image_format(fmt, tmp_path, qwen2vl_processor):
    out = tmp_path / fmt
    build(cfg([LLAMAFACTORY / "mllm_demo.json"], out, image_format=fmt))
    ip = qwen2vl_processor.image_processor
    srcs = json.loads((LLAMAFACTORY / "mllm_demo.json").read_text())
    checked = 0
    for sh in sorted(out.glob("shard-*.tar")):
        for s in read_tar(sh).values():
            meta = json.loads(s["json"])
            rec = srcs[meta["source"]["line"] - 1]
            grids = npy(s["image_grid_thw.npy"])
            for k, im in enumerate(meta["images"]):
                stored = decode_stored_image(im["member"], s[im["member"]])
                original = Image.open(LLAMAFACTORY / rec["images"][k])
                ref = ip(images=[original], return_tensors="np")
                if fmt == "original":  # source bytes: the loader resizes with the same processor
                    got = ip(images=[stored], return_tensors="np")
                else:
                    assert stored.shape == (im["height"], im["width"], 3)
                    got = ip(images=[stored], do_resize=False, return_tensors="np")
                np.testing.assert_array_equal(got["image_grid_thw"], ref["image_grid_thw"])
                np.testing.assert_array_equal(got["image_grid_thw"][0], grids[k])
                assert np.abs(got["pixel_values"] - ref["pixel_values"]).max() == 0
                checked += 1
    assert checked == 8  # every image reference of the 6 LLaMA-Factory records


def test_llamafactory_demo_builds_with_deduped_images(tmp_path):
    out = tmp_path / "lf"
    res = build(cfg([LLAMAFACTORY / "mllm_demo.json"], out))
    assert res.manifest.totals["samples"] == 6 and res.manifest.totals["rejected"] == 0
    assert res.manifest.totals["images"] == 8
    first = read_tar(out / "shard-000000.tar")[min(read_tar(out / "shard-000000.tar"))]
    meta = json.loads(first["json"])
    # 1.jpg twice, stored once: as its bytes (a JPEG photo under the default --image-format auto)
    assert [i["member"] for i in meta["images"]] == ["img000.orig.jpg", "img000.orig.jpg"]
    assert sum(1 for k in first if k.startswith("img")) == 1


def test_mixed_good_and_bad_records(tmp_path):
    good_png = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 20, 30)).save(good_png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(good_png.getvalue()).decode()

    def good(i):
        return {
            "id": f"good{i}",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": f"q{i}"}, {"type": "image_url", "image_url": {"url": uri}}],
                },
                {"role": "assistant", "content": f"a{i}"},
            ],
        }

    lines = [
        json.dumps(good(0)),
        "{oops not json",
        json.dumps(good(1)),
        json.dumps(
            {
                "id": "b64",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}],
                    },
                    {"role": "assistant", "content": "x"},
                ],
            }
        ),
        json.dumps(
            {
                "id": "missing",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "nope/missing.png"}}]},
                    {"role": "assistant", "content": "x"},
                ],
            }
        ),
        json.dumps(good(2)),
        json.dumps(
            {
                "id": "weird",
                "messages": [
                    {"role": "user", "content": [{"type": "sticker", "sticker": "x"}]},
                    {"role": "assistant", "content": "x"},
                ],
            }
        ),
        json.dumps(good(3)),
    ]
    inp = tmp_path / "mixed.jsonl.zst"
    inp.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    out = tmp_path / "out"
    res = build(cfg([inp], out, max_reject_fraction=1.0, min_turn_coverage=0.0))
    assert res.manifest.totals["samples"] == 4
    assert res.manifest.rejects == {
        "invalid_json": 1,
        "invalid_base64": 1,
        "image_not_found": 1,
        "unknown_content_type": 1,
    }
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["source"]["line"], r["reason"], r["id"]) for r in rejects] == [
        (2, "invalid_json", None),
        (4, "invalid_base64", "b64"),
        (5, "image_not_found", "missing"),
        (7, "unknown_content_type", "weird"),
    ]
    assert all(r["message"] and "\n" not in r["message"] for r in rejects)
    ids = [json.loads(s["json"])["id"] for sh in sorted(out.glob("shard-*.tar")) for s in read_tar(sh).values()]
    assert sorted(ids) == ["good0", "good1", "good2", "good3"]


def test_strict_stops_at_first_reject(tmp_path):
    from vlmprep.builder.pipeline import BuildError

    inp = tmp_path / "x.jsonl"
    inp.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n{bad\n')
    with pytest.raises(BuildError, match="invalid_json"):
        build(cfg([inp], tmp_path / "o", strict=True))


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_rebuild_removes_stale_shards(tmp_path, demo_traces):
    out = tmp_path / "o"
    build(cfg([demo_traces], out, samples_per_shard=2, chat_template=TOOLS_TEMPLATE))
    n_many = len(list(out.glob("shard-*.tar")))
    build(cfg([demo_traces], out, samples_per_shard=100, chat_template=TOOLS_TEMPLATE, overwrite=True))
    assert n_many > 1 and len(list(out.glob("shard-*.tar"))) == 1
    shutil.rmtree(out)


@pytest.fixture
def loaded_once(monkeypatch, qwen2vl_processor):
    """Builds below reuse the session's builtin:qwen2-vl instead of loading it again (~15 s a load on 2 cores)."""
    monkeypatch.setattr("vlmprep.builder.pipeline.load_processor", lambda spec: qwen2vl_processor)


def test_rejects_are_byte_identical_across_builds(tmp_path, loaded_once):
    # Library errors carry object reprs (PIL: "cannot identify image file <_io.BytesIO object at 0x7f...>");
    # none may reach rejects.jsonl, so two builds of the same bad records write the same bytes.
    from tests.vlmprep.test_bad_input import corpus, encode_line

    # The corpus classes whose messages quote a library error (JSON, UTF-8, PIL, file system).
    quoting = {
        "invalid_json_line",
        "non_utf8_bytes",
        "base64_of_non_image",
        "truncated_png",
        "truncated_jpeg",
        "svg_image",
        "int32_gray_out_of_16bit_range",
        "missing_file",
        "directory_as_image",
        "path_traversal",
        "decompression_bomb",
        "aspect_ratio_400",
        "animated_gif",
        "tool_args_invalid_json",
    }
    lines = [encode_line(rec) for name, rec, want in corpus(tmp_path) if name in quoting]
    assert len(lines) == len(quoting)
    svg = b"<svg xmlns='http://www.w3.org/2000/svg' width='8' height='8'/>"
    lines.append(
        encode_line(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": "data:image/svg+xml;base64," + base64.b64encode(svg).decode(),
                            }
                        ],
                    },
                    {"role": "assistant", "content": "a"},
                ]
            }
        )
    )
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(b"".join(lines))
    a, b = tmp_path / "a", tmp_path / "b"
    build(cfg([inp], a, seq_len=256, max_images_per_record=8, allow_empty=True))
    build(cfg([inp], b, seq_len=256, max_images_per_record=8, allow_empty=True))
    ra, rb = (a / "rejects.jsonl").read_bytes(), (b / "rejects.jsonl").read_bytes()
    assert ra == rb and len(ra.splitlines()) == len(lines)
    assert not re.search(rb" at 0x[0-9a-f]+", ra) and str(tmp_path / "a").encode() not in ra
    assert b"cannot decode image (data-uri): not an image format PIL can identify" in ra


def test_json_file_shapes(tmp_path, loaded_once):
    rec = {"id": "one", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "one.json").write_text(json.dumps(rec))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [rec]}))
    (tmp_path / "empty.json").write_text("[]")
    res = build(
        cfg(
            [tmp_path / "one.json", tmp_path / "wrapped.json", tmp_path / "empty.json"],
            tmp_path / "o",
            max_reject_fraction=1.0,
            min_turn_coverage=0.0,
        )
    )
    assert res.manifest.totals["samples"] == 1
    rejects = {Path(r["source"]["file"]).name: r for r in map(json.loads, (tmp_path / "o" / "rejects.jsonl").open())}
    assert rejects["wrapped.json"]["reason"] == "invalid_json_file"
    assert "must be an array of records or one record" in rejects["wrapped.json"]["message"]
    assert "an object with keys data" in rejects["wrapped.json"]["message"]
    assert rejects["empty.json"]["reason"] == "empty_file"


def test_zero_samples_exits_non_zero_unless_allow_empty(tmp_path, loaded_once):
    from typer.testing import CliRunner

    from vlmprep.cli import app

    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"id": "x"}\n{oops\n{"id": "y"}\n')
    args = ["build", "--in", str(inp), "--out", str(tmp_path / "o"), "--no-progress"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1
    start, err = res.stderr.strip().splitlines()  # the start-up line, then the one-line error
    assert (
        start.startswith("vlmprep build: reading 1 input file")
        and "0 samples written from 3 records (missing_messages 2, invalid_json 1)" in err
    )
    assert "--allow-empty" in err and (tmp_path / "o" / "manifest.json").is_file()
    res = CliRunner().invoke(app, args + ["--allow-empty"])
    assert res.exit_code == 0 and "0 samples" in res.stdout


def test_a_kept_photo_between_screenshots_ends_the_pdelta_chain_there(tmp_path, qwen2vl_processor):
    """Three screenshots around a JPEG photo, all of one size, in one sample, stored the default way: the photo keeps its
    bytes (img001.orig.jpg), the screenshot after it is compressed alone (its previous member is no .pdelta.zst:
    no prefix) and the next one against it; the chain passes every reader's prefix check and every image decodes,
    in the trainer, to the pixels a zstd-pdelta build of the same record holds."""
    from tests.trainer.conftest import read_all_samples
    from tests.vlmprep.test_images import photo, save
    from trainer.data.datasets import load_image_spec
    from trainer.options import DataOptions
    from vlmprep.shards.reader import iter_dataset
    from vlmprep.tools.verify import verify_dataset
    from vlmprep_schemas.delta import pdelta_prefixes

    screen = np.zeros((200, 320, 3), np.uint8)
    screen[:, :160] = (230, 230, 240)
    shots = []
    for k in range(3):
        shot = screen.copy()
        shot[40 + 20 * k : 60 + 20 * k, 100:140] = (10, 10, 200)  # a cursor that moves
        shots.append(save(Image.fromarray(shot)))
    sources = [(shots[0], "png"), (save(photo(320, 200), "JPEG", quality=90), "jpeg"), (shots[1], "png")]
    sources.append((shots[2], "png"))
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64," + base64.b64encode(data).decode()}}
        for data, kind in sources
    ]
    record = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Four views."}]}
    (tmp_path / "r.jsonl").write_text(json.dumps(record) + "\n")
    build(cfg([tmp_path / "r.jsonl"], tmp_path / "auto"))
    build(cfg([tmp_path / "r.jsonl"], tmp_path / "pdelta", image_format="zstd-pdelta"))
    [s] = iter_dataset(tmp_path / "auto")
    images = s.meta()["images"]
    assert [im["member"] for im in images] == [
        "img000.pdelta.zst",
        "img001.orig.jpg",
        "img002.pdelta.zst",
        "img003.pdelta.zst",
    ]
    assert pdelta_prefixes(images, s.names) == {"img003.pdelta.zst": "img002.pdelta.zst"}
    assert verify_dataset(tmp_path / "auto") == []
    spec = load_image_spec(DataOptions.of(_train_config(tmp_path / "auto")), str(tmp_path / "auto" / "processor"))
    [got], [want] = read_all_samples(tmp_path / "auto", spec), read_all_samples(tmp_path / "pdelta", spec)
    assert len(got.images) == len(want.images) == 4
    for a, b in zip(got.images, want.images):
        np.testing.assert_array_equal(a, b)


def _train_config(ds):
    from trainer.config import TrainConfig

    return TrainConfig(data=str(ds), tiny_random="qwen2-vl")
