"""Tests for the synthetic browser-agent trace generator (scripts/demo_traces.py)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import zstandard
from PIL import Image

from scripts.demo_traces import TOOLS, generate_traces, write_traces

# Small screenshots keep the suite fast; layout and logic are the same as at 1280x720.
SMALL = dict(width=320, height=200)


def _read(path: Path) -> list[dict]:
    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
        text = io.TextIOWrapper(r, encoding="utf-8")
        return [json.loads(line) for line in text]


def _image_urls(rec: dict) -> list[tuple[str, bool]]:
    """(data URI, bare-string form?) for every image part of a record, in order."""
    out = []
    for m in rec["messages"]:
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p["type"] == "image_url":
                    ref = p["image_url"]
                    out.append((ref, True) if isinstance(ref, str) else (ref["url"], False))
    return out


def _png(uri: str) -> bytes:
    assert uri.startswith("data:image/png;base64,")
    return base64.b64decode(uri.split(",", 1)[1], validate=True)


def _text_len(rec: dict) -> int:
    n = 0
    for m in rec["messages"]:
        c = m["content"]
        n += len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c)
    return n


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return list(
        generate_traces(
            n=60, seed=3, min_images=2, max_images=12, text_only_fraction=0.1, overlong_fraction=0.1, **SMALL
        )
    )


def test_write_is_deterministic_and_streams(tmp_path):
    kw = dict(n=6, min_images=2, max_images=5, **SMALL)
    a, b, c = tmp_path / "a.jsonl.zst", tmp_path / "b.jsonl.zst", tmp_path / "c.jsonl.zst"
    sa = write_traces(a, seed=0, **kw)
    sb = write_traces(b, seed=0, **kw)
    write_traces(c, seed=1, **kw)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert sa == sb and sa["records"] == 6 and sa["bytes"] == a.stat().st_size
    recs = _read(a)
    assert len(recs) == 6
    assert sa["images"] == sum(len(_image_urls(r)) for r in recs)
    assert [r["id"] for r in recs] == [f"trace-{i:06d}" for i in range(1, 7)]
    assert not list(tmp_path.glob(".*tmp*"))  # temp file was renamed away


def test_record_i_does_not_depend_on_n():
    kw = dict(seed=5, min_images=2, max_images=4, **SMALL)
    assert list(generate_traces(n=3, **kw)) == list(generate_traces(n=5, **kw))[:3]


def test_structure(records):
    tool_names = {t["function"]["name"] for t in TOOLS}
    assert tool_names == {"click", "type", "scroll", "navigate", "done"}
    for rec in records:
        assert set(rec) == {"id", "messages", "tools"}
        msgs = rec["messages"]
        assert msgs[-1]["role"] == "assistant" and isinstance(msgs[-1]["content"], str) and msgs[-1]["content"]
        assert "tool_calls" not in msgs[-1]
        if not _image_urls(rec):
            roles = [m["role"] for m in msgs if m["role"] != "system"]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) <= 4
            continue
        assert msgs[0]["role"] == "system" and isinstance(msgs[0]["content"], str)
        assert msgs[1]["role"] == "user"
        assert [p["type"] for p in msgs[1]["content"]] == ["text", "image_url"]
        pending: set[str] = set()
        seen: set[str] = set()
        for m in msgs[2:-1]:
            if m["role"] == "assistant":
                assert not pending, "tool result missing before next assistant turn"
                assert isinstance(m["content"], str) and m["content"]
                (tc,) = m["tool_calls"]
                assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["id"] not in seen
                fn = tc["function"]
                assert fn["name"] in tool_names - {"done"}
                args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
                assert isinstance(args, dict)
                if fn["name"] == "click":
                    assert isinstance(args["x"], int) and isinstance(args["y"], int)
                pending.add(tc["id"])
                seen.add(tc["id"])
            else:
                assert m["role"] == "tool"
                assert m["tool_call_id"] in pending
                pending.discard(m["tool_call_id"])
                assert [p["type"] for p in m["content"]] == ["text", "image_url"]
        assert not pending


def test_image_counts_and_fractions(records):
    counts = [len(_image_urls(r)) for r in records]
    with_images = [c for c in counts if c]
    assert all(2 <= c <= 12 for c in with_images)
    assert min(with_images) <= 4 and max(with_images) >= 10  # spread over the range, not clustered
    text_only = counts.count(0)
    assert 3 <= text_only <= 9  # 10% of 60, low-discrepancy selection
    overlong = [r for r in records if _text_len(r) > 20_000]
    assert 3 <= len(overlong) <= 9
    assert any(_image_urls(r) for r in overlong)


def test_both_forms_occur(records):
    forms = {bare for r in records for _, bare in _image_urls(r)}
    assert forms == {True, False}
    arg_types = {
        type(tc["function"]["arguments"]) for r in records for m in r["messages"] for tc in m.get("tool_calls", [])
    }
    assert arg_types == {str, dict}


def test_images_decode_and_repeat(records):
    repeats = distinct = 0
    for rec in records[:30]:
        urls = [u for u, _ in _image_urls(rec)]
        for prev, cur in zip(urls, urls[1:]):
            repeats += prev == cur
            distinct += prev != cur
    assert repeats >= 1 and distinct > repeats * 3
    rec = next(r for r in records if _image_urls(r))
    for uri, _ in _image_urls(rec)[:4]:
        im = Image.open(io.BytesIO(_png(uri)))
        assert im.format == "PNG" and im.mode == "RGB" and im.size == (320, 200)
        im.load()


def test_default_size_screenshot():
    (rec,) = generate_traces(n=1, seed=0, min_images=2, max_images=2, text_only_fraction=0.0)
    ims = [Image.open(io.BytesIO(_png(u))) for u, _ in _image_urls(rec)]
    assert len(ims) == 2 and all(im.size == (1280, 720) and im.mode == "RGB" for im in ims)


def test_rejects_bad_args():
    with pytest.raises(ValueError):
        list(generate_traces(n=1, min_images=3, max_images=2))
    with pytest.raises(ValueError):
        list(generate_traces(n=1, text_only_fraction=1.5))
