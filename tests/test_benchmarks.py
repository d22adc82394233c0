"""`make bench` smoke test: `python -m benchmarks.run --quick` runs every benchmark end to end on tiny inputs and
prints well-formed JSON lines with the fields the README's Performance table is built from (figures unchecked)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = {
    ("build", "processor_render_floor"): {"records", "seconds", "records_per_s", "tokens_per_s"},
    ("build", "build"): {"workers", "records_per_s", "tokens_per_s", "startup_seconds"},
    ("build", "overhead_vs_processor_render"): {"ratio", "overhead_pct", "goal_pct"},
    ("build", "speedup_2_workers"): {"ratio", "goal"},
    ("build", "shard_bytes_vs_input"): {"image_format", "input_decoded_bytes", "shard_bytes", "ratio"},
    ("build", "peak_rss"): {"workers", "main_rss_mb_small", "main_rss_mb_big", "worker_rss_mb_big", "ratio"},
    ("startup", "worker_ready"): {"imports_seconds", "ready_beyond_imports_seconds", "first_render_seconds", "goal_seconds"},
    ("startup", "first_record"): {"workers", "seconds"},
    ("startup", "build_wall_clock"): {"workers", "records", "seconds"},
    ("startup", "speedup_2_workers_wall_clock"): {"ratio", "goal"},
    ("limits", None): {"tar_read_mb_s", "decode_ms_zstd_stored", "decode_ms_png_source", "decode_ms_jpeg_q90",
                       "processor_normalize_patchify_ms", "processor_full_ms"},
    ("loader", None): {"path", "workers", "samples_per_s", "tokens_per_s"},
    ("loader", "format_v2_vs_v1"): {"seconds_v1", "seconds_v2", "ratio"},
    ("collate", None): {"samples", "median_ms", "goal_ms"},
    ("traces", None): {"long_traces", "seq_len", "keep_images", "coverage", "samples", "tokens", "shard_bytes"},
    ("balance", None): {"plan", "ranks", "step_max_over_mean_micro1", "epoch_tokens_max_over_mean"},
    ("pack", "pack"): {"pack_to", "pack_window", "ranks", "fill", "step_max_over_mean_tokens",
                       "step_max_over_mean_attention", "pack_ms_per_1000_samples"},
    ("pack", "token_budget"): {"max_tokens_per_batch", "fill", "step_max_over_mean_tokens", "step_max_over_mean_attention"},
    ("pack", "micro_batch_1"): {"fill", "step_max_over_mean_tokens", "step_max_over_mean_attention"},
    ("pack", "loader_cost"): {"pack_ms_per_sample", "collate_ms_per_sample", "added_ms_per_sample", "goal_ms"},
    ("video", None): {"family", "build_s_per_video_s", "shard_bytes_per_video_s", "video_tokens"},
}


@pytest.mark.slow  # ~2 min on 2 cores: builds and trains on tiny inputs for every benchmark
def test_quick_benchmarks_print_the_documented_json_lines(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line is one JSON object
    assert rows[0]["bench"] == "machine" and rows[-1]["bench"] == "done"
    for (bench, metric), fields in REQUIRED.items():
        hits = [r for r in rows if r["bench"] == bench and (metric is None or r.get("metric") == metric)]
        assert hits, (bench, metric)
        for r in hits:
            assert fields <= set(r), (bench, metric, fields - set(r))
    loader = [r for r in rows if r["bench"] == "loader"]
    assert {r["path"] for r in loader} >= {"vlmprep_shards"} and any(r["path"].startswith("online_") for r in loader)
    assert all("speedup_vs_online" in r for r in loader if r["path"] == "vlmprep_shards")
    assert any("time_over_floor" in r for r in loader)
    assert {r["plan"] for r in rows if r["bench"] == "balance"} == {"sample_count_split", "token_balanced_shards"}
    assert {r["pack_to"] for r in rows if r.get("metric") == "pack"} == {16384, 32768}
