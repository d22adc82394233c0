"""Benchmark inputs: seeded demo agent traces cached under bench-out/, so every benchmark measures the same
records and reruns skip the (PNG-bound) generation."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import zstandard

from scripts.demo_traces import write_traces

OUT = Path("bench-out")
# LLaMA-Factory's multimodal demo (6 short chats, 1-2 small JPEGs each): the short-record shape
DEMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_traces" / "llamafactory_mllm_demo.jsonl"
_DATA_URI = re.compile(rb'"data:image/[a-z]+;base64,([A-Za-z0-9+/=]+)"')


def traces(
    n: int,
    *,
    width: int = 1280,
    height: int = 720,
    min_images: int = 2,
    max_images: int = 25,
    seed: int = 0,
    overlong_fraction: float = 0.03,
    text_only_fraction: float = 0.05,
) -> Path:
    name = (
        f"traces-n{n}-{width}x{height}-i{min_images}-{max_images}-s{seed}-o{overlong_fraction}"
        f"-t{text_only_fraction}.jsonl.zst"
    )
    path = OUT / "inputs" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_traces(
            path,
            n=n,
            seed=seed,
            width=width,
            height=height,
            min_images=min_images,
            max_images=max_images,
            overlong_fraction=overlong_fraction,
            text_only_fraction=text_only_fraction,
        )
    return path


def vqa_demo(copies: int) -> list[dict]:
    """The demo's records `copies` times over, ids made unique; [] where ../shared/data is absent."""
    if not DEMO.is_file():
        return []
    demo = [json.loads(line) for line in DEMO.read_text().splitlines()]
    return [{**r, "id": f"{r['id']}#{k}"} for k in range(copies) for r in demo]


def jsonl_zst(recs: list[dict], path: Path) -> Path:
    """Records as a .jsonl.zst file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    return path


def decoded_input_bytes(path: Path) -> int:
    """Input size with every base64 image counted at its decoded size (what the images really weigh)."""
    total = 0
    with open(path, "rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f)
        buf = b""
        while chunk := reader.read(1 << 22):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                total += _line_bytes(line) + 1
        if buf:
            total += _line_bytes(buf)
    return total


def _line_bytes(line: bytes) -> int:
    n = len(line)
    for m in _DATA_URI.finditer(line):
        b64 = m.group(1)
        n += len(base64.b64decode(b64)) - len(b64)
    return n


def records(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read()
    return [json.loads(line) for line in data.splitlines() if line.strip()]
