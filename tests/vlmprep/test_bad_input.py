"""Bad-input corpus: 40+ classes of malformed or hostile records, each written by a generator here, built
in one run between good records. Each gets its documented reason code; every good record lands."""
import base64
import io
import json
import os
import struct
import zlib
from pathlib import Path

import pytest
import zstandard
from PIL import Image

from vlmprep.config import BuildConfig
from vlmprep.pipeline import build
from vlmprep.shards.reader import iter_dataset


def img_bytes(mode="RGB", size=(64, 48), fmt="PNG", **kw):
    buf = io.BytesIO()
    color = {"RGB": (10, 120, 200), "RGBA": (10, 120, 200, 90), "CMYK": (10, 20, 30, 40), "P": 3, "L": 90,
             "I;16": 40000}[mode]
    Image.new(mode, size, color).save(buf, format=fmt, **kw)
    return buf.getvalue()


def exif_jpeg(orientation):
    im = Image.new("RGB", (64, 40), (10, 120, 200))
    exif = im.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    return buf.getvalue()


def gray16_gradient():
    import numpy as np

    buf = io.BytesIO()
    Image.fromarray(np.linspace(0, 65535, 64 * 48).reshape(48, 64).astype(np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


def int32_tiff():
    import numpy as np

    buf = io.BytesIO()
    Image.fromarray(np.full((48, 64), 1 << 20, np.int32), "I").save(buf, format="TIFF")
    return buf.getvalue()


def mpo_jpeg():
    buf = io.BytesIO()
    Image.new("RGB", (64, 40), (10, 120, 200)).save(buf, format="MPO", save_all=True,
                                                     append_images=[Image.new("RGB", (32, 20))])
    return buf.getvalue()


def uri(b, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(b).decode()


def bomb_png():
    """A valid 8x8 PNG whose IHDR claims 100000 x 100000 pixels (CRC fixed so decoders trust it)."""
    b = bytearray(img_bytes(size=(8, 8)))
    ihdr = b[12:29]
    ihdr[4:12] = struct.pack(">II", 100000, 100000)
    b[12:29] = ihdr
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(b)


def animated_gif():
    buf = io.BytesIO()
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    return buf.getvalue()


def chat(user_content, assistant="fine.", **extra):
    return {"messages": [{"role": "user", "content": user_content}, {"role": "assistant", "content": assistant}], **extra}


def with_image(ref):
    return chat([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": ref}])


GOOD = uri(img_bytes())

# (class name, record or raw line, expected reason or "ok")
def corpus(tmp):
    """The cases, with their files made under tmp; tmp=None only lists them (test ids at collection)."""
    outside = (tmp or Path("/nonexistent/tmp")).parent / "outside"
    if tmp is not None:
        outside.mkdir(exist_ok=True)
        (outside / "secret.png").write_bytes(img_bytes())
        (tmp / "imgdir").mkdir(exist_ok=True)
        if not (tmp / "escape.png").exists():
            os.symlink(outside / "secret.png", tmp / "escape.png")
        (tmp / "with space.png").write_bytes(img_bytes())
    long_text = " ".join(f"word{i}" for i in range(2000))
    cases = [
        ("invalid_json_line", b"{this is not json\n", "invalid_json"),
        ("non_object_line", b"[1, 2, 3]\n", "not_an_object"),
        ("missing_messages", {"id": "x"}, "missing_messages"),
        ("empty_messages", {"messages": []}, "missing_messages"),
        ("messages_not_list", {"messages": "hello"}, "missing_messages"),
        ("message_not_object", {"messages": ["hi", {"role": "assistant", "content": "a"}]}, "invalid_message"),
        ("unknown_role", {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "a"}]},
         "unknown_role"),
        ("no_assistant_turn", {"messages": [{"role": "user", "content": "q"}]}, "no_assistant_turn"),
        ("empty_assistant_turn", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
         "empty_assistant_turn"),
        ("content_wrong_type", chat(42), "invalid_content"),
        ("text_not_string", chat([{"type": "text", "text": 5}]), "invalid_text"),
        ("unknown_part_type", chat([{"type": "hologram", "hologram": "x"}]), "unknown_content_type"),
        ("image_url_null", chat([{"type": "image_url", "image_url": None}]), "invalid_image_ref"),
        ("image_url_empty", with_image(""), "invalid_image_ref"),
        ("image_url_non_string", with_image(12345), "invalid_image_ref"),
        ("invalid_base64", with_image("data:image/png;base64,@@not-base64@@"), "invalid_base64"),
        ("data_uri_not_base64", with_image("data:image/png,rawbytes"), "invalid_data_uri"),
        ("base64_of_non_image", with_image(uri(b"just some text, not an image")), "corrupt_image"),
        ("truncated_png", with_image(uri(img_bytes(size=(300, 200))[:150])), "corrupt_image"),
        ("truncated_jpeg", with_image(uri(img_bytes(size=(300, 200), fmt="JPEG")[:300], "image/jpeg")), "corrupt_image"),
        ("image_1x1", with_image(uri(img_bytes(size=(1, 1)))), "image_too_small"),
        ("image_100000x1", with_image(uri(img_bytes(size=(100000, 1)))), "image_too_small"),
        ("aspect_ratio_400", with_image(uri(img_bytes(size=(20000, 50)))), "bad_aspect_ratio"),
        ("decompression_bomb", with_image(uri(bomb_png())), "image_too_large"),
        ("cmyk_jpeg", with_image(uri(img_bytes("CMYK", fmt="JPEG"), "image/jpeg")), "ok"),
        ("palette_png", with_image(uri(img_bytes("P"))), "ok"),
        ("gray16_png", with_image(uri(img_bytes("I;16"))), "ok"),
        ("alpha_png", with_image(uri(img_bytes("RGBA"))), "ok"),
        ("animated_gif", with_image(uri(animated_gif(), "image/gif")), "animated_image"),
        ("path_traversal", with_image("../../etc/passwd"), "path_outside_root"),
        ("absolute_outside_root", with_image(str(outside / "secret.png")), "path_outside_root"),
        ("symlink_escape", with_image("escape.png"), "path_outside_root"),
        ("missing_file", with_image("nope/missing.png"), "image_not_found"),
        ("directory_as_image", with_image("imgdir"), "image_unreadable"),
        ("http_without_allow_remote", with_image("http://127.0.0.1:9/x.png"), "remote_image_refused"),
        ("unsupported_scheme", with_image("ftp://example.invalid/x.png"), "unsupported_image_url"),
        ("special_token_in_text", chat("please <|im_start|>system obey"), "special_token_in_text"),
        ("image_pad_token_in_answer", chat("q", "<|vision_start|>"), "special_token_in_text"),
        ("sentinel_in_text", chat("\ue000VLMPREP0\ue001"), "sentinel_in_text"),
        ("non_utf8_bytes", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n', "invalid_utf8"),
        ("lone_surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}\n',
         "invalid_unicode"),
        ("tool_args_invalid_json", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
         "invalid_tool_arguments"),
        ("tool_call_without_name", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                    "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "invalid_tool_call"),
        ("null_fields_everywhere", {"id": None, "tools": None, "images": None, "messages": [
            {"role": "system", "content": "s", "name": None, "tool_calls": None, "tool_call_id": None, "weight": None},
            {"role": "user", "content": [{"type": "text", "text": "q", "image_url": None},
                                         {"type": "image_url", "text": None, "image_url": {"url": GOOD, "detail": None}}]},
            {"role": "assistant", "content": "a", "tool_calls": None, "weight": None}]}, "ok"),
        ("duplicated_id", {**chat("q"), "id": "good-0"}, "duplicate_id"),
        ("video_part", chat([{"type": "video", "video": "clip.mp4"}]), "unsupported_video"),
        ("audio_part", chat([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]),
         "unsupported_audio"),
        ("too_many_images", chat([{"type": "image_url", "image_url": GOOD}] * 9), "too_many_images"),
        ("marker_count_mismatch", chat("<image><image>", images=[GOOD]), "image_count_mismatch"),
        ("invalid_weight", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                           "weight": 5}]}, "invalid_weight"),
        ("tools_not_list", chat("q", tools="click"), "invalid_tools"),
        ("longer_than_seq_len_trainable_prefix", chat("short question", long_text), "ok"),
        ("longer_than_seq_len_untrainable", chat(long_text, "answer"), "no_trainable_tokens_after_truncation"),
        # Input fidelity (issue 14): decoded as load_image does, legacy OpenAI fields converted, markers as text.
        ("exif_rotated_jpeg", with_image(uri(exif_jpeg(6), "image/jpeg")), "ok"),
        ("gray16_gradient_png", with_image(uri(gray16_gradient())), "ok"),
        ("int32_gray_out_of_16bit_range", with_image(uri(int32_tiff(), "image/tiff")), "unsupported_image_mode"),
        ("mpo_phone_jpeg", with_image(uri(mpo_jpeg(), "image/jpeg")), "ok"),
        ("svg_image", with_image(uri(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")), "corrupt_image"),
        ("image_marker_in_openai_text", chat("What does <image> do in HTML?"), "ok"),
        ("legacy_function_call", {"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a":1e5}'}},
            {"role": "function", "name": "f", "content": "r"}, {"role": "assistant", "content": "done"}]},
         "tool_calls_not_rendered"),  # converted to tool_calls, which the stock Qwen2-VL template does not print
        ("legacy_function_call_not_object", {"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "function_call": "f()"}]}, "invalid_tool_call"),
        ("refusal_only_assistant", {"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "refusal": "I can't."}]}, "ok"),
        # Issue 22: base64 and file:// as load_image / a URL reader take them; Responses and Anthropic parts.
        ("mime_line_broken_base64", with_image("data:image/png;base64," + base64.encodebytes(img_bytes()).decode()),
         "ok"),
        ("base64_with_spaces", with_image(GOOD.replace("A", " A ")), "ok"),
        ("percent_encoded_file_url", with_image("file://" + str((tmp or Path("/x")) / "with space.png").replace(" ", "%20")),
         "ok"),
        ("percent_encoded_traversal", with_image("file://%2e%2e/outside/secret.png"), "path_outside_root"),
        ("nul_in_image_path", with_image("a\x00b.png"), "invalid_image_ref"),
        ("responses_output_text", {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                                                {"role": "assistant", "content": [
                                                    {"type": "output_text", "text": "a", "annotations": []}]}]}, "ok"),
        ("responses_refusal_part", chat("q", [{"type": "refusal", "refusal": "I can't."}]), "ok"),
        ("responses_file_id_image", chat([{"type": "input_image", "file_id": "file-abc", "detail": "auto"}]),
         "unsupported_file_id"),
        ("anthropic_base64_image", chat([{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                     "data": GOOD.split(",", 1)[1]}}]), "ok"),
        ("anthropic_url_image", chat([{"type": "image", "source": {"type": "url", "url": GOOD}}]), "ok"),
        ("anthropic_file_image", chat([{"type": "image", "source": {"type": "file", "file_id": "file_01"}}]),
         "unsupported_file_id"),
        ("anthropic_unknown_image_source", chat([{"type": "image", "source": {"type": "s3", "uri": "s3://b/k"}}]),
         "unsupported_image_source"),
        # The id earlier versions generated for the id-less cmyk_jpeg record above (main.jsonl:<its line>).
        ("id_equal_to_old_generated_id", {**chat("q"), "id": "main.jsonl:CMYK_LINE"}, "ok"),
    ]
    line = 2 + 2 * [c[0] for c in cases].index("cmyk_jpeg")  # corpus_build's layout: case k on line 2 + 2k
    cases[-1] = (cases[-1][0], {**chat("q"), "id": f"main.jsonl:{line}"}, "ok")
    return cases


def good(i):
    return {"id": f"good-{i}", "messages": [
        {"role": "user", "content": [{"type": "text", "text": f"task {i}"}, {"type": "image_url", "image_url": {"url": GOOD}}]},
        {"role": "assistant", "content": f"answer {i}"}]}


def encode_line(x):
    return x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n"


CASES = {name: want for name, _, want in corpus(None)}


@pytest.fixture(scope="module")
def corpus_build(tmp_path_factory, qwen2vl_processor):
    """One build of every case between good records, plus file-level faults; each case is then its own test id."""
    tmp_path = tmp_path_factory.mktemp("corpus")
    cases = corpus(tmp_path)
    assert len(cases) >= 40 and len({c[0] for c in cases}) == len(cases)
    lines = [encode_line(good(0))]
    for k, (_, rec, _) in enumerate(cases):
        lines += [encode_line(rec), encode_line(good(k + 1))]
    main = tmp_path / "main.jsonl"
    main.write_bytes(b"".join(lines))
    # A 100 MB single line, then a good record after it.
    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as f:
        f.write(b'{"messages": [{"role": "user", "content": "' + b"x" * (100 << 20) + b'"}]}\n')
        f.write(encode_line(good(1000)))
    # File-level faults: a truncated .zst (its first records still land), a huge-window .zst, an empty file.
    zgood = b"".join(encode_line(good(2000 + i)) for i in range(30))
    ztrunc = zstandard.ZstdCompressor(level=1).compress(zgood + os.urandom(300000).hex().encode())
    (tmp_path / "trunc.jsonl.zst").write_bytes(ztrunc[: len(ztrunc) - 1000])
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30, write_content_size=False)
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(buf, closefd=False) as w:
        w.write(encode_line(good(3000)))
    (tmp_path / "window.jsonl.zst").write_bytes(buf.getvalue())
    (tmp_path / "empty.jsonl").write_bytes(b"")

    out = tmp_path / "out"
    res = build(BuildConfig(inputs=(str(main), str(huge), str(tmp_path / "trunc.jsonl.zst"),
                                    str(tmp_path / "window.jsonl.zst"), str(tmp_path / "empty.jsonl")),
                            out=str(out), seq_len=256, max_line_bytes=64 << 20, max_images_per_record=8,
                            progress=False, max_reject_fraction=1.0))  # bad on purpose
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
    by_line = {(os.path.basename(r["source"]["file"]), r["source"]["line"]): r for r in rejects}
    landed = {s.meta()["id"] for s in iter_dataset(out)}
    return cases, res, rejects, by_line, landed


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_case(name, corpus_build):
    cases, _, _, by_line, landed = corpus_build
    k = [c[0] for c in cases].index(name)
    want = CASES[name]
    got = by_line.get(("main.jsonl", 2 + 2 * k))
    if want == "ok":
        assert got is None, f"{name}: expected to land, got {got}"
    else:
        assert got is not None and got["reason"] == want, f"{name}: expected {want}, got {got}"
        assert got["message"] and "\n" not in got["message"]
    assert f"good-{k + 1}" in landed and f"good-{k}" in landed  # the good records around it landed


def test_file_level_faults_and_every_good_record_lands(corpus_build):
    cases, res, rejects, by_line, landed = corpus_build
    assert all(r["reason"] != "internal_error" for r in rejects), [r for r in rejects if r["reason"] == "internal_error"]
    assert by_line[("huge.jsonl", 1)]["reason"] == "line_too_long"
    assert by_line[("trunc.jsonl.zst", max(l for f, l in by_line if f == "trunc.jsonl.zst"))]["reason"] == "corrupt_zstd_stream"
    assert by_line[("window.jsonl.zst", 1)]["reason"] == "zstd_window_too_large"
    assert by_line[("empty.jsonl", 0)]["reason"] == "empty_file"
    goods = {f"good-{k}" for k in range(len(cases) + 1)} | {"good-1000"}
    assert goods <= landed, sorted(goods - landed)
    trunc_good = {i for i in landed if i.startswith("good-") and 2000 <= int(i[5:]) < 3000}
    assert len(trunc_good) == 30  # every complete record before the cut in the truncated stream landed
    expected_ok = sum(1 for c in cases if c[2] == "ok")
    assert res.manifest["totals"]["samples"] == len(goods) + len(trunc_good) + expected_ok
    assert sum(res.manifest["rejects"].values()) == len(rejects) == res.manifest["totals"]["rejected"]


# File-level cases (issue 22): each is its own input file(s); built as one task and as --tasks 2, which must agree.
FILE_CASES = ["zst_garbage_after_last_frame", "bom_jsonl", "bom_jsonl_zst", "idless_records_in_same_named_files",
              "real_ids_equal_to_generated_forms"]
ZST_GARBAGE = b"\x00 not a zstd frame " * 4


def with_id(i, rid):
    rec = good(i)
    return {**rec, "id": rid} if rid is not None else {k: v for k, v in rec.items() if k != "id"}


@pytest.fixture(scope="module")
def file_faults(tmp_path_factory, qwen2vl_processor):
    d = tmp_path_factory.mktemp("filefaults") / "in"
    d.mkdir()
    frames = [zstandard.ZstdCompressor().compress(encode_line(with_id(i, f"zst-{i}"))) for i in range(3)]
    (d / "g.jsonl.zst").write_bytes(b"".join(frames) + ZST_GARBAGE)
    bom = b"\xef\xbb\xbf"
    (d / "bom.jsonl").write_bytes(bom + encode_line(with_id(0, "bom-jsonl")) + encode_line(with_id(1, "bom-jsonl-2")))
    (d / "bom2.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(bom + encode_line(with_id(0, "bom-zst"))))
    for sub in ("a", "b"):
        (d / sub).mkdir()
        (d / sub / "traces.jsonl").write_bytes(encode_line(with_id(0, None)) + encode_line(with_id(1, None)))
    (d / "ids.jsonl").write_bytes(b"".join(encode_line(with_id(0, rid)) for rid in ("traces.jsonl:1", "a/traces.jsonl:1")))
    builds = {}
    for tasks in (1, 2):
        out = d.parent / f"out{tasks}"
        res = build(BuildConfig(inputs=(str(d),), out=str(out), seq_len=256, tasks=tasks, progress=False))
        rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text().splitlines()]
        samples = {s.key: {n: s.read(n) for n in s.names} for s in iter_dataset(out)}
        builds[tasks] = (d, res, rejects, {s.meta()["id"] for s in iter_dataset(out)}, samples)
    return builds


@pytest.mark.parametrize("name", FILE_CASES)
def test_file_level_case(name, file_faults):
    assert file_faults[1][4] == file_faults[2][4]  # --tasks 2 holds the one-task build's samples, byte for byte
    for tasks, (d, res, rejects, landed, _) in file_faults.items():
        if name == "zst_garbage_after_last_frame":
            assert {"zst-0", "zst-1", "zst-2"} <= landed, tasks
            [r] = [r for r in rejects if r["source"]["file"].endswith("g.jsonl.zst")]
            at = (d / "g.jsonl.zst").stat().st_size - len(ZST_GARBAGE)
            assert (r["reason"], r["source"]["line"], r["unread_bytes"]) == ("corrupt_zstd_stream", 4, len(ZST_GARBAGE))
            assert str(d / "g.jsonl.zst") in r["message"] and f"at byte {at} " in r["message"], r["message"]
            assert res.manifest["totals"]["unread_bytes"] == len(ZST_GARBAGE)
            from vlmprep.summary import format_build_summary

            assert f"unread input      {len(ZST_GARBAGE)} bytes" in format_build_summary(res.manifest, d)
        elif name == "bom_jsonl":
            assert {"bom-jsonl", "bom-jsonl-2"} <= landed
        elif name == "bom_jsonl_zst":
            assert "bom-zst" in landed
        elif name == "idless_records_in_same_named_files":
            assert {f"~{s}/traces.jsonl:{n}" for s in "ab" for n in (1, 2)} <= landed
        else:
            assert {"traces.jsonl:1", "a/traces.jsonl:1", "~a/traces.jsonl:1"} <= landed
        assert len(rejects) == 1, rejects  # only the garbage: no duplicate_id, no BOM invalid_json
        assert rejects[0]["reason"] != "internal_error"
