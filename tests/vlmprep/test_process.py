"""Renderer (process.py): an image's grid comes from its header, and only the images some sample keeps (after the
history policy, the split and the cut) are decoded, resized and encoded, each once per record; the samples are those
of preparing every image first, byte for byte, and a record that fails is rejected for the same reason."""

import base64
import collections
import io
import json
from pathlib import Path

import pytest
import zstandard
from PIL import Image

import vlmprep.pixels.images as images_module
from vlmprep import process as process_module
from vlmprep.config import BuildConfig
from vlmprep.process import Renderer
from vlmprep.shards import writer as writer_module
from vlmprep.types import RawRecord, Source

ROOT = Path(__file__).resolve().parents[2]
TOOLS_TEMPLATE = str(ROOT / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")


@pytest.fixture(scope="module")
def processor():
    from vlmprep.processors.load import load_processor

    return load_processor("builtin:qwen2-vl")  # its own copy: Renderer sets the template on it


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from scripts.demo_traces import write_traces

    p = tmp_path_factory.mktemp("process") / "t.jsonl.zst"
    write_traces(
        p, n=4, seed=3, min_images=4, max_images=9, width=320, height=200, overlong_fraction=0.0, text_only_fraction=0.0
    )
    return [line for line in zstandard.ZstdDecompressor().stream_reader(open(p, "rb")).read().splitlines()]


def raws(lines):
    return [RawRecord(source=Source("/tmp/t.jsonl", i + 1), position=i, text=line) for i, line in enumerate(lines)]


class Counts:
    """How often each source image (by its bytes) is decoded and encoded."""

    def __init__(self, monkeypatch):
        self.decoded, self.encoded = collections.Counter(), collections.Counter()
        decode, encode = images_module.decode_image, writer_module.encode_image

        def counting_decode(img, **kw):
            self.decoded[img.data] += 1
            return decode(img, **kw)

        def counting_encode(image, *a, **kw):
            self.encoded[image.source.data] += 1
            return encode(image, *a, **kw)

        monkeypatch.setattr(images_module, "decode_image", counting_decode)
        monkeypatch.setattr(writer_module, "encode_image", counting_encode)


def renderer(processor, **cfg):
    return Renderer(
        BuildConfig(inputs=("t.jsonl",), out="", progress=False, chat_template=TOOLS_TEMPLATE, **cfg), processor
    )


def outputs(processor, lines, **cfg):
    r = renderer(processor, **cfg)
    return [
        [(kind, x.key, x.members) if kind == "ok" else (kind, x) for kind, x in r.process(raw)[0]]
        for raw in raws(lines)
    ]


def eager(monkeypatch):
    """Every image decoded and resized up front, as before images were opened by their header."""
    monkeypatch.setattr(
        process_module,
        "open_image",
        lambda img, processor, family, shapes=None, **kw: images_module.prepare_image(img, processor, family, **kw),
    )


@pytest.mark.parametrize(
    "cfg",
    [
        dict(keep_images=2, seq_len=32768),  # the history policy drops the earlier screenshots
        dict(seq_len=1200, long_traces="truncate"),  # the cut drops the later ones
        dict(seq_len=900, long_traces="split", keep_images=3),  # step samples share screenshots, each drops some
    ],
    ids=["keep-images", "cut", "split"],
)
def test_only_the_images_some_sample_keeps_are_decoded_and_each_once(cfg, processor, traces, monkeypatch):
    r = renderer(processor, **cfg)
    kept, pairs = collections.Counter(), collections.Counter()
    n_images = n_samples = 0
    for raw in raws(traces):
        samples = r.render(raw)
        n_samples += len(samples)
        # zstd-pdelta (the default) stores an image against the sample's previous one (the traces' screenshots
        # share a size): encoded once per record for each image it follows.
        pairs.update(data for data, _ in {(im.source.data, prev) for s in samples for prev, im in _after(s.images)})
        n_images += len(json.loads(raw.text)["messages"][1]["content"]) and sum(
            1
            for m in json.loads(raw.text)["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p.get("type") == "image_url"
        )
        kept.update({im.source.data: 1 for s in samples for im in s.images})
    assert sum(kept.values()) < n_images  # the setting does drop images
    if cfg.get("long_traces") == "split":
        assert n_samples > len(traces)  # and shares the kept ones between step samples

    counts = Counts(monkeypatch)
    got = outputs(processor, traces, **cfg)
    assert counts.decoded == kept, "decoded: exactly the images some sample keeps, once each"
    assert counts.encoded == pairs, "encoded once per record and previous image, however many samples hold it"

    eager(monkeypatch)
    assert got == outputs(processor, traces, **cfg)


def _after(images):
    """(the previous distinct image's source bytes or None, image) per distinct image of a sample, in order."""
    seen, prev = {}, None
    for im in images:
        if im.source.data not in seen:
            seen[im.source.data] = None
            yield prev, im
            prev = im.source.data


def png_uri(w=64, h=48, color=(10, 120, 200), cut=None):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    data = buf.getvalue()[:cut] if cut else buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def record(*images, text="look"):
    """One user turn per image, each answered."""
    msgs = []
    for k, url in enumerate(images):
        msgs += [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text if k == 0 else "next"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            },
            {"role": "assistant", "content": f"seen {k}"},
        ]
    return json.dumps({"id": "r", "messages": msgs}).encode()


def reasons(processor, lines, **cfg):
    r = renderer(processor, **cfg)
    return [
        [kind if kind == "ok" else (x["reason"], x["message"]) for kind, x in r.process(raw)[0]] for raw in raws(lines)
    ]


CORRUPT = png_uri(300, 200, cut=300)  # the header reads; the pixel data is cut off
WIDE = png_uri(2000, 8)  # bad_aspect_ratio from the header alone


def test_a_failing_record_is_rejected_for_the_reason_it_had_when_every_image_was_decoded_first(processor, monkeypatch):
    lines = [
        record(png_uri(), CORRUPT),  # the corrupt image is kept: corrupt_image
        record(CORRUPT, png_uri(), text="<|im_start|> text holds a control token"),  # a render fault too
        record(png_uri(), CORRUPT, WIDE),  # a header fault after a pixel fault
        record(png_uri(), WIDE, CORRUPT),  # a pixel fault after a header fault
        record(png_uri(), png_uri(color=(1, 2, 3))),  # fine
    ]
    for cfg in (dict(), dict(keep_images=1)):
        got = reasons(processor, lines, **cfg)
        eager(monkeypatch)
        assert got == reasons(processor, lines, **cfg), cfg
        monkeypatch.undo()
        assert [g[0][0] for g in got[:4]] == ["corrupt_image", "corrupt_image", "corrupt_image", "bad_aspect_ratio"]
        assert got[4] == ["ok"]


@pytest.mark.parametrize(
    "cfg", [dict(keep_images=2), dict(seq_len=60, long_traces="truncate")], ids=["keep-images", "cut"]
)
def test_a_corrupt_image_that_no_sample_keeps_is_never_decoded_and_the_record_lands(cfg, processor, monkeypatch):
    """The one change from decoding every image first: a fault in the pixel data of an image that the history policy
    or the cut drops (its header reads) no longer rejects a record that is fine otherwise."""
    first, last = png_uri(), png_uri(color=(1, 2, 3))
    line = record(*((CORRUPT, first, last) if "keep_images" in cfg else (first, last, CORRUPT)))
    counts = Counts(monkeypatch)
    assert reasons(processor, [line], **cfg) == [["ok"]]
    assert CORRUPT.split(",")[1] not in {base64.b64encode(d).decode() for d in counts.decoded}
    eager(monkeypatch)
    assert reasons(processor, [line], **cfg) == [
        [("corrupt_image", "cannot decode image (data-uri): image file is truncated")]
    ]
