"""`make bench-peers` harness, the parts that run without the peers' venvs: the records in each peer's format carry
the same turns, text and images as the trace they came from, and each tool is asked for the same length and pixels;
in `make test-all`, the harness's own quick run measures vlmprep (no peer installed)."""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import convert
from benchmarks.peers.__main__ import command
from scripts.demo_traces import write_traces
from tests.conftest import LLAMAFACTORY


def _traces(tmp_path, n=4):
    import zstandard

    src = tmp_path / "t.jsonl.zst"
    write_traces(
        src,
        n=n,
        seed=3,
        width=160,
        height=64,
        min_images=2,
        max_images=4,
        overlong_fraction=0.0,
        text_only_fraction=0.0,
    )
    data = zstandard.ZstdDecompressor().stream_reader(open(src, "rb")).read()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _source_images(rec):
    out = []
    for m in rec["messages"]:
        for p in m["content"] if isinstance(m.get("content"), list) else []:
            if p["type"] == "image_url":
                url = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                out.append(base64.b64decode(url.split(",", 1)[1]))
    return out


def test_traces_in_both_peer_formats_keep_images_turns_and_tool_calls(tmp_path):
    recs = _traces(tmp_path)
    d = convert.write_traces(recs, tmp_path / "out")
    lf = json.loads((d["llamafactory"] / "data.json").read_text())
    sw = [json.loads(line) for line in d["swift"].read_text().splitlines()]
    info = json.loads((d["llamafactory"] / "dataset_info.json").read_text())["bench"]
    assert info["formatting"] == "sharegpt" and info["columns"]["tools"] == "tools"
    assert len(lf) == len(sw) == len(recs) == d["records"]
    for rec, a, b in zip(recs, lf, sw):
        src = _source_images(rec)
        assert src and [Path(p).read_bytes() for p in a["images"]] == src and a["images"] == b["images"]
        for msgs in (a["messages"], b["messages"]):
            assert sum(m["content"].count("<image>") for m in msgs) == len(src)
        # LLaMA-Factory's ShareGPT order: system, then user/observation and assistant/function_call alternating.
        roles = [m["role"] for m in a["messages"]]
        assert roles[0] == "system" and len(roles) % 2 == 1
        assert all(r in ("user", "observation") for r in roles[1::2])
        assert all(r in ("assistant", "function_call") for r in roles[2::2])
        calls = [c for m in rec["messages"] for c in m.get("tool_calls") or []]
        lf_calls = [
            json.loads(m["content"].split("</think>")[-1]) for m in a["messages"] if m["role"] == "function_call"
        ]
        assert [c["function"]["name"] for c in calls] == [c["name"] for c in lf_calls]
        sw_calls = [c for m in b["messages"] for c in m.get("tool_calls") or []]
        assert [json.loads(c["function"]["arguments"]) for c in sw_calls] == [c["arguments"] for c in lf_calls]
        assert json.loads(a["tools"]) == rec["tools"] == json.loads(b["tools"])


def test_demo_repeated_for_all_tools(tmp_path):
    d = convert.write_demo(LLAMAFACTORY, tmp_path / "demo", repeat=3)
    assert d["records"] == 18 and d["images"] == 24
    lf = json.loads((d["llamafactory"] / "data.json").read_text())
    assert all((d["llamafactory"] / p).is_file() for r in lf for p in r["images"])  # relative, as vlmprep reads it
    assert len({p for r in lf for p in r["images"]}) == 3 * 3  # each copy its own files (1.jpg twice in a record)
    assert d["source_image_bytes"] == 3 * sum(f.stat().st_size for f in (LLAMAFACTORY / "mllm_demo_data").iterdir())
    sw = [json.loads(line) for line in d["swift"].read_text().splitlines()]
    assert [r["messages"] for r in sw] == [r["messages"] for r in lf]
    assert all(Path(p).is_absolute() and Path(p).is_file() for r in sw for p in r["images"])


def test_each_tool_gets_the_same_length_and_pixel_bounds(tmp_path):
    data = {"kind": "demo", "name": "demo", "llamafactory": tmp_path, "swift": tmp_path / "d.jsonl", "seq_len": 4096}
    pixels = {"min_pixels": 3136, "max_pixels": 12845056}
    args = dict(model=tmp_path / "model", out=tmp_path / "o", run_dir=tmp_path, workers=1, pixels=pixels)
    vl = command("vlmprep", Path("python"), data, **args)
    assert vl[vl.index("--seq-len") + 1] == "4096" and vl[vl.index("--processor") + 1] == str(tmp_path / "model")
    command("llamafactory", tmp_path / "bin" / "python", data, **args)
    cfg = json.loads((tmp_path / "llamafactory.yaml").read_text())
    assert cfg["cutoff_len"] == 4096 and cfg["image_max_pixels"] == 12845056 and cfg["image_min_pixels"] == 3136
    assert cfg["tokenized_path"] == str((tmp_path / "o").resolve()) and cfg["preprocessing_num_workers"] == 1
    sw = command("ms-swift", tmp_path / "bin" / "python", data, **args)
    assert sw[sw.index("--max_length") + 1] == "4096" and sw[sw.index("--to_cached_dataset") + 1] == "true"


@pytest.mark.slow  # ~2 min on 2 cores: four small vlmprep builds (the peers are not installed by this test)
def test_quick_harness_measures_vlmprep_on_both_inputs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--quick", "--tools", "vlmprep"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows[0]["bench"] == "machine" and rows[-1]["bench"] == "done"
    runs = {r["input"]: r for r in rows if r.get("metric") == "run"}
    assert set(runs) == {"demo", "traces"} and not any("error" in r for r in runs.values()), runs
    for r in runs.values():
        assert r["samples"] == r["records"] and r["rejected"] == 0 and r["output_bytes"] > 0
        # Rates are None where --quick's few records cost less CPU than the noise between two start-ups.
        assert {"records_per_s_per_core", "images_per_s_per_core"} <= set(r) and r["cpu_seconds"] > 0
        assert r["train_time"] and r["startup_cpu_seconds"] > 0
    assert not (tmp_path / "bench-out" / "peers" / "venv-llamafactory").exists()  # nothing installed
