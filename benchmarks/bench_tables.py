"""Table ingest benchmark: the same records as `.jsonl.zst` (images as data URIs) and as Parquet (images as bytes
cells), built with one worker back to back in this process: records/s of each and their ratio (goal: Parquet >= 1.0x
the JSONL). Two record shapes: short VQA records (LLaMA-Factory's demo, in the TRL layout: a few small JPEGs each) and
the demo agent traces (OpenAI layout, `messages` as a JSON string column)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import zstandard

from benchmarks.bench_build import timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, records, traces

GOAL = 1.0
DEMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "real_traces" / "llamafactory_mllm_demo.jsonl"


def _jsonl_zst(recs: list[dict], path: Path) -> Path:
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    return path


def _trl(r: dict) -> dict:
    images, msgs = [], []
    for m in r["messages"]:
        content = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        parts = []
        for p in content:
            if p["type"] == "image_url":
                images.append({"bytes": base64.b64decode(p["image_url"]["url"].split(",", 1)[1]), "path": None})
                parts.append({"type": "image", "text": None})
            else:
                parts.append({"type": "text", "text": p["text"]})
        msgs.append({"role": m["role"], "content": parts})
    return {"id": r["id"], "messages": msgs, "images": images}


def _parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=256)
    return path


def run(quick: bool) -> list[dict]:
    d = OUT / "tables"
    d.mkdir(parents=True, exist_ok=True)
    shapes = []
    if DEMO.is_file():
        demo = [json.loads(line) for line in DEMO.read_text().splitlines()]
        vqa = [{**r, "id": f"{r['id']}#{k}"} for k in range(2 if quick else 100) for r in demo]
        shapes.append(("vqa_trl", vqa, [_trl(r) for r in vqa], {}))
    agent = records(traces(4 if quick else 64, width=640, height=400))
    shapes.append(("agent_oai_json", agent, [{"id": r["id"], "messages": json.dumps(r["messages"]),
                                               "tools": json.dumps(r["tools"]) if "tools" in r else None}
                                              for r in agent], {}))
    rows = []
    for shape, recs, table_rows, kw in shapes:
        jsonl = _jsonl_zst(recs, d / f"{shape}.jsonl.zst")
        table = _parquet(table_rows, d / f"{shape}.parquet")
        seconds = {}
        for name, inp in (("jsonl_zst", jsonl), ("parquet", table)):
            seconds[name], m = timed_build(inp, d / f"out-{shape}-{name}", workers=1, **kw)
            assert m["totals"]["records"] == len(recs)
        rate = {k: len(recs) / v for k, v in seconds.items()}
        rows.append(emit("tables", metric="ingest", shape=shape, records=len(recs),
                         jsonl_zst_records_per_s=round(rate["jsonl_zst"], 1),
                         parquet_records_per_s=round(rate["parquet"], 1),
                         ratio=round(rate["parquet"] / rate["jsonl_zst"], 3), goal=GOAL,
                         input_mb={"jsonl_zst": round(jsonl.stat().st_size / 1e6, 1),
                                   "parquet": round(table.stat().st_size / 1e6, 1)}))
    return rows


if __name__ == "__main__":
    run(False)
