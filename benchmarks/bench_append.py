"""Append benchmark (`make bench --only append`, issue 55.8; docs/datasets-that-grow.md): `vlmprep build --append`
of NEW real records (demo agent traces with small screenshots, rendered by builtin:qwen2-vl) to datasets of each base
size, against building those NEW records alone into an empty dir, each a fresh `vlmprep` process (wall seconds,
peak RSS), the runs alternated and the best of `repeat` kept. Goals: the append to the largest base costs <= 1.2x the
build alone, and <= 1.2x the append to the smallest base (its cost does not grow with the dataset).

The bases are real datasets (written by the real writer, merged by `vlmprep merge`, 100 samples a shard) of a few
rendered samples replicated under new ids (benchmarks/bench_growth.py), with the same build options as the appends;
each append runs on a hard-linked copy of its base (an append writes new files and renames, never into one it did
not make). `python -m benchmarks.bench_append --sizes 10000,100000 --new 1000` (the defaults; `--quick`: 200 / 1000
samples, 20 new records).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess

from benchmarks.bench_build import TOOL_TEMPLATE
from benchmarks.bench_growth import _vlmprep, plan_inputs, planned_dataset, real_samples
from benchmarks.emit import emit, machine
from benchmarks.inputs import OUT, traces

GOAL = 1.2
OPTIONS = {"chat_template": str(TOOL_TEMPLATE)}  # the bases' and the appends' (an append must match its dataset)
FLAGS = ["--chat-template", str(TOOL_TEMPLATE), "--max-reject-fraction", "1", "--min-turn-coverage", "0"]
FLAGS += ["--workers", "2", "--no-progress"]


def base(n: int):
    """A merged dataset of n samples (built once, kept under bench-out/append/)."""
    d = planned_dataset(n, 1, real_samples(), plan_inputs(1, n), **OPTIONS)
    if not (d / "manifest.json").exists():
        _vlmprep("merge", d, "--max-reject-fraction", 1, "--min-turn-coverage", 0)
    return d


def _fresh_copy(src, dst) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)  # hard links: seconds for 10^5 files
    (dst / ".written").unlink(missing_ok=True)  # bench_growth's marker: not a file of a dataset


def run(quick: bool, sizes: tuple[int, ...] | None = None, new: int | None = None, repeat: int = 3) -> list[dict]:
    """Time `build` of `new` records alone and `build --append` of them to a base of each size; emit one row each
    and the two goals."""
    sizes = sizes or ((200, 1000) if quick else (10_000, 100_000))
    new = new or (20 if quick else 1000)
    records = traces(new, width=160, height=100, min_images=1, max_images=2, seed=55)
    bases = {n: base(n) for n in sizes}
    work = OUT / "append" / "work"
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeat if not quick else 1):
        for what in ["alone", *sizes]:  # alternated: a drift of the machine hits every kind alike
            out = work / str(what)
            if what == "alone":
                shutil.rmtree(out, ignore_errors=True)
                s, rss, _ = _vlmprep("build", "--in", records, "--out", out, *FLAGS)
            else:
                _fresh_copy(bases[what], out)
                s, rss, stdout = _vlmprep("build", "--append", "--in", records, "--out", out, *FLAGS)
                assert "appended version v2" in stdout, stdout[-2000:]
            key = str(what)
            best[key] = min(best.get(key, (s, rss)), (s, rss))
    shutil.rmtree(work, ignore_errors=True)
    alone = best["alone"][0]
    rows = [
        emit(
            "append", metric="build_alone", records=new, seconds=round(alone, 3), peak_rss_mb=round(best["alone"][1], 1)
        )
    ]
    for n in sizes:
        s, rss = best[str(n)]
        rows.append(
            emit(
                "append",
                metric="append",
                records=new,
                base_samples=n,
                seconds=round(s, 3),
                peak_rss_mb=round(rss, 1),
                vs_alone=round(s / alone, 3),
                goal=f"<= {GOAL}",
                within_goal=s / alone <= GOAL,
            )
        )
    small, big = best[str(sizes[0])][0], best[str(sizes[-1])][0]
    rows.append(
        emit(
            "append",
            metric="size_independence",
            base_samples=[sizes[0], sizes[-1]],
            ratio=round(big / small, 3),
            goal=f"<= {GOAL}",
            within_goal=big / small <= GOAL,
        )
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_append")
    ap.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    ap.add_argument("--sizes", default=None, help="comma list of base dataset sizes (samples), e.g. 10000,100000")
    ap.add_argument("--new", type=int, default=None, help="records appended (default 1000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each kind, alternated; the best is kept")
    a = ap.parse_args(argv)
    emit("machine", quick=a.quick, **machine())
    sizes = tuple(int(x) for x in a.sizes.split(",")) if a.sizes else None
    run(a.quick, sizes, a.new, a.repeat)


if __name__ == "__main__":
    main()
