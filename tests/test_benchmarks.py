"""`make bench` smoke test: `python -m benchmarks.run --quick` runs every benchmark end to end on tiny inputs and
prints well-formed JSON lines with the fields docs/performance.md's table is built from (figures unchecked)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

REQUIRED = {
    ("build", "processor_render_floor"): {"records", "seconds", "records_per_s", "tokens_per_s"},
    ("build", "build"): {"workers", "records_per_s", "tokens_per_s", "startup_seconds"},
    ("build", "overhead_vs_processor_render"): {"ratio", "overhead_pct", "goal_pct"},
    ("build", "speedup_2_workers"): {"ratio", "goal"},
    ("build", "shard_bytes_vs_input"): {"image_format", "input_decoded_bytes", "shard_bytes", "ratio"},
    ("tables", "ingest"): {"shape", "records", "jsonl_zst_records_per_s", "parquet_records_per_s", "ratio", "goal"},
    ("tables", "s3_vs_local"): {"shape", "records", "local_seconds", "s3_seconds", "ratio", "goal"},
    ("build", "peak_rss"): {"workers", "main_rss_mb_small", "main_rss_mb_big", "worker_rss_mb_big", "ratio"},
    ("startup", "worker_ready"): {
        "imports_seconds",
        "ready_beyond_imports_seconds",
        "first_render_seconds",
        "goal_seconds",
        "forked_pool_workers_ready_seconds",
    },
    ("startup", "first_record"): {"workers", "seconds"},
    ("startup", "build_wall_clock"): {"workers", "records", "seconds"},
    ("startup", "speedup_2_workers_wall_clock"): {"ratio", "goal"},
    ("limits", None): {
        "tar_read_mb_s",
        "decode_ms_zstd_stored",
        "decode_ms_png_source",
        "decode_ms_jpeg_q90",
        "processor_normalize_patchify_ms",
        "processor_full_ms",
    },
    ("codec", "bytes_and_decode"): {
        "images",
        "image_format",
        "zstd_level",
        "ratio_vs_source",
        "encode_ms_per_image",
        "decode_per_s_one_core",
        "bytes_vs_zstd3",
        "decode_vs_zstd3",
    },
    ("loader", None): {"path", "workers", "samples_per_s", "tokens_per_s"},
    ("loader", "format_v2_vs_v1"): {"seconds_v1", "seconds_v2", "ratio"},
    ("integrity", None): {"sha256_mb_s", "loader_mb_s", "check_over_loader_pass"},
    ("collate", None): {"samples", "median_ms", "goal_ms"},
    ("collate", "small_batches"): {"batch", "rows_us", "mask_us", "speedup"},
    ("clients", "peak_rss"): {"run", "batch", "first_batch"},
    ("clients", "ratio"): {"ratio", "goal", "step1_loss_rel_diff", "all_logits_over_trainer_peak_rss"},
    ("traces", None): {"long_traces", "seq_len", "keep_images", "coverage", "samples", "tokens", "shard_bytes"},
    ("stages", "stage"): {"stage", "unit", "ms", "floor_ms", "floor", "ratio"},
    ("stages", "record_path"): {"ms_per_record", "floor_sum_ms_per_record", "ratio", "goal"},
    ("traces", "keep_images_cost"): {"keep_images", "images_decoded", "dropped_images_decoded", "seconds"},
    ("balance", None): {"plan", "ranks", "step_max_over_mean_micro1", "epoch_tokens_max_over_mean"},
    ("pack", "pack"): {
        "pack_to",
        "pack_window",
        "ranks",
        "fill",
        "step_max_over_mean_tokens",
        "step_max_over_mean_attention",
        "pack_ms_per_1000_samples",
    },
    ("pack", "token_budget"): {
        "max_tokens_per_batch",
        "fill",
        "step_max_over_mean_tokens",
        "step_max_over_mean_attention",
    },
    ("pack", "micro_batch_1"): {"fill", "step_max_over_mean_tokens", "step_max_over_mean_attention"},
    ("pack", "loader_cost"): {"pack_ms_per_sample", "collate_ms_per_sample", "added_ms_per_sample", "goal_ms"},
    ("order", "batch_correlation"): {
        "data",
        "batching",
        "ranks",
        "samples",
        "share_no_shuffle",
        "share_shuffle",
        "share_uniform",
        "ratio_shuffle_vs_uniform",
        "ratio_no_shuffle_vs_uniform",
    },
    ("order", "sorted_input_correlation"): {"batching", "ratio_no_shuffle_vs_uniform", "ratio_shuffle_vs_uniform"},
    ("order", "mixture"): {"names", "requested", "realized", "schedule_level", "max_abs_error", "steps"},
    ("order", "loader_throughput"): {"samples_per_s_no_shuffle", "samples_per_s_shuffle", "ratio", "cpu_ratio"},
    ("order", "loader_rss"): {
        "peak_rss_mb_no_shuffle",
        "peak_rss_mb_span_1",
        "peak_rss_mb_span_4",
        "peak_rss_mb_span_all",
        "rss_max_over_min_spans",
    },
    ("video", None): {"family", "build_s_per_video_s", "shard_bytes_per_video_s", "video_tokens"},
    ("append", "build_alone"): {"records", "seconds", "peak_rss_mb"},
    ("append", "append"): {"records", "base_samples", "seconds", "vs_alone", "goal", "within_goal"},
    ("append", "size_independence"): {"base_samples", "ratio", "goal", "within_goal"},
    ("watch", "latency"): {"records", "every", "latency_seconds", "build_seconds", "goal", "within_goal"},
    ("watch", "latency_worst"): {"objects", "every", "max_latency_seconds", "max_over_build_and_every_seconds"},
    ("video", "peak_rss"): {"family", "workers", "main_rss_mb", "worker_rss_mb", "goal_mb"},
    ("photos", "image_bytes_vs_source"): {"input", "image_format", "by_storage", "ratio"},
    ("photos", "build_cpu_per_record"): {"ms_per_record", "ratio", "goal_ratio"},
    ("photos", "loader"): {
        "shape",
        "family",
        "storage",
        "loader_samples_per_s",
        "floor_samples_per_s",
        "online_samples_per_s",
        "covers_need",
        "covers_need_with_vision",
    },
    ("families", None): {
        "family",
        "pixels",
        "loader_samples_per_s",
        "floor_samples_per_s",
        "online_samples_per_s",
        "speedup_vs_online",
        "share_of_floor",
    },
}


@pytest.mark.slow  # ~15 min on 2 cores (903 s on the quiet box, 2026-12-07): builds and trains for every benchmark
def test_quick_benchmarks_print_the_documented_json_lines(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line is one JSON object
    assert rows[0]["bench"] == "machine" and rows[-1]["bench"] == "done"
    for (bench, metric), fields in REQUIRED.items():
        hits = [r for r in rows if r["bench"] == bench and r.get("metric") == metric]  # None: rows without one
        assert hits, (bench, metric)
        for r in hits:
            assert fields <= set(r), (bench, metric, fields - set(r))
    loader = [r for r in rows if r["bench"] == "loader"]
    assert {r["path"] for r in loader} >= {"vlmprep_shards"} and any(r["path"].startswith("online_") for r in loader)
    assert all("speedup_vs_online" in r for r in loader if r["path"] == "vlmprep_shards")
    assert any("time_over_floor" in r for r in loader)
    assert {r["plan"] for r in rows if r["bench"] == "balance"} == {"sample_count_split", "token_balanced_shards"}
    assert {r["pack_to"] for r in rows if r.get("metric") == "pack"} == {16384, 32768}
    assert {r["stage"] for r in rows if r.get("metric") == "stage"} == {
        "json_parse",
        "normalize_base64",
        "image_header",
        "image_decode",
        "resize",
        "encode",
        "tokenize",
        "render_mask",
        "split_search",
        "tar_write",
        "hashing",
    }
    keep = [r for r in rows if r.get("metric") == "keep_images_cost"]
    assert [r["dropped_images_decoded"] for r in keep] == [0, 0] and "ratio_vs_keep_all" in keep[1]


def test_order_pair_share_and_its_uniform_expectation():
    """The order benchmark's metric: same-trajectory pairs / all pairs within a global batch, pooled over steps;
    the uniform figure is what random permutations cut into the same batch sizes give on average."""
    import random

    from benchmarks.bench_order import pair_share, uniform_share

    traj = {"a#0": "a", "a#1": "a", "a#2": "a", "b#0": "b", "b#1": "b", "c": "c"}
    # step 1: {a, a, b} -> 1 same pair of 3; step 2: {a, b, c} -> 0 of 3
    assert pair_share([["a#0", "a#1", "b#0"], ["a#2", "b#1", "c"]], traj) == (1 / 6, 1, 6)
    assert uniform_share(traj) == (3 + 1) / 15
    rng, ids, sizes = random.Random(0), sorted(traj), [2, 3, 1]
    draws = []
    for _ in range(20000):
        rng.shuffle(ids)
        cuts = [ids[sum(sizes[:k]) : sum(sizes[: k + 1])] for k in range(len(sizes))]
        draws.append(pair_share(cuts, traj)[0])
    assert abs(sum(draws) / len(draws) - uniform_share(traj)) < 0.01


def test_codec_candidates_decode_losslessly_and_the_previous_screenshot_prefix_pays():
    """bench_codec's candidates (no stored format) undo exactly; with the previous screenshot as a zstd prefix a
    screenshot that differs from it by a moved cursor stores a fraction of its standalone bytes."""
    from benchmarks.bench_codec import decode_experiment, experiment

    rng = np.random.default_rng(0)
    first = np.full((96, 160, 3), 245, np.uint8)
    first[20:70, 10:150] = rng.integers(0, 256, (50, 140, 3), dtype=np.uint8)  # "text": incompressible alone
    second = first.copy()
    second[40:52, 60:68] = 0  # the cursor moved
    for kind in ("planes", "delta-prev", "delta-unresized"):
        _, stored = experiment(kind, [first, second])
        for pixels, (data, ref) in zip((first, second), stored):
            assert np.array_equal(decode_experiment(kind, data, ref, pixels.shape), pixels), kind
    _, prev = experiment("delta-prev", [first, second])
    assert prev[0][1] is None and prev[1][1] is not None  # the first screenshot stands alone
    assert len(prev[1][0]) < len(prev[0][0]) / 10
