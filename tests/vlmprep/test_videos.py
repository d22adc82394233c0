"""Video parts: each Qwen family's build equals the processor's own apply_chat_template on the same videos (token
ids, grids, second_per_grid_ts, mm types, pixel values of the stored frames, MRoPE positions = get_rope_index),
with videos made here by PyAV: different sizes, rates and lengths, an odd sampled frame count, one below the
processor's minimum frames; a frame list equals the same frames in a lossless file."""

import base64
import hashlib
import io
import json
import re
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.videos import decode_all, encode, frames
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.processors.load import load_processor
from vlmprep.shards.decode import decode_stored_image

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
# (frames, fps, width, height): 13 frames at 6 fps; 3 frames (below min_frames 4); 45 at 15 fps; 35 at 10 fps (Qwen3-VL
# samples 7: odd, padded by the processor); a portrait 21 at 7 fps.
CLIPS = [(13, 6, 80, 60), (3, 10, 64, 64), (45, 15, 96, 54), (35, 10, 72, 48), (21, 7, 50, 90)]


def _uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    out = []
    for k, (n, fps, w, h) in enumerate(CLIPS):
        data = encode(frames(n, w, h, seed=k), fps)
        (d / f"clip{k}.mp4").write_bytes(data)
        out.append(data)
    (d / "shot.png").write_bytes(_png(frames(1, 120, 80, seed=9)[0]))
    return d, out


def _record(with_paths: bool, clips_data) -> dict:
    """Videos as a path, a video_url data URI and a `video` path; an image; a tool call and its result."""

    def video(k):
        if k % 2 or not with_paths:
            return {"type": "video_url", "video_url": {"url": _uri(clips_data[k], "video/mp4")}}
        return {"type": "video", "video": f"clip{k}.mp4"}

    return {
        "id": "v",
        "messages": [
            {"role": "system", "content": "You watch videos."},
            {
                "role": "user",
                "content": [
                    video(0),
                    {"type": "text", "text": "What moves here"},
                    {"type": "image_url", "image_url": {"url": "shot.png"}},
                    video(1),
                ],
            },
            {
                "role": "assistant",
                "content": "Let me look closer.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "seek", "arguments": '{"t": 1.5}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "seeked"},
            {"role": "user", "content": [video(2), video(3), {"type": "text", "text": "And these?"}, video(4)]},
            {"role": "assistant", "content": "A square crosses each clip."},
        ],
    }


def _reference(processor, conv_messages, clips_data, image, **kw):
    """processor.apply_chat_template on the same messages, each video given as all its PyAV frames plus metadata,
    the processor sampling them itself (fps 2, its default sampling rate for Qwen3-VL and ours for Qwen2)."""
    from transformers.video_utils import VideoMetadata

    decoded = [decode_all(d) for d in clips_data]
    vids = iter(decoded)
    msgs = []
    for m in conv_messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = [
                {**c, "video": next(vids)[0]}
                if c["type"] == "video"
                else {**c, "image": image}
                if c["type"] == "image"
                else c
                for c in m["content"]
            ]
        msgs.append(m)
    meta = [VideoMetadata(total_num_frames=len(f), fps=fps) for f, fps in decoded]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return processor.apply_chat_template(
            msgs,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            do_sample_frames=True,
            fps=2.0,
            video_metadata=meta,
            **kw,
        )


def _read_one(out):
    """The one sample of a build, read with plain tarfile: arrays, meta and the video frames in member order."""
    [shard] = sorted(out.glob("shard-*.tar"))
    with tarfile.open(shard) as tf:
        members = {m.name.split(".", 1)[1]: tf.extractfile(m).read() for m in tf}
    arrays = {k[:-4]: np.load(io.BytesIO(v), allow_pickle=False) for k, v in members.items() if k.endswith(".npy")}
    meta = json.loads(members["json"])
    videos = [
        np.stack([decode_stored_image(n, members[n]) for n in sorted(members) if n.startswith(v["member"] + ".")])
        for v in meta["videos"]
    ]
    return arrays, meta, videos


def _assert_pixels_equal(processor, videos, want) -> None:
    """Stored frames (uint8) through the video processor's own rescale+normalize and patchify (which pads an odd
    frame count with the last frame) equal its pixel_values_videos, fp32, <= 1e-6."""
    vp = processor.video_processor
    mine = []
    for v in videos:
        t = torch.from_numpy(v).permute(0, 3, 1, 2)[None].contiguous()
        t = vp.rescale_and_normalize(t, True, vp.rescale_factor, True, vp.image_mean, vp.image_std)
        mine.append(
            vp.patchify(
                t, patch_size=vp.patch_size, merge_size=vp.merge_size, temporal_patch_size=vp.temporal_patch_size
            )[0][0]
        )
    got = torch.cat(mine)
    want = torch.as_tensor(want)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6


def _rope_model(family: str):
    """The model class's get_rope_index with a config, no weights: what the model computes positions with."""
    import transformers as tf

    cls, cfg = {
        "qwen2-vl": (tf.Qwen2VLModel, tf.Qwen2VLConfig(vision_config={"spatial_merge_size": 2})),
        "qwen2.5-vl": (
            tf.Qwen2_5_VLModel,
            tf.Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2, "tokens_per_second": 2}),
        ),
        "qwen3-vl": (tf.Qwen3VLModel, tf.Qwen3VLConfig(vision_config={"spatial_merge_size": 2})),
    }[family]
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    m.config = cfg
    return m


@pytest.fixture(scope="module")
def built(clips, tmp_path_factory):
    """One build per family of the record above, and the processor's own output for it."""
    d, data = clips
    (d / "r.jsonl").write_text(json.dumps(_record(True, data)) + "\n")
    res = {}
    for fam in FAMILIES:
        out = tmp_path_factory.mktemp(fam)
        build(
            BuildConfig(
                inputs=(str(d / "r.jsonl"),),
                out=str(out),
                processor=f"builtin:{fam}",
                seq_len=32768,
                tool_calls="train-content",
                progress=False,
                overwrite=True,
            )
        )
        processor = load_processor(str(out / "processor"))
        from vlmprep.ingest.normalize import normalize_record
        from vlmprep.process import Renderer
        from vlmprep.types import Source

        r = Renderer(
            BuildConfig(
                inputs=(str(d / "r.jsonl"),), out=str(out), processor=f"builtin:{fam}", tool_calls="train-content"
            ),
            processor,
            saved=True,
        )
        conv = normalize_record(_record(True, data), Source(str(d / "r.jsonl"), 1), r.norm)
        image = Image.open(d / "shot.png")
        res[fam] = (out, processor, _reference(processor, r.ctx.messages(conv), data, image))
    return res


@pytest.mark.parametrize("family", FAMILIES)
def test_video_sample_equals_the_processors_output(family, built):
    out, processor, ref = built[family]
    arrays, meta, videos = _read_one(out)
    np.testing.assert_array_equal(arrays["input_ids"], ref["input_ids"][0].numpy())
    np.testing.assert_array_equal(arrays["video_grid_thw"], ref["video_grid_thw"].numpy())
    np.testing.assert_array_equal(arrays["image_grid_thw"], ref["image_grid_thw"].numpy())
    np.testing.assert_array_equal(arrays["mm_token_type_ids"], ref["mm_token_type_ids"][0].numpy())
    assert (arrays["mm_token_type_ids"] == 2).sum() > 0 and meta["num_videos"] == len(CLIPS)
    if family == "qwen2.5-vl":
        np.testing.assert_array_equal(arrays["second_per_grid_ts"], ref["second_per_grid_ts"].numpy())
    # The clip below the minimum frames, and an odd sampled count where the family samples one (Qwen3-VL: 7).
    assert meta["videos"][1]["frames"] < processor.video_processor.min_frames
    if family == "qwen3-vl":
        assert meta["videos"][3]["frames"] == 7 and arrays["video_grid_thw"][3][0] == 4
        assert "seconds>" in processor.tokenizer.decode(arrays["input_ids"].tolist())
    # Pixel values: the stored frames through the processor's own normalize + patchify equal pixel_values_videos.
    _assert_pixels_equal(processor, videos, ref["pixel_values_videos"])
    # Positions: the model's own get_rope_index with the videos.
    kw = {"second_per_grid_ts": ref["second_per_grid_ts"]} if family == "qwen2.5-vl" else {}
    pos, _ = _rope_model(family).get_rope_index(
        ref["input_ids"],
        ref["mm_token_type_ids"],
        image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"],
        **kw,
    )
    np.testing.assert_array_equal(arrays["position_ids"], pos[:, 0].numpy())
    # Masks: only assistant text is trained, never a video or image token.
    mask = arrays["loss_mask"].astype(bool)
    assert not (mask & (arrays["mm_token_type_ids"] != 0)).any()
    trained = processor.tokenizer.decode(arrays["input_ids"][mask].tolist())
    assert "A square crosses each clip." in trained and "Let me look closer." in trained
    assert "What moves" not in trained and "seeked" not in trained


@pytest.mark.slow  # make-test budget; the per-family parity stays in make test
def test_a_frame_list_equals_the_same_frames_in_a_lossless_file(tmp_path):
    """7 frames (odd: the processor pads the last temporal patch) given as PNGs at fps 4, and the same frames as an
    FFV1 (lossless RGB) file sampled at 4 fps: every frame kept both ways, so the samples are identical; both equal
    the processor fed the frames unsampled."""
    from transformers.video_utils import VideoMetadata

    video = frames(7, 64, 48, seed=3)
    ffv1 = encode(video, 4, codec="ffv1", fmt="matroska")
    np.testing.assert_array_equal(decode_all(ffv1)[0], video)  # lossless, so the claim is testable
    as_list = {"type": "video", "video": [_uri(_png(f), "image/png") for f in video], "fps": 4}
    as_file = {"type": "video_url", "video_url": {"url": _uri(ffv1, "video/x-matroska")}, "fps": 4}
    for fam in ("qwen3-vl",):  # timestamps from the frame rate; Qwen2-VL's frame-list path is the same code
        samples = []
        for k, part in enumerate((as_list, as_file)):
            (tmp_path / f"{fam}{k}.jsonl").write_text(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": [part, {"type": "text", "text": "q"}]},
                            {"role": "assistant", "content": "a"},
                        ]
                    }
                )
                + "\n"
            )
            out = tmp_path / f"{fam}-{k}"
            build(
                BuildConfig(
                    inputs=(str(tmp_path / f"{fam}{k}.jsonl"),),
                    out=str(out),
                    processor=f"builtin:{fam}",
                    progress=False,
                )
            )
            samples.append(_read_one(out))
        (a1, m1, v1), (a2, m2, v2) = samples
        for name in a1:
            np.testing.assert_array_equal(a1[name], a2[name])
        np.testing.assert_array_equal(v1[0], v2[0])
        assert m1["videos"][0]["frame_indices"] == list(range(7)) == m2["videos"][0]["frame_indices"]
        assert a1["video_grid_thw"][0][0] == 4
        processor = load_processor(str(tmp_path / f"{fam}-0" / "processor"))
        msgs = [
            {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = processor.apply_chat_template(
                msgs,
                tokenize=True,
                return_dict=True,
                return_tensors="np",
                do_sample_frames=False,
                video_metadata=[VideoMetadata(total_num_frames=7, fps=4.0, frames_indices=list(range(7)))],
            )
        np.testing.assert_array_equal(a1["input_ids"], ref["input_ids"][0])
        np.testing.assert_array_equal(a1["video_grid_thw"], ref["video_grid_thw"])
        _assert_pixels_equal(processor, v1, ref["pixel_values_videos"])


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_video_options_reach_the_processor_and_are_saved(clips, tmp_path):
    """--video-fps / --video-max-frames are set on the saved processor (Qwen3-VL's sample_frames reads max_frames
    only from itself); a part's own fps / max_frames win over them; the sample equals the processor so configured."""
    d, data = clips
    rec = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": _uri(data[2], "video/mp4")}},
                    {"type": "video_url", "video_url": {"url": _uri(data[2], "video/mp4")}, "fps": 1, "max_frames": 4},
                ],
            },
            {"role": "assistant", "content": "a"},
        ]
    }
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n")
    out = tmp_path / "out"
    build(
        BuildConfig(
            inputs=(str(tmp_path / "r.jsonl"),),
            out=str(out),
            processor="builtin:qwen3-vl",
            video_fps=4.0,
            video_max_frames=8,
            progress=False,
        )
    )
    saved = json.loads((out / "processor" / "processor_config.json").read_text())["video_processor"]
    assert saved["fps"] == 4.0 and saved["max_frames"] == 8
    arrays, meta, videos = _read_one(out)
    # 45 frames at 15 fps: 4 fps asks 12, capped at --video-max-frames 8; the part's fps 1 asks 3, min_frames 4.
    assert [v["frames"] for v in meta["videos"]] == [8, 4]
    processor = load_processor(str(out / "processor"))
    f, fps = decode_all(data[2])
    from transformers.video_utils import VideoMetadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = processor.video_processor(
            videos=[f],
            video_metadata=[VideoMetadata(total_num_frames=len(f), fps=fps)],
            do_sample_frames=True,
            return_tensors="pt",
        )
    np.testing.assert_array_equal(arrays["video_grid_thw"][0], ref["video_grid_thw"][0].numpy())


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_truncation_drops_a_video_whole(clips, tmp_path):
    """A --seq-len that ends inside the second video's tokens drops that video whole (tokens, grid row, frames),
    counted in the sample and the manifest; the first video and the text before the cut stay."""
    d, data = clips
    rec = {
        "id": "t",
        "messages": [
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "trained first"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "video_url", "video_url": {"url": _uri(data[0], "video/mp4")}},
                    {"type": "video_url", "video_url": {"url": _uri(data[2], "video/mp4")}},
                ],
            },
            {"role": "assistant", "content": "a"},
        ],
    }
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n")
    full = tmp_path / "full"
    build(BuildConfig(inputs=(str(tmp_path / "r.jsonl"),), out=str(full), progress=False))
    a, m, _ = _read_one(full)
    inside = int(np.flatnonzero(a["mm_token_type_ids"] == 2)[-1])  # the last token of the second video
    cut = tmp_path / "cut"
    res = build(
        BuildConfig(
            inputs=(str(tmp_path / "r.jsonl"),),
            out=str(cut),
            seq_len=inside,
            progress=False,
            long_traces="truncate",
            min_turn_coverage=0.0,
        )
    )  # the cut and its lost turn on purpose
    b, mb, vids = _read_one(cut)
    assert mb["num_videos"] == 1 and mb["dropped_videos"] == 1 and len(vids) == 1
    np.testing.assert_array_equal(b["video_grid_thw"], a["video_grid_thw"][:1])
    assert len(b["input_ids"]) < inside and (b["mm_token_type_ids"] == 2).sum() == a["video_grid_thw"][0].prod() // 4
    np.testing.assert_array_equal(b["input_ids"], a["input_ids"][: len(b["input_ids"])])
    assert res.manifest.totals["videos"] == 1 and res.manifest.totals["dropped_videos"] == 1
    assert res.manifest.format_version == 5
    from vlmprep.shards.summary import format_build_summary
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.stats_text import format_stats

    assert "(0 images and 1 video dropped by the cut)" in format_build_summary(res.manifest, cut)
    assert "0 images and 1 video dropped by the cut" in format_stats(compute_stats(cut))


def test_video_support_is_per_family_and_bad_frames_are_rejects(clips):
    """Families without video support keep the unsupported_video reject (naming those that have it); frames over
    --max-image-pixels are video_too_large; and the trainer refuses a dataset with videos at start-up."""
    from vlmprep.families import FAMILIES, resolve_family
    from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
    from vlmprep.pixels.videos import prepare_video
    from vlmprep.types import RecordError, Source, VideoData

    assert sorted(f.name for f in FAMILIES.values() if f.video) == ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip0.mp4"}]},
            {"role": "assistant", "content": "a"},
        ]
    }
    with pytest.raises(RecordError) as e:
        normalize_record(rec, Source(str(clips[0] / "r.jsonl"), 1), NormalizeOptions())
    assert e.value.reason == "unsupported_video" and "Qwen2-VL, Qwen2.5-VL and Qwen3-VL" in e.value.message
    conv = normalize_record(rec, Source(str(clips[0] / "r.jsonl"), 1), NormalizeOptions(videos=True))
    assert conv.videos[0].data == clips[1][0]
    processor = load_processor("builtin:qwen2-vl")
    with pytest.raises(RecordError) as e:
        prepare_video(
            VideoData(data=clips[1][0], origin="clip0.mp4"), processor, resolve_family(processor), max_pixels=79 * 60
        )
    assert e.value.reason == "video_too_large" and "--max-image-pixels" in e.value.message

    from trainer.data.decode import refuse_videos
    from trainer.data.errors import DataError

    refuse_videos({"totals": {"videos": 0}}, "d")
    refuse_videos({"totals": {"videos": 2}}, "d", "qwen2_vl")  # loss parity verified: tests/trainer/test_video_train.py
    with pytest.raises(DataError, match="holds 2 videos; this trainer trains video samples only for model types"):
        refuse_videos({"totals": {"videos": 2}}, "d", "llava_onevision")


def test_verify_stats_and_inspect_read_a_video_dataset(built):
    """A dataset with videos verifies clean, stats counts videos apart from images, inspect collapses video runs."""
    from typer.testing import CliRunner

    from vlmprep.cli import app
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.verify import verify_dataset

    out = built["qwen3-vl"][0]
    assert verify_dataset(out) == []
    st = compute_stats(out)
    assert (st["videos"], st["images"], st["mismatches"]) == (len(CLIPS), 1, [])
    assert st["video_tokens"] > 0 and st["image_tokens"] > 0
    import tarfile

    stored = sum(
        1
        for p in sorted(out.glob("shard-*.tar"))
        for m in tarfile.open(p).getnames()
        if re.search(r"\.vid\d{3}\.\d{4}\.", m)
    )  # the frame members themselves
    assert st["video_frames"] == stored > len(CLIPS)
    from vlmprep.tools.stats_text import format_stats

    text = format_stats(st)
    assert f"videos             {len(CLIPS)} | frames {stored} | video tokens {st['video_tokens']} (" in text, text
    assert "unread input" not in text
    res = CliRunner().invoke(
        app, ["inspect", str(out), "--html", str(out.parent / "v.html")], env={"COLUMNS": "200", "TERM": "dumb"}
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["inspect", str(out)], env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0 and "[video 1: " in res.stdout and "WARNING" not in res.stdout, res.stdout


PLAIN_ENV = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "TTY_INTERACTIVE": None, "NO_COLOR": None}
VIDEO_MARKER = re.compile(
    r"\[video (\d+): (\d+) of (\d+) frames at ([\d.]+) fps, t = ([^|\]]+) s \| (\d+)x(\d+)x(\d+) "
    r"patches -> (\d+) tokens(?: in (\d+) runs)?\]"
)


def _inspect(*args):
    from typer.testing import CliRunner

    from vlmprep.cli import app

    res = CliRunner().invoke(app, ["inspect", *map(str, args)], env=PLAIN_ENV)
    assert res.exit_code == 0, res.output
    return res.stdout


def _runs(flags):
    f = np.concatenate([[0], np.asarray(flags, dtype=np.int8), [0]])
    d = np.diff(f)
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_inspect_shows_each_video_as_one_block_with_frame_times(family, built):
    """The terminal view: one marker per video (Qwen3-VL's per-temporal-patch runs and the timestamp text between them
    folded into it) naming its stored frame count, the source's frames and fps, each frame's time (source index / fps)
    and its grid and tokens; the trained markup is exactly the loss mask; --tokens still lists every text token
    (Qwen3-VL's timestamps) with each placeholder run as one row."""
    out, processor, _ = built[family]
    arrays, meta, _ = _read_one(out)
    text = _inspect(out)
    assert "WARNING" not in text
    markers = VIDEO_MARKER.findall(text)
    assert len(markers) == len(meta["videos"]) == len(CLIPS)
    for k, (m, v, grid) in enumerate(zip(markers, meta["videos"], arrays["video_grid_thw"])):
        n, frames, total, fps, ts, t, h, w, tokens, runs = m
        assert (int(n), int(frames), int(total), float(fps)) == (k + 1, v["frames"], v["total_num_frames"], v["fps"])
        assert ts.split(", ") == [f"{i / v['fps']:.2f}" for i in v["frame_indices"]]
        assert [int(t), int(h), int(w)] == grid.tolist() and int(tokens) == grid.prod() // 4
        assert runs == (str(grid[0]) if family == "qwen3-vl" and grid[0] > 1 else "")
    tok = processor.tokenizer
    mask = arrays["loss_mask"]
    want = [tok.decode(arrays["input_ids"][a:b].tolist(), skip_special_tokens=False) for a, b in _runs(mask)]
    assert re.findall(r"\[T\](.*?)\[/T\]", text, flags=re.S) == want
    # The token table: every token not a placeholder is its own row; each placeholder run one row.
    types = arrays["mm_token_type_ids"]
    video_runs, image_runs = _runs(types == 2), _runs(types == 1)
    assert len(video_runs) == (int(arrays["video_grid_thw"][:, 0].sum()) if family == "qwen3-vl" else len(CLIPS))
    rows = [
        line.split(None, 4)
        for line in _inspect(out, "--tokens").splitlines()
        if re.match(r"^\s*\d+(-\d+)?\s+\d+\s+[01]\s+[012]\s", line)
    ]
    assert [r[0] for r in rows if r[3] == "2"] == [f"{a}-{b - 1}" for a, b in video_runs]
    # an image's row is its whole unit: its placeholders and the two wrappers around them
    assert len(rows) == len(types) - int((types != 0).sum()) - 2 * len(image_runs) + len(video_runs) + len(image_runs)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_inspect_html_shows_each_videos_stored_frames_with_their_times(family, built, tmp_path):
    """The HTML report: per video one block holding one data-URI <img> per stored frame, in order, each labelled with
    its time in the source (source frame index / fps); the image keeps its thumbnail; everything is escaped (only
    the report's own tags appear, the hover naming Qwen3-VL's timestamp text as escaped text)."""
    from html.parser import HTMLParser

    out, _, _ = built[family]
    arrays, meta, videos = _read_one(out)
    page = tmp_path / "r.html"
    _inspect(out, "--html", page)

    class Collect(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.imgs, self.stack, self.labels, self.titles = set(), [], [], [], []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            self.tags.add(tag)
            if tag == "img":
                self.imgs.append(a)
            if tag == "span" and a.get("class") == "im vid":
                self.titles.append(a["title"])
            if tag != "img":
                self.stack.append(a.get("class"))

        def handle_endtag(self, tag):
            if tag != "img":
                self.stack.pop()

        def handle_data(self, data):
            if self.stack and self.stack[-1] == "fr":
                self.labels.append(data)

    c = Collect()
    c.feed(page.read_text(encoding="utf-8"))
    assert c.tags <= {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "h1",
        "h2",
        "small",
        "div",
        "span",
        "table",
        "tr",
        "th",
        "td",
        "a",
        "img",
        "ul",
        "li",
        "section",
        "details",
        "summary",
    }
    frames = [a for a in c.imgs if a["alt"].startswith("video ")]
    want = [
        f"video {k + 1} frame {f + 1} at {i / v['fps']:.2f} s"
        for k, v in enumerate(meta["videos"])
        for f, i in enumerate(v["frame_indices"])
    ]
    assert [a["alt"] for a in frames] == want and len(want) == sum(len(v) for v in videos)
    assert c.labels == [w.rsplit(" at ", 1)[1] for w in want]
    for a, pixels in zip(frames, [f for v in videos for f in v]):
        assert a["src"].startswith("data:image/png;base64,")
        im = Image.open(io.BytesIO(base64.b64decode(a["src"].split(",", 1)[1])))
        assert max(im.size) <= 128 and im.size[0] / im.size[1] == pytest.approx(
            pixels.shape[1] / pixels.shape[0], rel=0.05
        )
    assert [a["alt"] for a in c.imgs if not a["alt"].startswith("video ")] == ["image 1"]
    assert len(c.titles) == len(CLIPS)
    if family == "qwen3-vl":
        assert all("seconds>" in t for t, g in zip(c.titles, arrays["video_grid_thw"]) if g[0] > 1)
        assert not re.search(r"<\d", page.read_text(encoding="utf-8"))  # "<0.3 seconds>" only ever as &lt;0.3


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_inspect_raw_video_input_gives_the_shards_view(built, clips):
    """Raw input rendered with the dataset's processor and options shows the same video blocks as the shard."""
    out, _, _ = built["qwen3-vl"]
    d, _ = clips
    strip = lambda s: re.sub(r"^(=== sample \d{10}  id .*)  \(.*\) ===$", r"\1", s, flags=re.M)  # noqa: E731
    raw = _inspect(d / "r.jsonl", "--like", out)
    assert "(rendered from input)" in raw and VIDEO_MARKER.search(raw)
    assert strip(raw) == strip(_inspect(out))


@pytest.mark.slow  # ~50 s on 2 cores: two builds, one through a worker pool
def test_video_builds_are_byte_identical_for_any_worker_count(clips, tmp_path):
    """Decode, sampling, resize and frame encoding are deterministic: --workers 1 and 2 write the same shard bytes."""
    d, data = clips
    (d / "two.jsonl").write_text("".join(json.dumps({**_record(k == 0, data), "id": f"v{k}"}) + "\n" for k in range(2)))
    shas = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        res = build(
            BuildConfig(
                inputs=(str(d / "two.jsonl"),),
                out=str(out),
                processor="builtin:qwen2.5-vl",
                seq_len=32768,
                tool_calls="train-content",
                workers=workers,
                progress=False,
            )
        )
        shas.append([(s.name, s.sha256) for s in res.manifest.shards])
    assert shas[0] == shas[1] and res.manifest.totals["videos"] == 2 * len(CLIPS)


def test_verify_catches_a_missing_frame_and_a_wrong_video_grid(built, tmp_path):
    """A frame member removed, or a video grid row changed, is a named violation (verify reads format v3)."""
    import shutil

    from vlmprep.tools.verify import verify_dataset

    src = built["qwen2-vl"][0]
    for fault in ("drop_frame", "grid"):
        d = tmp_path / fault
        shutil.copytree(src, d)
        [shard] = sorted(d.glob("shard-*.tar"))
        with tarfile.open(shard) as tf:
            members = [(m, tf.extractfile(m).read()) for m in tf]
        with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
            for m, b in members:
                if fault == "drop_frame" and m.name.endswith(".vid002.0001.delta.zst"):
                    continue
                if fault == "grid" and m.name.endswith(".video_grid_thw.npy"):
                    g = np.load(io.BytesIO(b))
                    g[0, 1] += 2
                    buf = io.BytesIO()
                    np.save(buf, g)
                    b = buf.getvalue()
                    m.size = len(b)
                tf.addfile(m, io.BytesIO(b))
        manifest = json.loads((d / "manifest.json").read_text())  # the shard-level checks pass: reach the samples
        manifest["shards"][0].update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
        (d / "manifest.json").write_text(json.dumps(manifest))
        found = " | ".join(str(v) for v in verify_dataset(d))
        if fault == "drop_frame":
            assert "video 2: 5 frame members, meta says 6 frames" in found, found
        else:
            assert "video placeholders, video_grid_thw rows need" in found and "video 0: frames of" in found


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_the_trainer_refuses_a_video_dataset_at_start_up(built, tmp_path):
    """For a model type whose video training is not verified (here llava_onevision, from a checkpoint dir's
    config.json), a dataset with videos stops `python -m trainer` before anything runs: exit 1, one line naming the
    dataset and why (manifest totals), no run dir."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llava_onevision"}')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--data",
            str(built["qwen3-vl"][0]),
            "--out",
            str(tmp_path / "run"),
            "--model",
            str(tmp_path / "ckpt"),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"holds {len(CLIPS)} videos; this trainer trains video samples only" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=() if f == "qwen2-vl" else pytest.mark.slow) for f in FAMILIES]
)  # make-test budget: Qwen2-VL's was the broken one
@pytest.mark.parametrize("video_fps", [None, pytest.param(5.0, marks=pytest.mark.slow)])
def test_the_saved_processor_samples_a_source_video_as_the_build_did(family, video_fps, tmp_path):
    """A 2.3 s clip is stored sampled at --video-fps (else the processor's fps, else 2): the dataset's saved
    processor (what `python -m trainer export` ships) carries that sampling, so its own apply_chat_template on the
    source video (decoded by transformers' own PyAV loader, no sampling option passed) gives the shard's tokens."""
    from transformers.video_utils import load_video

    (tmp_path / "clip.mp4").write_bytes(encode(frames(23, 64, 48, seed=5), 10))
    content = [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What moves?"}]
    (tmp_path / "r.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A square."}]})
        + "\n"
    )
    out = tmp_path / "out"
    build(
        BuildConfig(
            inputs=(str(tmp_path / "r.jsonl"),),
            out=str(out),
            processor=f"builtin:{family}",
            video_fps=video_fps,
            progress=False,
        )
    )
    arrays, meta, _ = _read_one(out)
    # Sampled, not every frame kept: 2.3 s at 2 fps is 4 frames (the processor's min_frames), at 5 fps 10 or 11.
    assert meta["videos"][0]["frames"] in ({4} if video_fps is None else {10, 11})
    saved = json.loads((out / "processor" / "processor_config.json").read_text())["video_processor"]
    assert saved["do_sample_frames"] is True and saved["fps"] == (video_fps or 2.0)
    processor = load_processor(str(out / "processor"))
    clip, metadata = load_video(str(tmp_path / "clip.mp4"), backend="pyav")
    msgs = [
        {"role": "user", "content": [{"type": "video", "video": clip}, content[1]]},
        {"role": "assistant", "content": "A square."},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = processor.apply_chat_template(
            msgs, tokenize=True, return_dict=True, return_tensors="np", video_metadata=[metadata]
        )
    np.testing.assert_array_equal(arrays["input_ids"], ref["input_ids"][0])
    np.testing.assert_array_equal(arrays["video_grid_thw"], ref["video_grid_thw"])


def test_a_frame_list_mixing_image_modes_is_made_rgb_frame_by_frame():
    """RGB, RGBA (alpha laid on white, as the processor makes an image RGB), gray, palette and gray+alpha frames in
    one list: stored exactly as the same frames given as RGB; before, a gray+alpha frame (and any partly clear one)
    was an internal error and a palette frame's indices were read as gray levels."""
    from vlmprep.families import resolve_family
    from vlmprep.pixels.videos import prepare_video
    from vlmprep.types import ImageData, VideoData

    rgb = frames(6, 40, 30, seed=2)
    alpha = np.where(np.arange(40)[None, :] < 20, 0, 255).astype(np.uint8).repeat(30, 0)  # clear / opaque halves
    on_white = rgb[1].copy()
    on_white[alpha == 0] = 255
    palette = Image.fromarray(rgb[3]).quantize(16)
    as_modes = [
        Image.fromarray(rgb[0]),
        Image.fromarray(np.dstack([rgb[1], alpha]), "RGBA"),
        Image.fromarray(rgb[2]).convert("L"),
        palette,
        Image.fromarray(rgb[4]).convert("LA"),
        Image.fromarray(rgb[5]),
    ]
    as_rgb = [
        rgb[0],
        on_white,
        np.asarray(as_modes[2].convert("RGB")),
        np.asarray(palette.convert("RGB")),
        np.asarray(as_modes[4].convert("RGB")),
        rgb[5],
    ]
    processor = load_processor("builtin:qwen2-vl")

    def prepared(images):
        video = VideoData(
            frames=tuple(
                ImageData(data=_png(im) if isinstance(im, np.ndarray) else _png_of(im), origin=f"f{k}")
                for k, im in enumerate(images)
            ),
            origin="frames",
        )
        return prepare_video(video, processor, resolve_family(processor), max_pixels=1 << 24, min_side=4).frames

    np.testing.assert_array_equal(prepared(as_modes), prepared(as_rgb))


def _png_of(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow  # two builds; in make test: the normalized parts equal (test_normalize.py) and the corpus case
def test_llamafactory_video_records_build_as_the_same_videos(clips, tmp_path):
    """LLaMA-Factory's video layout (`"videos": ["clip0.mp4"]`, `<video>` in the user text, as its mllm_video_demo)
    builds the very sample of the OpenAI layout's video part, which equals the processor's own render (above):
    the video is read, never dropped with `<video>` trained as text."""
    d, _ = clips
    question = "Why is this video funny?"
    layouts = {
        "llamafactory": {
            "messages": [
                {"role": "user", "content": f"<video>{question}"},
                {"role": "assistant", "content": "A square crosses it."},
            ],
            "videos": ["clip0.mp4"],
        },
        "openai": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "video", "video": "clip0.mp4"}, {"type": "text", "text": question}],
                },
                {"role": "assistant", "content": "A square crosses it."},
            ]
        },
    }
    samples = {}
    for name, rec in layouts.items():
        (d / f"{name}.jsonl").write_text(json.dumps({"id": "v", **rec}) + "\n")
        build(
            BuildConfig(
                inputs=(str(d / f"{name}.jsonl"),),
                out=str(tmp_path / name),
                processor="builtin:qwen2-vl",
                progress=False,
            )
        )
        samples[name] = _read_one(tmp_path / name)
    (a, ma, va), (b, mb, vb) = samples["llamafactory"], samples["openai"]
    assert ma["num_videos"] == 1 and set(a) == set(b) and {**ma, "source": None} == {**mb, "source": None}
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    np.testing.assert_array_equal(va[0], vb[0])
    assert "<video>" not in load_processor("builtin:qwen2-vl").tokenizer.decode(a["input_ids"].tolist())


# What docs/performance.md states for every process of a build (and what the video benchmark row measures).
PEAK_RSS_MB = 1536


@pytest.mark.slow  # three `vlmprep build --workers 2` processes (~30 s each on 2 cores, mostly imports)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_process_of_a_small_video_build_stays_under_the_documented_peak(family, tmp_path):
    """`vlmprep build --workers 2` of four 2.3 s clips: the main process (processor load, plan, merge) and each
    worker (forked from it), each one's own VmHWM, stay under the figure docs/performance.md states."""
    import os
    import sys
    from pathlib import Path

    from tests.support.memory import peak_rss

    root = Path(__file__).resolve().parents[2]
    assert f"under {PEAK_RSS_MB / 1024:g} GiB" in (root / "docs" / "performance.md").read_text()
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(4):
            (tmp_path / f"clip{i}.mp4").write_bytes(encode(frames(23, 160, 90, seed=i), 10))
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "video", "video": f"clip{i}.mp4"}, {"type": "text", "text": "?"}],
                            },
                            {"role": "assistant", "content": f"clip {i}"},
                        ]
                    }
                )
                + "\n"
            )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    rc, err, peaks = peak_rss(
        [
            sys.executable,
            "-m",
            "vlmprep",
            "build",
            "--in",
            str(tmp_path / "in.jsonl"),
            "--out",
            str(tmp_path / "out"),
            "--processor",
            f"builtin:{family}",
            "--workers",
            "2",
            "--no-progress",
        ],
        env=env,
    )
    assert rc == 0, err
    roles = sorted(p.role for p in peaks)
    assert roles.count("main") == 1 and roles.count("worker") == 2, peaks
    over = [p for p in peaks if p.peak_mb >= PEAK_RSS_MB]
    assert not over, over


def test_a_split_step_keeps_the_video_and_image_it_answers(clips, tmp_path):
    """A trace that does not fit --seq-len, split in two: the sample that trains the last answer holds the message it
    answers (a video, an image and "and now?"), not only the task."""
    from vlmprep.shards.reader import iter_dataset

    d, data = clips
    image = {"type": "image_url", "image_url": {"url": _uri((d / "shot.png").read_bytes(), "image/png")}}
    rec = {
        "id": "s",
        "messages": [
            {"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]},
            {"role": "assistant", "content": "A square on a gradient, moving slowly to the right."},
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": _uri(data[0], "video/mp4")}},
                    image,
                    {"type": "text", "text": "and now?"},
                ],
            },
            {"role": "assistant", "content": "A video and a picture."},
        ],
    }
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n")
    whole = build(BuildConfig(inputs=(str(tmp_path / "r.jsonl"),), out=str(tmp_path / "whole"), progress=False))
    total = whole.manifest.totals["tokens"]
    res = build(
        BuildConfig(inputs=(str(tmp_path / "r.jsonl"),), out=str(tmp_path / "split"), seq_len=total - 4, progress=False)
    )
    assert res.manifest.totals["split_samples"] == 2 and res.manifest.turns["coverage"] == 1.0
    last = [s for s in iter_dataset(tmp_path / "split") if 3 in s.meta()["trains"]]
    [sample] = last
    assert sample.meta()["messages"] == [0, 2, 3]
    assert sample.meta()["num_videos"] == 1 and sample.meta()["num_images"] == 2
    assert (sample.array("mm_token_type_ids") == 2).any()
    # One token less and the answer cannot fit with what it answers: it is lost loudly, never trained on the task alone.
    res = build(
        BuildConfig(
            inputs=(str(tmp_path / "r.jsonl"),),
            out=str(tmp_path / "lost"),
            seq_len=sample.meta()["num_tokens"] - 1,
            progress=False,
            min_turn_coverage=0.0,
        )
    )
    assert [s.meta()["trains"] for s in iter_dataset(tmp_path / "lost")] == [[1]]
    assert res.manifest.turns["lost"]["turn_too_long"] == 1 and res.manifest.turns["coverage"] == 0.5
    [reject] = [json.loads(line) for line in (tmp_path / "lost" / "rejects.jsonl").read_text().splitlines()]
    assert reject["reason"] == "turn_too_long" and reject["message"].startswith("messages[3]: ")


@pytest.mark.parametrize("mode", ["split", "truncate"])
def test_a_video_longer_than_seq_len_in_a_later_turn_costs_that_turn_not_the_record(clips, tmp_path, mode):
    """Turn 1 (an image and a question) fits; turn 2's video alone does not fit --seq-len: the record lands with turn
    1 trained, and turn 2 is lost loudly (split) or the video cut with it (truncate), as an image there would be.
    Before: the whole record was rejected as video_too_long. A video before the first answer still is (nothing could
    train)."""
    from vlmprep.shards.reader import iter_dataset

    d, data = clips
    image = {"type": "image_url", "image_url": {"url": _uri((d / "shot.png").read_bytes(), "image/png")}}
    video = {"type": "video_url", "video_url": {"url": _uri(data[0], "video/mp4")}}
    turn1 = [
        {"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "A square on a gradient."},
    ]
    rec = {
        "id": "v",
        "messages": turn1
        + [
            {"role": "user", "content": [video, {"type": "text", "text": "and now?"}]},
            {"role": "assistant", "content": "A video."},
        ],
    }
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n")
    whole = build(BuildConfig(inputs=(str(tmp_path / "r.jsonl"),), out=str(tmp_path / "whole"), progress=False))
    [s] = iter_dataset(tmp_path / "whole")
    video_tokens = int((s.array("mm_token_type_ids") == 2).sum())
    first = build(
        BuildConfig(
            inputs=(str(tmp_path / "r.jsonl"),),
            out=str(tmp_path / "first"),
            progress=False,
            seq_len=video_tokens - 1,
            long_traces=mode,
            min_turn_coverage=0.0,
        )
    )
    samples = list(iter_dataset(tmp_path / "first"))
    assert whole.manifest.rejects == {} and first.manifest.totals["records"] == 1
    assert [x.meta()["trains"] for x in samples] == [[1]] and not (samples[0].array("mm_token_type_ids") == 2).any()
    assert first.manifest.rejects == ({"turn_too_long": 1} if mode == "split" else {})
    assert first.manifest.turns["trained_assistant_turns"] == 1
    (tmp_path / "early.jsonl").write_text(
        json.dumps(
            {
                "id": "e",
                "messages": [
                    {"role": "user", "content": [video, {"type": "text", "text": "?"}]},
                    {"role": "assistant", "content": "A video."},
                ],
            }
        )
        + "\n"
    )
    early = build(
        BuildConfig(
            inputs=(str(tmp_path / "early.jsonl"),),
            out=str(tmp_path / "early"),
            progress=False,
            seq_len=video_tokens - 1,
            long_traces=mode,
            min_turn_coverage=0.0,
            max_reject_fraction=1.0,
            allow_empty=True,
        )
    )
    assert early.manifest.rejects == {"video_too_long": 1}
