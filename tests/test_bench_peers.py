"""`make bench-peers` harness, the parts that run without the peers' venvs: the records in each peer's format carry
the same turns, text and images as the trace they came from, and each tool is asked for the same length and pixels;
the end-to-end mode's train-time drivers read what each tool's preprocessing wrote, vlmprep's reads every record
each epoch, and its ratios meet their goals only where the CPU seconds do; in `make test-all`, the harness's own
quick run measures vlmprep end to end (no peer installed)."""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import convert, endtoend
from benchmarks.peers.__main__ import command, save_model_dir
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


def test_train_time_drivers_read_each_tools_own_output(tmp_path):
    data = {"kind": "demo", "name": "demo", "llamafactory": tmp_path, "swift": tmp_path / "d.jsonl", "seq_len": 4096}
    pixels = {"min_pixels": 3136, "max_pixels": 12845056}
    out, model = tmp_path / "o", tmp_path / "model"
    result = {"run_dir": str(tmp_path), "out": str(out), "seq_len": 4096}
    # LLaMA-Factory's driver loads the config its preprocessing ran with: tokenized_path is where that saved.
    command("llamafactory", tmp_path / "bin" / "python", data, model, out, tmp_path, 1, pixels)
    code, args = endtoend.driver("llamafactory", result, model, epochs=3, batch=2)
    assert "SFTDataCollatorWith4DAttentionMask" in code and (args["epochs"], args["batch"]) == (3, 2)
    assert json.loads(Path(args["config"]).read_text())["tokenized_path"] == str(out.resolve())
    # ms-swift's: `swift export --to_cached_dataset` writes OUTPUT_DIR/train; sft reads it at the same length.
    sw = command("ms-swift", tmp_path / "bin" / "python", data, model, out, tmp_path, 1, pixels)
    code, args = endtoend.driver("ms-swift", result, model, epochs=3, batch=2)
    argv = args["argv"]
    assert "LazyLLMDataset" in code and "template.data_collator" in code
    assert argv[argv.index("--cached_dataset") + 1] == str(Path(sw[sw.index("--output_dir") + 1]) / "train")
    assert argv[argv.index("--max_length") + 1] == sw[sw.index("--max_length") + 1] == "4096"
    assert argv[argv.index("--template") + 1] == sw[sw.index("--template") + 1]
    assert argv[argv.index("--per_device_train_batch_size") + 1] == "2"
    code, args = endtoend.driver("vlmprep", result, model, epochs=3, batch=2)
    assert args["dataset"] == str(out) and args["processor"] == str(model)
    for tool in ("vlmprep", "llamafactory", "ms-swift"):  # each driver is valid Python that prints its E2E line
        code = endtoend.driver(tool, result, model, epochs=1, batch=1)[0]
        compile(code, tool, "exec")
        assert 'print("E2E " + json.dumps(' in code


def test_vlmprep_train_time_reads_every_record_every_epoch(tmp_path, qwen2vl_processor):
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    model = tmp_path / "model"
    save_model_dir(model, qwen2vl_processor)
    d = convert.write_demo(LLAMAFACTORY, tmp_path / "demo", repeat=1)
    out = tmp_path / "ds"
    cfg = BuildConfig(
        inputs=(str(d["llamafactory"] / "data.json"),), out=str(out), processor=str(model), seq_len=4096, progress=False
    )
    build(cfg)
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    r = endtoend.vlmprep_epochs(str(out), str(model), str(tmp_path / "run"), epochs=3, batch=2)
    assert [e["samples"] for e in r["epochs"]] == [d["records"]] * 3
    assert [e["tokens"] for e in r["epochs"]] == [totals["tokens"]] * 3
    assert [e["images"] for e in r["epochs"]] == [totals["images"]] * 3 and totals["images"] == d["images"]
    assert all(e["cpu_s"] > 0 and e["patchify_cpu_s"] > 0 for e in r["epochs"]) and r["setup_cpu_s"] > 0


# A stand-in train-time driver (the real ones need the peers' venvs or a built dataset): it burns the CPU seconds it
# reports, 0.2 s of set-up, then per epoch 0.1 s of loading and 0.2 s of vlmprep's patchify (the GPU's share).
BURNER = (
    endtoend.PRELUDE
    + """
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
burn(0.2)
eps = []
for _ in range(3):
    c0 = _cpu()
    burn(0.1)
    cpu = _cpu() - c0
    p0 = time.process_time()
    burn(0.2)
    eps.append({"cpu_s": cpu, "patchify_cpu_s": time.process_time() - p0, "seconds": 0.3, "samples": 4, "tokens": 9,
                "images": 2})
print("E2E " + json.dumps({"setup_cpu_s": 0.2, "epochs": eps}), flush=True)
"""
)


def test_train_time_counts_each_step_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(endtoend, "driver", lambda *a: (BURNER, {}))
    result = {"input": "demo", "records": 4, "images": 2, "one_records": 1, "run_dir": str(tmp_path)}
    result.update(cpu_seconds=7.0, startup_cpu_seconds=4.0)  # 3 s for 3 of the 4 records: 4 s for all
    row = endtoend.train_time(result, "vlmprep", Path(sys.executable), tmp_path, dict(os.environ), 3, 1)["e2e"]
    assert row["preprocess_cpu_s"] == 4.0 and row["samples_per_epoch"] == [4, 4, 4]
    assert row["total_cpu_s"] == pytest.approx(4.0 + sum(row["load_cpu_s_epochs"]), abs=0.02)
    assert sum(row["load_cpu_s_epochs"]) == pytest.approx(0.3, abs=0.06)
    assert sum(row["patchify_cpu_s_epochs"]) == pytest.approx(0.6, abs=0.03)
    # The load's start-up is the process's CPU less its epochs and the patchify: the interpreter and 0.2 s of set-up.
    assert 0.15 < row["load_startup_cpu_s"] < 0.5
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["metric"] == "e2e"


def _e2e(pre: float, load: float, **extra) -> dict:
    return {"e2e": {"preprocess_cpu_s": pre, "load_cpu_s_per_epoch": load, "total_cpu_s": pre + 3 * load, **extra}}


def test_ratios_meet_a_goal_only_where_the_cpu_seconds_do(capsys):
    results = {
        ("demo", "vlmprep"): _e2e(10.0, 1.0, patchify_cpu_s_epochs=[1.0, 1.0, 1.0]),  # the GPU's step, apart
        ("demo", "llamafactory"): _e2e(15.0, 10.0),  # preprocess 1.5x: met; total 45 / 13: met
        ("demo", "ms-swift"): _e2e(14.0, 8.0),  # preprocess 1.4x: not met; total 38 / 13 = 2.92x: not met
        ("traces", "vlmprep"): _e2e(10.0, 1.0),
        ("traces", "llamafactory"): _e2e(29.0, 5.0),  # 2.9x against a goal of 3: not met
        ("traces", "ms-swift"): _e2e(25.0, 5.0),  # 2.5x: met; total 40 / 13 = 3.08x: met
    }
    rows = {(r["input"], r["vs"]): r for r in endtoend.ratios(results)}
    got = {k: (r["preprocess"], r["preprocess_met"], r["end_to_end"], r["end_to_end_met"]) for k, r in rows.items()}
    assert got == {
        ("demo", "llamafactory"): (1.5, True, 3.46, True),
        ("demo", "ms-swift"): (1.4, False, 2.92, False),
        ("traces", "llamafactory"): (2.9, False, 3.38, True),
        ("traces", "ms-swift"): (2.5, True, 3.08, True),
    }
    # With the GPU's patchify on the CPU too: 45 / (13 + 3); none measured on the traces, so no change there.
    assert rows["demo", "llamafactory"]["end_to_end_patchify_on_cpu"] == 2.81
    assert rows["traces", "ms-swift"]["end_to_end_patchify_on_cpu"] == 3.08
    assert (
        rows["traces", "llamafactory"]["preprocess_goal"] == 3.0 and rows["demo", "ms-swift"]["load_per_epoch"] == 8.0
    )
    assert len([json.loads(x) for x in capsys.readouterr().out.splitlines()]) == 4  # one JSON line each


@pytest.mark.slow  # ~3 min on 2 cores: four small vlmprep builds and two train-time runs (no peer installed)
def test_quick_harness_measures_vlmprep_end_to_end_on_both_inputs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--quick", "--tools", "vlmprep", "--end-to-end"],
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
    e2e = {r["input"]: r for r in rows if r.get("metric") == "e2e"}
    assert set(e2e) == {"demo", "traces"} and not any("error" in r for r in e2e.values()), e2e
    for name, r in e2e.items():
        assert r["samples_per_epoch"] == [runs[name]["records"]] * 3 and r["tokens_per_epoch"] == runs[name]["tokens"]
        assert r["images_per_epoch"] == [runs[name]["images"]] * 3 and r["load_startup_cpu_s"] > 0
        assert r["total_cpu_s"] == pytest.approx(r["preprocess_cpu_s"] + sum(r["load_cpu_s_epochs"]), abs=0.02)
    assert "| demo | vlmprep | 12 |" in proc.stderr  # the summary table
    assert (tmp_path / "bench-out" / "peers" / "end-to-end.md").read_text().strip() in proc.stderr
    assert not (tmp_path / "bench-out" / "peers" / "venv-llamafactory").exists()  # nothing installed
