"""Fixtures for planned builds (test_tasks.py, test_ray.py): one small trace file with a bad line and an id repeated
across tasks, its one-task build, and its 3-task build by the local pool (the reference every executor must equal)."""

import hashlib
from pathlib import Path

import pytest

from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.shards.format import FORMAT_VERSION
from vlmprep.shards.manifest import Manifest, SavedProcessor

ROOT = Path(__file__).resolve().parents[2]
TOOLS = str(ROOT / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")
# Bad lines (and their lost turns) on purpose; Qwen2-VL's classes over a small vocabulary (tiny:): these builds test
# the plan, tasks, merge and stores, and each task's process loads its processor fast.
OPTS = dict(
    processor="tiny:qwen2-vl",
    seq_len=2048,
    samples_per_shard=2,
    chat_template=TOOLS,
    max_reject_fraction=1.0,
    min_turn_coverage=0.0,
)


def planned_cfg(inp, out, **kw):
    return BuildConfig(inputs=(str(inp),), out=str(out), progress=False, **{**OPTS, **kw})


def a_manifest(*, spec: str = "some/dir", **given) -> Manifest:
    """A Manifest for the summary and check functions: the fields a test gives, the rest empty."""
    processor = SavedProcessor(spec=spec, class_name="Qwen2VLProcessor", fingerprint="0" * 64, dir="processor")
    return Manifest(
        **{
            "format_version": FORMAT_VERSION,
            "vlmprep_version": "0",
            "processor": processor,
            "config": {},
            "image_format": "zstd",
            "inputs": (),
            "shards": (),
            "totals": {},
            "rejects": {},
            **given,
        }
    )


def tree_hashes(d: Path) -> dict:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="session")
def task_traces(tmp_path_factory):
    import zstandard

    from scripts.demo_traces import write_traces

    d = tmp_path_factory.mktemp("tasks")
    write_traces(
        d / "t.jsonl.zst",
        n=14,
        seed=3,
        min_images=1,
        max_images=3,
        width=320,
        height=200,
        overlong_fraction=0.1,
        text_only_fraction=0.1,
    )
    raw = zstandard.ZstdDecompressor().decompress((d / "t.jsonl.zst").read_bytes(), max_output_size=1 << 30)
    lines = raw.splitlines(keepends=True)
    p = d / "traces.jsonl"
    lines.insert(5, b"{broken json\n")  # a reject in task 0 or 1: rejects.jsonl must merge in plan order
    lines.append(lines[9])  # the same id again in the last task: only merge can see it
    p.write_bytes(b"".join(lines))
    return p


@pytest.fixture(scope="session")
def single(task_traces, tmp_path_factory, qwen2vl_processor):
    out = tmp_path_factory.mktemp("single") / "ds"
    build(planned_cfg(task_traces, out))
    return out


@pytest.fixture(scope="session")
def local3(task_traces, tmp_path_factory, qwen2vl_processor):
    out = tmp_path_factory.mktemp("local3") / "ds"
    res = build(planned_cfg(task_traces, out, tasks=3, workers=2))
    return out, res


# Client video datasets (test_clients.py, test_collator.py): clips (frames, fps, width, height) of an odd and an even
# sampled frame count, and records with a video, an image, text only, and two videos around an image. Small per-part
# pixel bounds keep the tiny models' forwards fast (the processors' own minimum is 100k pixels a frame).
VIDEO_CLIPS = [(9, 4, 64, 48), (6, 2, 84, 56)]


def video_records() -> list[dict]:
    user = lambda *parts: {"role": "user", "content": list(parts)}  # noqa: E731

    def video(k: int) -> dict:
        return {"type": "video", "video": f"c{k}.mp4", "min_pixels": 56 * 56, "max_pixels": 112 * 112}

    image = {"type": "image_url", "image_url": {"url": "s.png"}}
    return [
        {
            "id": "v",
            "messages": [
                user(video(0), {"type": "text", "text": "what moves"}),
                {"role": "assistant", "content": "a square"},
            ],
        },
        {
            "id": "i",
            "messages": [
                user(image, {"type": "text", "text": "what is it"}),
                {"role": "assistant", "content": "a picture"},
            ],
        },
        {"id": "t", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {
            "id": "vi",
            "messages": [
                user(video(1), image, video(0), {"type": "text", "text": "all"}),
                {"role": "assistant", "content": "two clips and a picture"},
            ],
        },
    ]


@pytest.fixture(scope="session")
def video_dataset(tmp_path_factory):
    """(family, image_format) -> a built 4-sample dataset dir with videos (2 shards), built once per session."""
    import json

    from PIL import Image

    from tests.support.videos import encode, frames

    d = tmp_path_factory.mktemp("client-videos")
    for k, (n, fps, w, h) in enumerate(VIDEO_CLIPS):
        (d / f"c{k}.mp4").write_bytes(encode(frames(n, w, h, seed=k), fps))
    Image.fromarray(frames(1, 60, 40, seed=7)[0]).save(d / "s.png")
    (d / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in video_records()))
    built: dict[tuple[str, str], Path] = {}

    def get(family: str = "qwen2-vl", image_format: str = "zstd") -> Path:
        if (family, image_format) not in built:
            out = d / f"{family}-{image_format}"
            build(
                BuildConfig(
                    inputs=(str(d / "r.jsonl"),),
                    out=str(out),
                    processor=f"builtin:{family}",
                    seq_len=8192,
                    samples_per_shard=2,
                    image_format=image_format,
                    progress=False,
                )
            )
            built[family, image_format] = out
        return built[family, image_format]

    return get
