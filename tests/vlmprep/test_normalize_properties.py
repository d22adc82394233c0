"""Property tests: any JSON-shaped record either normalizes into a well-formed Conversation or is rejected
with a RecordError reason; never another exception. Size per `HYPOTHESIS_PROFILE` (see tests/conftest.py)."""

import base64
import io
import json

from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
from vlmprep.types import Conversation, RecordError, Source


def _png():
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PNG = _png()
texts = st.text(max_size=40)
image_refs = st.one_of(
    st.just(PNG),
    st.just({"url": PNG}),
    st.none(),
    st.just(""),
    st.integers(),
    st.just("data:image/png;base64,%%%"),
    st.just("../../etc/passwd"),
    st.just("http://x.test/a.png"),
)
parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(lambda r: {"type": "image_url", "image_url": r}, image_refs),
    st.builds(lambda t, r: {"type": t, "image_url": r}, st.sampled_from(["video", "audio", "weird", None]), image_refs),
    texts,
    st.none(),
    st.integers(),
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.one_of(st.none(), texts),
            "function": st.fixed_dictionaries(
                {
                    "name": st.one_of(st.just("click"), st.just(""), st.none()),
                    "arguments": st.one_of(
                        st.just('{"x": 1}'),
                        st.just("{bad"),
                        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                        st.integers(),
                    ),
                }
            ),
        }
    ),
    max_size=2,
)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "gpt", "human", "wizard", None])},
    optional={
        "content": st.one_of(texts, st.none(), st.lists(parts, max_size=4), st.integers()),
        "tool_calls": st.one_of(st.none(), tool_calls),
        "tool_call_id": st.one_of(st.none(), texts),
        "weight": st.sampled_from([None, 0, 1, 2]),
    },
)
records = st.one_of(
    st.fixed_dictionaries(
        {"messages": st.lists(messages, max_size=6)},
        optional={
            "id": st.one_of(st.none(), texts, st.integers()),
            "images": st.one_of(st.none(), st.lists(st.just(PNG), max_size=2)),
        },
    ),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
)


@given(records)
def test_normalize_total_and_well_formed(rec):
    try:
        conv = normalize_record(rec, Source("/tmp/p/x.jsonl", 3), NormalizeOptions())
    except RecordError as e:
        assert e.reason and e.message and "\n" not in e.reason
        return
    assert isinstance(conv, Conversation) and conv.id
    assert any(m.role == "assistant" for m in conv.messages)
    for m in conv.messages:
        assert m.role in ("system", "user", "assistant", "tool")
        assert m.weight in (None, 0, 1)
        for p in m.parts:
            assert (p.type == "text" and isinstance(p.text, str) and p.text.encode("utf-8")) or (
                p.type == "image" and p.image.data
            )
        for tc in m.tool_calls:
            json.loads(tc.arguments_json)
            assert tc.name
    # Every image in the input that survived is a real image reference (here: always PNG).
    assert all(im.data.startswith(b"\x89PNG") for im in conv.images)


@given(records)
def test_normalize_is_deterministic_and_roundtrips(rec):
    try:
        a = normalize_record(rec, Source("/tmp/p/x.jsonl", 3), NormalizeOptions())
    except RecordError:
        return
    b = normalize_record(json.loads(json.dumps(rec)), Source("/tmp/p/x.jsonl", 3), NormalizeOptions())
    assert a == b
