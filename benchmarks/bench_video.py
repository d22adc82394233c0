"""Video benchmark: `vlmprep build` seconds and shard bytes per second of source video, per Qwen family, on H.264
clips made here with PyAV (a moving pattern: every frame differs), sampled at the processor's default rate; and the
peak resident memory of each process of a `vlmprep build --workers 2` of the same clips (main, workers)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.emit import emit
from benchmarks.inputs import OUT


def run(quick: bool) -> list[dict]:
    import av  # noqa: F401 - fail early with the import error if PyAV is missing

    from tests.support.videos import encode, frames
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    n, seconds, fps, (w, h) = (2, 2, 10, (160, 90)) if quick else (8, 10, 30, (640, 360))
    d = OUT / "video"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    with open(d / "in.jsonl", "w") as f:
        for i in range(n):
            (d / f"clip{i}.mp4").write_bytes(encode(frames(seconds * fps, w, h, seed=i), fps, codec="libx264"))
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
    rows = []
    for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        out = d / f"out-{family}"
        t0 = time.perf_counter()
        res = build(
            BuildConfig(
                inputs=(str(d / "in.jsonl"),),
                out=str(out),
                processor=f"builtin:{family}",
                seq_len=32768,
                progress=False,
            )
        )
        t = time.perf_counter() - t0
        video_s = n * seconds
        shard_bytes = sum(s.bytes for s in res.manifest.shards)
        rows.append(
            emit(
                "video",
                family=family,
                clips=n,
                clip_seconds=seconds,
                fps=fps,
                width=w,
                height=h,
                build_s=round(t, 2),
                build_s_per_video_s=round(t / video_s, 3),
                shard_bytes_per_video_s=round(shard_bytes / video_s),
                video_tokens=res.manifest.totals["video_tokens"],
            )
        )
    rows += peak_rss_rows(d, ("qwen2-vl",) if quick else ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"))
    return rows


def peak_rss_rows(d: Path, families) -> list[dict]:
    """Each process's own VmHWM through a CLI build with 2 workers (tests/support/memory.py polls the process tree)."""
    from tests.support.memory import peak_rss

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for family in families:
        rc, err, peaks = peak_rss(
            [
                sys.executable,
                "-m",
                "vlmprep",
                "build",
                "--in",
                str(d / "in.jsonl"),
                "--out",
                str(d / f"rss-{family}"),
                "--processor",
                f"builtin:{family}",
                "--workers",
                "2",
                "--seq-len",
                "32768",
                "--no-progress",
            ],
            env=env,
        )
        assert rc == 0, err[-2000:]
        fields = {}
        for role in ("main", "forkserver", "worker"):
            mine = [p for p in peaks if p.role == role]
            fields[f"{role}_rss_mb"] = round(max((p.peak_mb for p in mine), default=0.0))
            fields[f"{role}_file_mb"] = round(max((p.rss_file_mb for p in mine), default=0.0))
        rows.append(emit("video", metric="peak_rss", family=family, workers=2, **fields, goal_mb=1536))
    return rows
