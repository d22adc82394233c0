"""Growth benchmark (`make bench --only growth`): what each command costs as the data grows, each run in a fresh
process (wall seconds and peak RSS), with the growth exponent between sizes (log(t_b / t_a) / log(b / a): 1 is
linear; n log n over a 10x step is 1.1). Datasets of 10k and 100k samples are written by the real writer (a few
rendered demo samples replicated under new ids, cut into plan tasks, then `vlmprep merge`); 1M samples only where a
command touches just the manifest and sample index (the trainer's start-up: manifest, sidecars, sparse shard files).
These datasets hold 100 samples per shard (10x the shards of the build's default); the trainer's data part is also
measured at the default (1,000 per shard: a real 10k dataset replicated index-only to 100k and 1M). Plan over
10 / 10^3 / 10^4 input files and 1 / 100 / 1,000 tasks. The trainer's start-up to its first step on rank 0
of 8 and 64 simulated ranks (open the data, the sample index, the step predictor under a token budget, the sha256
of the rank's shards that a run dir's first start checks (a resume skips it), the first step's batches), and over
loopback HTTP with the cache limit at 10% of the dataset against fetching two shards.
And the start-up on 10k samples as 100 versions against one (issue 55.8; `--versions-only`: that row alone).
`--quick`: 1k / 10k samples (100k index-only), 10 / 100 files, 1 / 10 tasks."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces

SAMPLES_PER_SHARD = 100
MAX_TOKENS = 8192  # the step predictor's token budget (the batcher's rule over every sample's length, in numpy)
NLOGN_10X = 1.1  # growth exponent of n log n over one 10x step (from 10^4): anything above grows faster


# Runs the command as its only child and writes that child's peak RSS (KiB) to argv[1]: measured from a small
# process, since a child forked straight from this (large) one would count the pages it inherited.
_WRAP = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(rc)"
)


def _run(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB, stdout) of one fresh process."""
    import tempfile

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with tempfile.TemporaryDirectory() as tmp:
        rss = Path(tmp) / "rss"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", _WRAP, str(rss), *map(str, args)], capture_output=True, text=True, env=env
        )
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return seconds, int(rss.read_text()) / 1024, proc.stdout


def _vlmprep(*args) -> tuple[float, float, str]:
    return _run([sys.executable, "-m", "vlmprep", *map(str, args)])


def _exponent(a: int, ta: float, b: int, tb: float) -> float:
    return round(math.log(max(tb, 1e-6) / max(ta, 1e-6)) / math.log(b / a), 3)


def _ratio(points: list[tuple[int, float]], big: int, small: int) -> float | None:
    """points' seconds at `big` samples over those at `small` (None where a size is not measured: --quick's 1k runs
    have no 100k-over-10k pair of real datasets, but do of 10k real and 100k index-only)."""
    at = dict(points)
    return round(at[big] / max(at[small], 1e-6), 3) if big in at and small in at else None


def _growth(command: str, by: str, points: list[tuple[int, float]], **fields) -> dict:
    """One row: a command's times at each size and the exponent of each step (the last step's judged)."""
    steps = [_exponent(a, ta, b, tb) for (a, ta), (b, tb) in zip(points, points[1:])]
    return emit(
        "growth",
        metric="exponent",
        command=command,
        by=by,
        sizes=[p[0] for p in points],
        seconds=[round(p[1], 3) for p in points],
        exponents=steps,
        goal=f"<= {NLOGN_10X} (n log n)",
        within_goal=all(e <= NLOGN_10X for e in steps),
        **fields,
    )


# --- inputs: plan files and real samples


def plan_inputs(files: int, records: int) -> Path:
    """`files` .jsonl files holding `records` tiny chat records in all (what the plan scans, not renders)."""
    d = OUT / "growth" / f"inputs-{files}-{records}"
    if not (d / ".done").exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        per = -(-records // files)
        for f in range(files):
            rows = [
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"question {f}.{i}"},
                            {"role": "assistant", "content": f"answer {f}.{i}"},
                        ]
                    }
                )
                for i in range(min(per, records - f * per))
            ]
            (d / f"part-{f:05d}.jsonl").write_text("\n".join(rows) + "\n")
        (d / ".done").touch()
    return d


def real_samples() -> list:
    """A few demo agent-trace samples rendered by the real build (small screenshots keep 100k samples ~1 GB)."""
    from benchmarks.bench_build import build_config
    from vlmprep.builder.pipeline import build
    from vlmprep.shards.reader import iter_dataset

    d = OUT / "growth" / "seed"
    if not (d / "manifest.json").exists():
        shutil.rmtree(d, ignore_errors=True)
        inp = traces(12, width=160, height=100, min_images=1, max_images=2)
        build(build_config(inp, d, seq_len=2048, samples_per_shard=100, tool_calls="train-content"))
    return [(s.meta(), {n: s.read(n) for n in s.names}) for s in iter_dataset(d)]


def _replica(samples, q: int):
    from vlmprep.shards.format import META_MEMBER, sample_key
    from vlmprep.types import ShardSample

    meta, members = samples[q % len(samples)]
    meta = {**meta, "id": f"replica-{q:09d}", "source": {"file": "replicas.jsonl", "line": q + 1}}
    members = {**members, META_MEMBER: json.dumps(meta, sort_keys=True).encode()}
    return ShardSample(
        key=sample_key(q),
        members=members,
        num_tokens=meta["num_tokens"],
        num_trainable_tokens=meta["num_trainable_tokens"],
        num_images=meta["num_images"],
        meta=meta,
    )


def planned_dataset(
    n: int, tasks: int, samples, records_dir: Path, per_shard: int = SAMPLES_PER_SHARD, **options
) -> Path:
    """A dataset dir as `vlmprep build --tasks T` leaves it before merge: the real plan (over records_dir; `options`:
    build options of the plan, e.g. a chat template) and, per task, shards of `per_shard` replicated samples written
    by the real writer, its sample list, rejects and task manifest."""
    import collections

    from vlmprep.builder.pipeline import plan_build
    from vlmprep.builder.plan import plan_digest, shard_prefix
    from vlmprep.builder.totals import SAMPLE_FIELDS, TOTAL_KEYS, count_sample, input_totals
    from vlmprep.config import BuildConfig
    from vlmprep.shards.dataset import TASKS_DIR, TaskFiles, write_json_atomic, write_text_atomic
    from vlmprep.shards.writer import ShardWriter

    # named by what it is made of (a --quick run plans over fewer input files: its datasets are not the full run's)
    d = (
        OUT
        / "growth"
        / (
            f"ds-{n}-t{tasks}"
            + (f"-s{per_shard}" if per_shard != SAMPLES_PER_SHARD else "")
            + "".join(f"-{k}" for k in sorted(options))
            + f"-over-{records_dir.name}"
        )
    )
    if (d / ".written").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    plan, _ = plan_build(
        BuildConfig(
            inputs=(str(records_dir),),
            out=str(d),
            tasks=tasks,
            plan_only=True,
            progress=False,
            samples_per_shard=per_shard,
            **options,
        ),
        fresh=True,
    )
    (d / TASKS_DIR).mkdir(exist_ok=True)
    digest = plan_digest(plan)
    per = -(-n // tasks)
    for i in range(tasks):
        files = TaskFiles(d, i, shard_prefix(plan, i))
        writer = ShardWriter(d, samples_per_shard=per_shard, shard_size_bytes=1 << 40, prefix=files.prefix)
        totals, lines = collections.Counter(), []
        for q in range(i * per, min(n, (i + 1) * per)):
            s = _replica(samples, q)
            writer.write(s)
            count_sample(totals, s.meta)
            totals["records"] += 1
            lines.append(
                json.dumps(
                    {
                        "shard": writer._info.name if writer._info else writer.shards[-1].name,
                        **{k: v for k, v in s.meta.items() if k in SAMPLE_FIELDS},
                    },
                    sort_keys=True,
                )
            )
        shards = writer.close()
        write_text_atomic(files.samples, "".join(line + "\n" for line in lines))
        write_text_atomic(files.rejects, "")
        cut = plan.cuts[i]
        write_json_atomic(
            files.manifest,
            {
                "plan": digest,
                "task": i,
                "config": plan.config,
                "processor": plan.processor.fingerprint,
                "records": {"first_position": cut.position, "count": cut.records},
                "shards": [s.to_json() for s in shards],
                "totals": {k: int(totals[k]) for k in TOTAL_KEYS},
                "inputs": {str(cut.file): input_totals(totals)},
                "rejects": {},
            },
        )
    (d / ".written").touch()
    return d


def index_only(src: Path, n: int) -> Path:
    """A dataset of n samples as far as the manifest and sample indexes go: src's shard entries and sidecars
    repeated under new names, the dataset's sample index over them, each shard a sparse file of its size (no command
    here reads a shard's bytes)."""
    d = OUT / "growth" / f"index-only-{n}-from-{src.name}"
    if (d / "manifest.json").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    manifest = json.loads((src / "manifest.json").read_text())
    shutil.copytree(src / manifest["processor"]["dir"], d / manifest["processor"]["dir"])
    base, shards, have = manifest["shards"], [], 0
    while have < n:
        s = dict(base[len(shards) % len(base)])
        name = f"shard-{len(shards):06d}.tar"
        index = {**s["index"], "name": name + ".index.npy"}
        os.link(src / s["index"]["name"], d / index["name"])
        with open(d / name, "wb") as f:
            f.truncate(s["bytes"])
        shards.append({**s, "name": name, "index": index})
        have += s["num_samples"]
    manifest["shards"] = shards
    manifest["totals"]["samples"] = have
    if all(s.get("index") for s in shards):  # the dataset's sample index, as merge writes it
        from vlmprep.shards.manifest import ShardEntry
        from vlmprep.shards.reader import load_sample_index
        from vlmprep.shards.writer import write_dataset_index

        manifest["sample_index"] = write_dataset_index(
            d, (load_sample_index(d, ShardEntry.from_json(s)) for s in shards), have
        )
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


# --- the trainer's start-up, in a fresh process


def startup_child(data: str, world: int, rank: int, first_step: bool, limit: str = "") -> dict:
    """Rank `rank` of `world`: open the data, index its shards, predict every epoch's steps (token budget), then
    (first_step) start the loader and take the first step's batches. Seconds per phase; index bytes per sample."""
    import resource

    import numpy as np
    import numpy.random  # (numpy imports it lazily, at the schedule's first seed: an import, not data work)
    import torch

    from trainer.config import TrainConfig
    from trainer.data.batches import StepLoader
    from trainer.data.collate import CollateSpec
    from trainer.data.datasets import open_data
    from trainer.data.integrity import ShardCheck, expected_sha256
    from trainer.data.pipeline import rank_sources, read_plan
    from trainer.data.steps import predict_steps
    from trainer.data.streams import EpochSchedule
    from trainer.model import model_type_of
    from trainer.options import Batching, DataOptions

    # The trainer builds its model before the data part, so torch's one-off set-up at a process's first tensor op
    # (~0.5 ms here) is not part of it: paid here too, before the clock starts.
    torch.zeros(2, dtype=torch.float64).sum().item()
    t0 = time.perf_counter()
    cfg = TrainConfig(
        data=data,
        tiny_random="qwen2-vl",
        max_tokens_per_batch=MAX_TOKENS,
        num_workers=0,
        shard_cache_limit=limit,
        out=str(OUT / "growth" / "run"),
    )
    data_ = open_data(
        DataOptions.of(cfg), model_type=model_type_of(model="", tiny_random="qwen2-vl"), packing=False, world=world
    )
    span = read_plan(DataOptions.of(cfg), data_, rank=rank).shuffle_span
    cfg = dataclasses.replace(cfg, shuffle_span=span)
    t1 = time.perf_counter()
    cache = OUT / "growth" / "run" / "shard-cache" / f"rank-{rank:05d}"
    # A run dir's first start, as the trainer's make_loader makes it: its check (on by default, its record empty)
    # defers the local shards' sha256 to the shard cache, and stats them
    check = None
    if "://" not in data:
        check = ShardCheck(None)
    sources, _ = rank_sources(
        data_.specs,
        data_.datasets,
        data_.plans,
        rank=rank,
        world=world,
        cache=cache,
        check=check,
        defer=check is not None,
    )
    t2 = time.perf_counter()
    steps, first = predict_steps(
        sources, DataOptions.of(cfg), Batching.of(cfg), specs=data_.specs, epochs=cfg.epochs, device=torch.device("cpu")
    )
    t3 = time.perf_counter()
    if first_step and check is not None:  # what step 1 waited for before the shard cache hashed local shards: the
        # rank's whole share
        whole = ShardCheck(None)
        for src, ds in zip(sources, data_.datasets):
            want = expected_sha256(ds)
            for sh in src.shards:
                whole.verify(sh.url, url=sh.url, want=want.get(sh.name))
    t4 = time.perf_counter()
    samples = sum(ix.num_samples for s in sources for ix in s.indexes)
    shards = sum(len(s.indexes) for s in sources)
    index_bytes = sum(
        a.nbytes for s in sources for ix in s.indexes for a in (ix.starts, ix.ends, ix.tokens, ix.trained)
    )
    # and each source's per-sample counts the schedule and predictor made once (RankSource's cached properties)
    index_bytes += sum(a.nbytes for s in sources for a in vars(s).values() if isinstance(a, np.ndarray))
    out = {
        "open_s": t1 - t0,
        "index_s": t2 - t1,
        "predict_s": t3 - t2,
        "sha256_s": t4 - t3,
        "samples": samples,
        "shards": shards,
        "index_bytes_per_sample": index_bytes / max(samples, 1),
        "steps": steps[0],
    }
    if first_step:
        from trainer.data.cache import ShardCache, remote_shards

        shard_cache = None
        if remote_shards(sources) or (check is not None and check.deferred):  # step 1 waits for its own shards' hashes
            from trainer.config import cache_limit_bytes

            shard_cache = ShardCache(sources, cache, limit=cache_limit_bytes(limit), check=check)
        spec = CollateSpec(
            pad_id=0, image_token_id=151655, patch_size=data_.image.patch_size, merge_size=data_.image.merge_size
        )
        streams = EpochSchedule(
            sources,
            spec=data_.image,
            seed=0,
            shuffle=True,
            shuffle_shards=True,
            shuffle_span=cfg.shuffle_span,
            first=(0, first),
            cache=shard_cache,
        )
        loader = StepLoader(streams, collate_spec=spec, batching=Batching.of(cfg), num_workers=0, prefetch_factor=2)
        loader.start(0, 0)
        batches = loader.next_step()
        loader.close()
        out["first_step_s"] = time.perf_counter() - t4
        out["first_step_samples"] = sum(b.num_samples for b in batches)
    out["total_s"] = time.perf_counter() - t0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _startup(data: str, world: int, *, first_step: bool, limit: str = "") -> tuple[float, dict]:
    code = (
        "import json, sys; from benchmarks.bench_growth import startup_child; "
        f"print(json.dumps(startup_child({data!r}, {world}, 0, {first_step}, {limit!r})))"
    )
    seconds, _, out = _run([sys.executable, "-c", code])
    return seconds, json.loads(out.strip().splitlines()[-1])


ROUNDS = 11  # fresh processes per dataset size for the data part


def _data_parts(
    points: list[tuple[int, str, bool]], world: int
) -> tuple[list[tuple[float, dict, float]], float | None]:
    """The trainer's start-up on rank 0 of `world`, each of `points` (samples, path, to the first step) in fresh
    processes. The data part (index + step predictor) is a few ms, so one process's scheduling noise moves it by 2x,
    and the box's speed drifts over minutes: ROUNDS rounds, each running every size once in turn, so each round's
    100k-over-10k ratio compares processes that ran seconds apart. Per point: the last process's time and row, and
    the median data part; and the median of the rounds' 100k / 10k ratios (None without that pair)."""
    parts: list[list[float]] = [[] for _ in points]
    last: list[tuple[float, dict]] = [(0.0, {})] * len(points)
    for _ in range(ROUNDS):
        for k, (_, path, first) in enumerate(points):
            s, r = _startup(path, world, first_step=first)
            parts[k].append(r["index_s"] + r["predict_s"])
            last[k] = (s, r)
    sizes = [n for n, _, _ in points]
    paired = None
    if 10_000 in sizes and 100_000 in sizes:
        small, big = parts[sizes.index(10_000)], parts[sizes.index(100_000)]
        paired = round(statistics.median(b / max(a, 1e-9) for a, b in zip(small, big)), 3)
    return [(s, r, statistics.median(p)) for (s, r), p in zip(last, parts)], paired


def run(quick: bool) -> list[dict]:
    sizes = (1_000, 10_000) if quick else (10_000, 100_000)
    big = 100_000 if quick else 1_000_000
    files_set, tasks_set = ((10, 100), (1, 10)) if quick else ((10, 1_000, 10_000), (1, 100, 1_000))
    records = max(files_set[-1], tasks_set[-1], 1_000)
    rows = []

    # plan: every input file scanned once (lines, not JSON)
    plan_s = {}
    for files in files_set:
        inp = plan_inputs(files, records)
        for tasks in tasks_set:
            out = OUT / "growth" / f"plan-{files}-{tasks}"
            shutil.rmtree(out, ignore_errors=True)
            s, rss, _ = _vlmprep("build", "--in", inp, "--out", out, "--plan-only", "--tasks", tasks, "--no-progress")
            plan_s[files, tasks] = s
            rows.append(
                emit(
                    "growth",
                    command="plan",
                    files=files,
                    tasks=tasks,
                    records=records,
                    seconds=round(s, 3),
                    peak_rss_mb=round(rss, 1),
                )
            )
    mid = tasks_set[len(tasks_set) // 2]
    rows.append(_growth("plan", "input files", [(f, plan_s[f, mid]) for f in files_set], tasks=mid))
    rows.append(_growth("plan", "tasks", [(t, plan_s[files_set[-1], t]) for t in tasks_set], files=files_set[-1]))

    # merge, then the commands over the merged dataset
    samples = real_samples()
    inp = plan_inputs(files_set[-1], records)
    merged = {}
    for n in sizes:
        for tasks in tasks_set if n == sizes[0] else (mid,):
            d = planned_dataset(n, tasks, samples, inp)
            (d / "manifest.json").unlink(missing_ok=True)
            s, rss, _ = _vlmprep("merge", d, "--max-reject-fraction", 1)
            rows.append(
                emit("growth", command="merge", samples=n, tasks=tasks, seconds=round(s, 3), peak_rss_mb=round(rss, 1))
            )
            if tasks == mid:
                merged[n] = (d, s)
    rows.append(_growth("merge", "samples", [(n, merged[n][1]) for n in sizes], tasks=mid))
    # the trainer's start-up per rank: the real datasets to the first step, the index-only one to the prediction
    datasets = [(n, str(merged[n][0]), True) for n in sizes] + [
        (big, str(index_only(merged[sizes[-1]][0], big)), False)
    ]
    # The same data part at the build's default shard size (1,000 samples per shard, a tenth of the shards): a real
    # dataset of 10k samples (written, then merged), replicated index-only to 100k and 1M.
    from vlmprep.config import BuildConfig

    per_shard = next(f.default for f in dataclasses.fields(BuildConfig) if f.name == "samples_per_shard")
    base = planned_dataset(10_000, 1, samples, inp, per_shard=per_shard)
    if not (base / "manifest.json").exists():
        _vlmprep("merge", base, "--max-reject-fraction", 1)
    default_size = [
        (n, str(index_only(base, n)), False) for n in (10_000, 100_000) + ((1_000_000,) if not quick else ())
    ]
    for world in (8, 64):
        for spp, points in ((SAMPLES_PER_SHARD, datasets), (per_shard, default_size)):
            data_part = []
            measured, paired = _data_parts(points, world)
            for (n, _, first), (s, r, part) in zip(points, measured):
                data_part.append((n, part))
                rows.append(
                    emit(
                        "growth",
                        command="trainer start-up",
                        samples=n,
                        ranks=world,
                        index_only=not first,
                        samples_per_shard=spp,
                        process_seconds=round(s, 2),
                        open_seconds=round(r["open_s"], 3),
                        index_seconds=round(r["index_s"], 3),
                        predict_seconds=round(r["predict_s"], 3),
                        data_part_seconds=round(part, 4),
                        first_read_sha256_seconds=round(r["sha256_s"], 3),
                        first_step_seconds=round(r.get("first_step_s", 0.0), 3),
                        samples_on_rank=r["samples"],
                        shards_on_rank=r["shards"],
                        index_bytes_per_sample=round(r["index_bytes_per_sample"], 1),
                        peak_rss_mb=round(r["peak_rss_mb"], 1),
                        goal_seconds=30,
                    )
                )
            rows.append(
                _growth(
                    "trainer start-up (index + step predictor)",
                    "samples",
                    data_part,
                    ranks=world,
                    samples_per_shard=spp,
                    goal_data_part_100k_over_10k="<= 2x",
                    rounds=ROUNDS,
                    data_part_ratio=_ratio(data_part, 100_000, 10_000),
                    data_part_ratio_of_rounds=paired,
                )
            )

    # the same 10k samples as one version and as 100 (issue 55.8: <= 1.2x)
    rows.append(versions_startup(merged[10_000][0], rounds=3 if quick else ROUNDS))

    # remote: first step with the cache at 10% of the dataset, against fetching the first two shards
    from tests.support.range_server import RangeServer
    from trainer.data.storage import fetch

    d = merged[sizes[0]][0]
    manifest = json.loads((d / "manifest.json").read_text())
    total = sum(s["bytes"] for s in manifest["shards"])
    limit = max(total // 10, 2 * max(s["bytes"] for s in manifest["shards"]))  # 10%, or 2 shards of a tiny dataset
    with RangeServer(d) as srv:
        tmp = OUT / "growth" / "two-shards"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.perf_counter()
        for s in manifest["shards"][:2]:
            fetch(f"{srv.url}/{s['name']}", tmp / s["name"], size=s["bytes"], sha256=s["sha256"])
        two = time.perf_counter() - t0
        shutil.rmtree(OUT / "growth" / "run", ignore_errors=True)
        s, r = _startup(f"{srv.url}/", 1, first_step=True, limit=str(limit))
    rows.append(
        emit(
            "growth",
            command="trainer start-up over http",
            samples=sizes[0],
            cache_limit_bytes=limit,
            dataset_bytes=total,
            cache_fraction=round(limit / total, 3),
            first_step_seconds=round(r["first_step_s"], 3),
            to_first_step_seconds=round(r["total_s"], 3),
            two_shards_seconds=round(two, 3),
            first_step_over_two_shards=round(r["first_step_s"] / max(two, 1e-6), 2),
        )
    )
    # the commands that read every sample, last (the slowest)
    times: dict[str, list[tuple[int, float]]] = {}
    for n in sizes:
        d = merged[n][0]
        some_id = f"replica-{n // 2:09d}"
        for command, args in (
            ("stats", ["stats", d, "--json"]),
            ("verify", ["verify", d]),
            ("inspect --id", ["inspect", d, "--id", some_id]),
        ):
            s, rss, _ = _vlmprep(*args)
            times.setdefault(command, []).append((n, s))
            rows.append(emit("growth", command=command, samples=n, seconds=round(s, 3), peak_rss_mb=round(rss, 1)))
    for command, points in times.items():
        rows.append(_growth(command, "samples", points))
    # stats and verify read shards in --workers processes (default: every CPU here): against one, at the first size
    n = sizes[0]
    for command, args in (("stats", ["stats", merged[n][0], "--json"]), ("verify", ["verify", merged[n][0]])):
        one, rss, _ = _vlmprep(*args, "--workers", "1")
        every = dict(times[command])[n]
        rows.append(
            emit(
                "growth",
                command=f"{command} --workers 1 (baseline)",
                samples=n,
                seconds=round(one, 3),
                peak_rss_mb=round(rss, 1),
                default_workers=len(os.sched_getaffinity(0)),
                default_seconds=round(every, 3),
                speedup=round(one / max(every, 1e-6), 2),
            )
        )

    return rows


# --- the trainer's start-up on a dataset of many versions (issue 55.8)

VERSIONS = 100
VERSIONS_GOAL = 1.2  # start-up on VERSIONS versions over start-up on one version of the same samples


def versioned(src: Path, versions: int = VERSIONS) -> Path:
    """src's samples as a dataset of `versions` versions, laid out as `build --append` leaves one
    (docs/datasets-that-grow.md): version k adds the k-th of `versions` runs of src's shards (hard links under the
    version's shard names, sidecars too), its record versions/v00000k.json names every shard of versions 1..k with
    its cumulative sample index, and manifest.json is the last record's byte copy. The same samples in the same
    order as src, so the trainer's start-up on each compares the versions alone."""
    from vlmprep.shards.manifest import ShardEntry
    from vlmprep.shards.reader import load_sample_index
    from vlmprep.shards.writer import write_dataset_index
    from vlmprep_schemas.versions import version_name

    d = OUT / "growth" / f"versions-{versions}-of-{src.name}"
    if (d / "manifest.json").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    (d / "versions").mkdir(parents=True)
    manifest = json.loads((src / "manifest.json").read_text())
    shutil.copytree(src / manifest["processor"]["dir"], d / manifest["processor"]["dir"])
    shards, per = manifest["shards"], -(-len(manifest["shards"]) // versions)
    assert len(shards) >= versions, f"{src}: {len(shards)} shards cannot make {versions} versions"
    have, parts, record = [], [], b""
    for k in range(1, versions + 1):
        added = []
        for j, s in enumerate(shards[(k - 1) * per : k * per]):
            name = s["name"] if k == 1 else f"shard-v{k:06d}-{j:06d}.tar"
            index = {**s["index"], "name": name + ".index.npy"}
            os.link(src / s["name"], d / name)
            os.link(src / s["index"]["name"], d / index["name"])
            have.append({**s, "name": name, "index": index})
            parts.append(load_sample_index(src, ShardEntry.from_json(s)))
            added.append(name)
        if not added:
            break
        samples = sum(s["num_samples"] for s in have)
        index = "samples.index.npy" if k == 1 else f"samples.v{k:06d}.index.npy"
        totals = {**manifest["totals"], "samples": samples}
        rec = {**manifest, "shards": have, "totals": totals}
        rec["sample_index"] = write_dataset_index(d, iter(parts), samples, name=index)
        if k > 1:
            rejects = {"inputs": [], "totals": {"samples": sum(s["num_samples"] for s in have[-len(added) :])}}
            rec["version"] = {
                "number": k,
                "parent": k - 1,
                "created": "2026-12-01T00:00:00Z",
                "command": ["vlmprep", "build", "--append"],
                "added": {**rejects, "shards": added, "rejects": {}, "rejects_file": f"rejects.v{k:06d}.jsonl"},
            }
        record = json.dumps(rec, indent=1, sort_keys=True).encode()
        (d / version_name(k)).write_bytes(record)
    (d / "manifest.json").write_bytes(record)
    return d


def versions_startup(src: Path, versions: int = VERSIONS, rounds: int = ROUNDS) -> dict:
    """The trainer's start-up (open the data, index, predict, the first step's batches; rank 0 of 8) on `src` and on
    its samples as `versions` versions (versioned), alternated in fresh processes, `rounds` each: the medians and
    their ratio against VERSIONS_GOAL."""
    many = versioned(src, versions)
    n = json.loads((src / "manifest.json").read_text())["totals"]["samples"]
    times: dict[str, list[float]] = {"one": [], "many": []}
    parts: dict[str, list[float]] = {"one": [], "many": []}
    for _ in range(rounds):
        for key, path in (("one", src), ("many", many)):
            shutil.rmtree(OUT / "growth" / "run", ignore_errors=True)
            _, r = _startup(str(path), 8, first_step=True)
            times[key].append(r["total_s"])
            parts[key].append(r["open_s"] + r["index_s"] + r["predict_s"])
    one, many_s = statistics.median(times["one"]), statistics.median(times["many"])
    return emit(
        "growth",
        command="trainer start-up over versions",
        samples=n,
        versions=versions,
        ranks=8,
        rounds=rounds,
        one_version_seconds=round(one, 4),
        versions_seconds=round(many_s, 4),
        ratio=round(many_s / max(one, 1e-9), 3),
        data_part_one_version_seconds=round(statistics.median(parts["one"]), 4),
        data_part_versions_seconds=round(statistics.median(parts["many"]), 4),
        goal=f"<= {VERSIONS_GOAL}x",
        met=many_s <= VERSIONS_GOAL * one,
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.bench_growth [--quick] [--versions-only]`: every row, or the versions row alone (a
    dataset of 10k samples, 100 per shard)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_growth")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--versions-only", action="store_true")
    a = ap.parse_args(argv)
    if not a.versions_only:
        run(a.quick)
        return
    n = 10_000  # 100 shards: one a version
    src = planned_dataset(n, 1, real_samples(), plan_inputs(10, n))
    if not (src / "manifest.json").exists():
        _vlmprep("merge", src, "--max-reject-fraction", 1)
    versions_startup(src)


if __name__ == "__main__":
    main()
