import base64
import io
import os

import pytest
from PIL import Image

from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
from vlmprep.types import RecordError, Source


def png_bytes(w=8, h=6, color=(255, 0, 0)):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(b):
    return "data:image/png;base64," + base64.b64encode(b).decode()


@pytest.fixture
def src(tmp_path):
    return Source(str(tmp_path / "in.jsonl"), 7)


OPTS = NormalizeOptions()


def test_string_content_becomes_text_part_and_null_fields_drop(src):
    rec = {
        "id": None,
        "messages": [
            {"role": "system", "content": "be brief", "tool_calls": None, "name": None},
            {"role": "user", "content": [{"type": "text", "text": "hi", "image_url": None}]},
            {"role": "assistant", "content": "hello", "tool_calls": None, "weight": None},
        ],
        "tools": None,
    }
    conv = normalize_record(rec, src, OPTS)
    assert [m.role for m in conv.messages] == ["system", "user", "assistant"]
    assert [[(p.type, p.text) for p in m.parts] for m in conv.messages] == [
        [("text", "be brief")],
        [("text", "hi")],
        [("text", "hello")],
    ]
    assert conv.id == "~in.jsonl:7"  # no id: ~input name:line (normalize.generated_id)
    assert conv.tools is None


def test_image_url_object_and_bare_string_and_tool_images(src):
    b1, b2 = png_bytes(color=(1, 2, 3)), png_bytes(color=(4, 5, 6))
    rec = {
        "id": "r1",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": data_uri(b1)}},
                ],
            },
            {
                "role": "assistant",
                "content": "clicking",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "click", "arguments": {"x": 1, "y": 2}}}
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "text", "text": "done"}, {"type": "image_url", "image_url": data_uri(b2)}],
            },
            {"role": "assistant", "content": "ok"},
        ],
    }
    conv = normalize_record(rec, src, OPTS)
    assert [im.data for im in conv.images] == [b1, b2]
    assert conv.messages[2].role == "tool" and conv.messages[2].tool_call_id == "c1"
    tc = conv.messages[1].tool_calls[0]
    assert (tc.id, tc.name, tc.arguments) == ("c1", "click", {"x": 1, "y": 2})  # kept as given


def test_arguments_as_json_string_kept_and_invalid_rejected(src):
    rec = {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "type", "arguments": '{"text": "abc"}'}}],
            },
        ]
    }
    conv = normalize_record(rec, src, OPTS)
    assert conv.messages[1].tool_calls[0].arguments == '{"text": "abc"}'
    rec["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(RecordError) as e:
        normalize_record(rec, src, OPTS)
    assert e.value.reason == "invalid_tool_arguments"


def test_llamafactory_markers_take_images_in_order(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(color=(9, 9, 9)))
    (tmp_path / "b.png").write_bytes(png_bytes(color=(8, 8, 8)))
    rec = {
        "messages": [
            {"role": "user", "content": "<image>Who?"},
            {"role": "assistant", "content": "Them."},
            {"role": "user", "content": "And<image>"},
            {"role": "assistant", "content": "Us."},
        ],
        "images": ["a.png", "b.png"],
    }
    conv = normalize_record(rec, Source(str(tmp_path / "d.json"), 1), OPTS)
    assert [(p.type, p.text) for p in conv.messages[0].parts] == [("image", None), ("text", "Who?")]
    assert [(p.type, p.text) for p in conv.messages[2].parts] == [("text", "And"), ("image", None)]
    assert [im.origin for im in conv.images] == ["a.png", "b.png"]


def test_llamafactory_video_markers_take_videos_in_order(tmp_path):
    """LLaMA-Factory's video layout (its mllm_video_demo: `"videos": ["x.mp4"]`, `<video>` in the text): each marker
    takes the next video, as a video part (a path, or a list of frame images), beside <image> markers; the same
    record with no video support, or with markers and videos that do not pair up, is a reject, never text."""
    (tmp_path / "a.mp4").write_bytes(b"mp4 bytes")
    (tmp_path / "b.png").write_bytes(png_bytes(color=(8, 8, 8)))
    rec = {
        "messages": [
            {"role": "user", "content": "<video>Why is this video funny?"},
            {"role": "assistant", "content": "A baby reads."},
            {"role": "user", "content": "And<image>this<video>?"},
            {"role": "assistant", "content": "Us."},
        ],
        "videos": ["a.mp4", ["b.png", "b.png"]],
        "images": ["b.png"],
    }
    source = Source(str(tmp_path / "d.json"), 1)
    conv = normalize_record(rec, source, NormalizeOptions(videos=True))
    assert [p.type for p in conv.messages[0].parts] == ["video", "text"]
    assert [(p.type, p.text) for p in conv.messages[2].parts] == [
        ("text", "And"),
        ("image", None),
        ("text", "this"),
        ("video", None),
        ("text", "?"),
    ]
    first, second = conv.videos
    assert (first.data, first.origin) == (b"mp4 bytes", "a.mp4") and len(second.frames) == 2
    # The same as the OpenAI layout's video part, so it renders as one (tests/vlmprep/test_videos.py builds both).
    openai = normalize_record(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": "a.mp4"},
                        {"type": "text", "text": "Why is this video funny?"},
                    ],
                },
                {"role": "assistant", "content": "A baby reads."},
            ]
        },
        source,
        NormalizeOptions(videos=True),
    )
    assert openai.messages[0].parts == conv.messages[0].parts
    bad = [
        ({**rec, "videos": ["a.mp4"]}, "video_count_mismatch", "more <video> markers than 'videos' entries"),
        (
            {**rec, "videos": ["a.mp4"] * 3},
            "video_count_mismatch",
            "'videos' lists 3 videos but the text has only 2 <video> markers",
        ),
        ({**rec, "videos": "a.mp4"}, "invalid_videos_field", "'videos' must be a list"),
        ({**rec, "videos": [7, "a.mp4"]}, "invalid_video_ref", "video reference must be a non-empty string"),
    ]
    for record, reason, text in bad:
        with pytest.raises(RecordError) as e:
            normalize_record(record, source, NormalizeOptions(videos=True))
        assert (e.value.reason, text in e.value.message) == (reason, True), e.value.message
    with pytest.raises(RecordError) as e:  # a family without video support: refused, not trained as "<video>" text
        normalize_record(rec, source, OPTS)
    assert e.value.reason == "unsupported_video"
    # In the OpenAI layout (no 'videos' or 'images' list, no 'conversations') the marker is ordinary text.
    plain = {"messages": [{"role": "user", "content": "<video> tags"}, {"role": "assistant", "content": "ok"}]}
    assert normalize_record(plain, source, NormalizeOptions(videos=True)).messages[0].text == "<video> tags"


def test_sharegpt_conversations_layout(src):
    rec = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    conv = normalize_record(rec, src, OPTS)
    assert [(m.role, m.text) for m in conv.messages] == [("user", "q"), ("assistant", "a")]


@pytest.mark.parametrize(
    "rec,reason",
    [
        ({"foo": 1}, "missing_messages"),
        ({"messages": []}, "missing_messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn"),
        (
            {"messages": [{"role": "user", "content": [{"type": "hologram"}]}, {"role": "assistant", "content": "a"}]},
            "unknown_content_type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
                    },
                    {"role": "assistant", "content": "a"},
                ]
            },
            "invalid_base64",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "missing.png"}]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "image_not_found",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "http://x.test/a.png"}]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "remote_image_refused",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "../../etc/passwd"}]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "path_outside_root",
        ),
        (
            {"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "a"}], "images": []},
            "image_count_mismatch",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
                "images": ["x.png"],
            },
            "image_count_mismatch",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "unsupported_video",
        ),
        (
            {"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "a"}]},
            "invalid_unicode",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
            "empty_assistant_turn",
        ),
    ],
)
def test_bad_records_get_reason_codes(rec, reason, src):
    with pytest.raises(RecordError) as e:
        normalize_record(rec, src, OPTS)
    assert e.value.reason == reason


def test_symlink_escaping_root_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png_bytes())
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside / "secret.png", root / "link.png")
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": "link.png"}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    with pytest.raises(RecordError) as e:
        normalize_record(rec, Source(str(root / "in.jsonl"), 1), OPTS)
    assert e.value.reason == "path_outside_root"
    # An explicit wider root admits it.
    conv = normalize_record(rec, Source(str(root / "in.jsonl"), 1), NormalizeOptions(image_root=str(tmp_path)))
    assert len(conv.images) == 1


LEGACY = {
    "id": "legacy",
    "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": '{"city":"Paris"}'}},
        {"role": "function", "name": "weather", "content": "18C"},
        {
            "role": "assistant",
            "content": "Now Rome.",
            "function_call": {"name": "weather", "arguments": {"city": "Rome"}},
        },
        {"role": "function", "name": "weather", "content": "22C"},
        {"role": "assistant", "content": "Paris 18C, Rome 22C."},
    ],
}
# The same conversation in today's format, with the ids vlmprep generates ("call_<message index>").
MODERN = {
    "id": "legacy",
    "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
            ],
        },
        {"role": "tool", "name": "weather", "tool_call_id": "call_1", "content": "18C"},
        {
            "role": "assistant",
            "content": "Now Rome.",
            "tool_calls": [
                {"id": "call_3", "type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}}
            ],
        },
        {"role": "tool", "name": "weather", "tool_call_id": "call_3", "content": "22C"},
        {"role": "assistant", "content": "Paris 18C, Rome 22C."},
    ],
}


def test_legacy_function_call_becomes_tool_calls_with_generated_ids(src):
    conv = normalize_record(LEGACY, src, OPTS)
    assert conv == normalize_record(MODERN, src, OPTS)
    assert [(tc.id, tc.arguments) for tc in conv.messages[1].tool_calls] == [("call_1", '{"city":"Paris"}')]
    assert [(m.role, m.tool_call_id) for m in conv.messages[2::2]] == [("tool", "call_1"), ("tool", "call_3")]


def test_refusal_without_content_is_the_assistant_content(src):
    rec = {
        "messages": [
            {"role": "user", "content": "Do a bad thing."},
            {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        ]
    }
    assert normalize_record(rec, src, OPTS).messages[1].text == "I can't help with that."
    rec["messages"][1]["content"] = "Kept."
    assert normalize_record(rec, src, OPTS).messages[1].text == "Kept."


@pytest.mark.parametrize(
    "bad",
    [
        {"function_call": "weather()"},
        {
            "function_call": {"name": "w", "arguments": "{}"},
            "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}],
        },
    ],
)
def test_malformed_legacy_function_call_is_rejected(bad, src):
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", **bad}]}
    with pytest.raises(RecordError) as e:
        normalize_record(rec, src, OPTS)
    assert e.value.reason == "invalid_tool_call" and "function_call" in e.value.message


def _user_image(part, assistant="a"):
    return {"messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": assistant}]}


def test_base64_with_mime_line_breaks_or_spaces_reads_as_load_image_reads_it(src):
    import textwrap

    b = png_bytes(40, 30)
    b64 = base64.b64encode(b).decode()
    mime = base64.encodebytes(b).decode()  # what the `base64` command writes: a line break every 76 characters
    assert "\n" in mime
    for body in (mime, " ".join(textwrap.wrap(b64, 10)), "\r\n".join(textwrap.wrap(b64, 76))):
        uri = "data:image/png;base64," + body
        conv = normalize_record(_user_image({"type": "image_url", "image_url": uri}), src, OPTS)
        assert conv.images[0].data == b
        assert base64.decodebytes(body.encode()) == b  # what transformers' load_image decodes the string with
    for bad in (b64[:-2] + "@@", b64 + " =x", "\n \t"):  # still strict about everything but whitespace
        with pytest.raises(RecordError) as e:
            normalize_record(_user_image({"type": "image_url", "image_url": "data:image/png;base64," + bad}), src, OPTS)
        assert e.value.reason == "invalid_base64"


def test_file_urls_are_percent_decoded_and_stay_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "with space").mkdir(parents=True)
    (root / "with space" / "a b.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    src = Source(str(root / "in.jsonl"), 1)
    url = "file://" + str(root / "with%20space" / "a%20b.png")
    conv = normalize_record(_user_image({"type": "image_url", "image_url": url}), src, OPTS)
    assert conv.images[0].data == png_bytes()
    rel = normalize_record(_user_image({"type": "image_url", "image_url": "file://with%20space/a%20b.png"}), src, OPTS)
    assert rel.images[0].data == png_bytes()
    for ref, reason in (
        ("file://%2e%2e/secret.png", "path_outside_root"),
        ("file://" + str(root) + "/%2E%2E/secret.png", "path_outside_root"),
        ("file://with%20space/a%00b.png", "invalid_image_ref"),
        ("with space/a\x00b.png", "invalid_image_ref"),
    ):
        with pytest.raises(RecordError) as e:
            normalize_record(_user_image({"type": "image_url", "image_url": ref}), src, OPTS)
        assert e.value.reason == reason, ref


def test_responses_api_output_text_and_refusal_parts_read_as_text(src):
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "answer", "annotations": []}]},
            {"role": "user", "content": "and this?"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        ]
    }
    conv = normalize_record(rec, src, OPTS)
    assert [m.text for m in conv.messages] == ["q", "answer", "and this?", "I can't help with that."]
    assert conv == normalize_record(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "answer"}]},
                {"role": "user", "content": "and this?"},
                {"role": "assistant", "content": [{"type": "text", "text": "I can't help with that."}]},
            ]
        },
        src,
        OPTS,
    )


def test_anthropic_image_sources_read_as_the_same_data_uri_or_path(tmp_path):
    b = png_bytes(16, 12, (7, 8, 9))
    (tmp_path / "shot.png").write_bytes(b)
    src = Source(str(tmp_path / "in.jsonl"), 1)
    want = normalize_record(_user_image({"type": "image_url", "image_url": data_uri(b)}), src, OPTS)
    mime = base64.encodebytes(b).decode()
    for source in (
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b).decode()},
        {"type": "base64", "media_type": "image/png", "data": mime},
        {"type": "url", "url": data_uri(b)},
        {"type": "url", "url": "shot.png"},
    ):
        conv = normalize_record(_user_image({"type": "image", "source": source}), src, OPTS)
        assert [im.data for im in conv.images] == [im.data for im in want.images], source
    for source, reason in (
        ({"type": "url", "url": "https://example.test/a.png"}, "remote_image_refused"),
        ({"type": "url", "url": "../outside.png"}, "path_outside_root"),
        ({"type": "base64", "media_type": "image/png", "data": "@@"}, "invalid_base64"),
        ({"type": "file", "file_id": "file_011"}, "unsupported_file_id"),
        ({"type": "bytes"}, "unsupported_image_source"),
    ):
        with pytest.raises(RecordError) as e:
            normalize_record(_user_image({"type": "image", "source": source}), src, OPTS)
        assert e.value.reason == reason, source
        assert reason != "unsupported_image_source" or "Anthropic" in e.value.message


def test_responses_file_id_image_is_rejected_as_such(src):
    with pytest.raises(RecordError) as e:
        normalize_record(_user_image({"type": "input_image", "file_id": "file-abc", "detail": "auto"}), src, OPTS)
    assert e.value.reason == "unsupported_file_id" and "file_id (OpenAI Files API)" in e.value.message


def test_the_record_schema_describes_the_dialect_parts():
    from vlmprep.tools.verify import schema_validator

    v = schema_validator("record.schema.json")
    b64 = base64.b64encode(png_bytes()).decode()
    v.validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "q"},
                        {"type": "input_image", "image_url": "x.png"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                        {"type": "image", "source": {"type": "url", "url": "x.png"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"}],
                },
            ]
        }
    )
    assert not v.is_valid({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "s3"}}]}]})
