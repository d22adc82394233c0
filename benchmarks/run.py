"""`make bench`: every benchmark in data-flow order, one JSON line per measurement on stdout.
build -> tables (Parquet vs .jsonl.zst ingest of the same records) ->
stages (the record path's stages, each beside its floor) -> startup (worker ready, first record, 1 vs 2
workers) -> limits (floors, incl. tar read speed of a real shard) -> codec (stored image bytes vs source and one
core's decode rate, per image format) -> loader (vs online, as a multiple of the floor; integrity: the start-up
sha256 check vs a loader pass) -> families (the loader of each family vs its processor's online path, and the
floor) -> photos (the default per-image storage on photos: bytes, build CPU), photo_loader (the loader per family on
photos) -> collate -> clients (peak RSS of HF Trainer through the Collator vs the trainer) ->
balance -> pack -> order (sample shuffle, mixture shares, shuffled loader); traces (what dropped images cost,
agent-trace split/keep-images table); scale (one plan: local pool vs Ray, per-task balance); video (build seconds and
shard bytes per second of video); growth (each command's time and peak RSS as samples, input files and tasks grow,
with growth exponents: 10k / 100k samples, 1M from the index); append (`build --append` of 1,000 records to datasets
of 10k and 100k samples vs building them alone); watch (a running `vlmprep watch`: an object landing to a readable
version, against its build time + --every + 10 s). `--quick` is a smoke run of every benchmark (tiny inputs;
figures meaningless, shape real): ~15 min on the 2-core box, most of it start-ups and builds."""

from __future__ import annotations

import argparse
import time

from benchmarks import (
    bench_append,
    bench_balance,
    bench_build,
    bench_clients,
    bench_codec,
    bench_collate,
    bench_families,
    bench_growth,
    bench_limits,
    bench_loader,
    bench_order,
    bench_pack,
    bench_photos,
    bench_scale,
    bench_stages,
    bench_startup,
    bench_tables,
    bench_traces,
    bench_video,
    bench_watch,
)
from benchmarks.emit import emit, machine
from benchmarks.inputs import OUT

BENCHES = (
    "build",
    "tables",
    "stages",
    "startup",
    "limits",
    "codec",
    "loader",
    "families",
    "photos",
    "photo_loader",
    "collate",
    "clients",
    "balance",
    "pack",
    "order",
    "traces",
    "scale",
    "video",
    "growth",
    "append",
    "watch",
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run")
    ap.add_argument("--quick", action="store_true", help="tiny inputs: checks that everything runs")
    ap.add_argument(
        "--records",
        type=int,
        default=None,
        help="records for build and loader (default: build 200, loader 1000; quick 6)",
    )
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma list of {', '.join(BENCHES)}")
    a = ap.parse_args(argv)
    only = [b.strip() for b in a.only.split(",") if b.strip()]
    unknown = set(only) - set(BENCHES)
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(BENCHES)}")
    emit("machine", quick=a.quick, **machine())
    t0 = time.perf_counter()
    if "build" in only:
        bench_build.run(a.quick, a.records)
    if "tables" in only:
        bench_tables.run(a.quick)
    if "stages" in only:
        bench_stages.run(a.quick)
    if "startup" in only:
        bench_startup.run(a.quick)
    if "codec" in only:
        bench_codec.run(a.quick)
    floors = None
    if "limits" in only or "loader" in only:
        shard = next(iter(sorted((OUT / "build-w1").glob("shard-*.tar"))), None)
        floors = bench_limits.run(a.quick, shard)
    if "loader" in only:
        bench_loader.run(a.quick, a.records, floors)
    if "families" in only:
        bench_families.run(a.quick)
    if "photos" in only:
        bench_photos.run(a.quick)
    if "photo_loader" in only:
        bench_photos.run_loader(a.quick)
    if "collate" in only:
        bench_collate.run(a.quick)
    if "clients" in only:
        bench_clients.run(a.quick)
    if "balance" in only:
        bench_balance.run(a.quick)
    if "pack" in only:
        bench_pack.run(a.quick)
    if "order" in only:
        bench_order.run(a.quick)
    if "traces" in only:
        bench_traces.run(a.quick)
    if "scale" in only:
        bench_scale.run(a.quick)
    if "video" in only:
        bench_video.run(a.quick)
    if "growth" in only:
        bench_growth.run(a.quick)
    if "append" in only:
        bench_append.run(a.quick)
    if "watch" in only:
        bench_watch.run(a.quick)
    emit("done", seconds=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
