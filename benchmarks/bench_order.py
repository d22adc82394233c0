"""Data-order benchmark (issue 24): same-trajectory sample pairs per global batch on the demo traces built with
--long-traces split (8 simulated ranks: the trainer's schedule and Packer, checked against real StepLoaders), without
vs with the sample shuffle vs a uniform random order; realized trained-token shares of a 0.7/0.3 mixture (real
StepLoaders); sample_loader samples/s with and without the shuffle, host RSS (main process + workers) per
--shuffle-span. Built inputs are cached under bench-out/ (the first run renders and builds them: minutes)."""

from __future__ import annotations

import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.bench_build import timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces

WORLD = 8
SEED = 0


def cached_build(inp: Path, name: str, **kw) -> Path:
    """timed_build once per (input, options): the demo input alone takes minutes to render and build on 2 cores."""
    ds, stamp = OUT / name, OUT / f"{name}.options.json"
    want = json.dumps({"input": inp.name, **kw}, sort_keys=True)
    if not (stamp.is_file() and stamp.read_text() == want and (ds / "manifest.json").is_file()):
        stamp.unlink(missing_ok=True)
        timed_build(inp, ds, **kw)
        stamp.write_text(want)
    return ds


def trajectories(ds: Path) -> dict[tuple[str, int], tuple[str, str, int]]:
    """(shard name, sample index) -> (sample id, input file, input line): the meta's `source` is the input
    record, which the split samples of one trace share."""
    out = {}
    for s in json.loads((ds / "manifest.json").read_text())["shards"]:
        with tarfile.open(ds / s["name"]) as tf:
            metas = [json.loads(tf.extractfile(m).read()) for m in tf if m.name.endswith(".json")]
        for i, meta in enumerate(metas):
            out[(s["name"], i)] = (meta["id"], meta["source"]["file"], int(meta["source"]["line"]))
    assert len({v[0] for v in out.values()}) == len(out), "sample ids must be unique"
    return out


def _loader_parts(ds: Path):
    from trainer.data.collate import CollateSpec
    from trainer.data.processors import load_image_processor_config
    from trainer.data.sources import resolve_data
    from trainer.data.vision import ImageSpec

    source = resolve_data(str(ds))
    spec = ImageSpec.from_config(load_image_processor_config(source.processor))
    cs = CollateSpec(pad_id=151643, image_token_id=151655, patch_size=spec.patch_size, merge_size=spec.merge_size)
    return source, spec, cs


def rank_setup(datasets: list[tuple[str, Path, float]], *, world: int, cache: Path):
    """As trainer/train.py sets up each rank: plan_shards per dataset, then each rank's indexed sources."""
    from trainer.config import DataSpec
    from trainer.data.pipeline import rank_sources
    from trainer.data.sources import plan_shards

    specs = tuple(DataSpec(path=str(p), name=n, weight=w) for n, p, w in datasets)
    sources = [_loader_parts(p)[0] for _, p, _ in datasets]
    plans = [plan_shards(s.shards, world) for s in sources]
    return (
        sources,
        plans,
        [rank_sources(specs, sources, plans, rank=r, world=world, cache=cache)[0] for r in range(world)],
    )


def rank_loaders(datasets: list[tuple[str, Path, float]], *, world: int, shuffle: bool, cache: Path, **batching):
    """One real StepLoader per simulated rank, as trainer/train.py makes it: the epoch schedule (rank_sources)
    when the sample shuffle is on or several datasets mix, else the rank's shards read in sequence."""
    from trainer.data.batches import StepLoader
    from trainer.data.streams import EpochSchedule, ShardSequence
    from trainer.options import Batching

    sources, plans, per_rank = rank_setup(datasets, world=world, cache=cache)
    _, spec, cs = _loader_parts(datasets[0][1])
    scheduled = shuffle or len(datasets) > 1

    def streams(r: int):
        if scheduled:
            return EpochSchedule(
                per_rank[r], spec=spec, seed=SEED, shuffle=shuffle, shuffle_shards=True, shuffle_span=0
            )
        return ShardSequence(
            [sources[0].shards[i] for i in plans[0].per_rank[r]],
            spec=spec,
            seed=SEED,
            shuffle_shards=True,
            stride=(r, world) if plans[0].stride else (0, 1),
        )

    return [
        StepLoader(streams(r), collate_spec=cs, batching=Batching(**batching), num_workers=0, prefetch_factor=2)
        for r in range(world)
    ]


def global_batches(loaders, epoch: int = 0) -> list[list]:
    """Every optimizer step of one epoch: the micro-batches of all ranks; stops once every rank is exhausted."""
    for ld in loaders:
        ld.start(epoch, 0)
    steps = []
    while True:
        got = [b for ld in loaders for b in ld.next_step()]
        if not any(b.num_samples for b in got):
            return steps
        steps.append(got)


class _Len:
    """What the Packer reads of a sample: its stream position and length."""

    __slots__ = ("position", "num_tokens", "id")

    def __init__(self, position: int, n: int, key):
        self.position, self.num_tokens, self.id = position, n, key


def simulated_steps(
    per_rank: list,
    *,
    epoch: int,
    shuffle: bool,
    pack_to: int,
    pack_window: int = 64,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
) -> list[list[tuple[str, int]]]:
    """The same global batches without decoding a sample: each rank's epoch schedule (with shuffle off, the
    sequential reader's order: its shards in the seeded per-epoch order, samples in tar order), cut by the real
    Packer or by count into micro-batches; a step is grad_accum micro-batches of every rank. Samples are
    (shard name, index in shard)."""
    from trainer.data.order import schedule
    from trainer.data.pack import Packer

    ranks = []
    for sources in per_rank:
        order = schedule(sources, seed=SEED, epoch=epoch, shuffle=shuffle, shuffle_shards=True, shuffle_span=0)
        src = sources[0]
        keys = [(src.shards[k].name, i) for k, i in zip(order.shard.tolist(), order.sample.tolist())]
        lengths = order.tokens(sources).tolist()
        if pack_to:
            packer = Packer(
                (_Len(p, n, k) for p, (n, k) in enumerate(zip(lengths, keys))), capacity=pack_to, window=pack_window
            )
            rows = []
            while (row := packer.next_row()) is not None:
                rows.append([s.id for s in row])
            micro = [sum(rows[i : i + micro_batch_size], []) for i in range(0, len(rows), micro_batch_size)]
        else:
            micro = [keys[i : i + micro_batch_size] for i in range(0, len(keys), micro_batch_size)]
        ranks.append([sum(micro[i : i + grad_accum], []) for i in range(0, len(micro), grad_accum)])
    return [sum((r[s] for r in ranks if s < len(r)), []) for s in range(max(map(len, ranks)))]


def pair_share(batches: list[list], traj: dict) -> tuple[float, int, int]:
    """Same-trajectory pairs / all pairs of samples within a global batch, pooled over the epoch's steps."""
    same = pairs = 0
    for ids in batches:
        counts = Counter(traj[i] for i in ids)
        same += sum(k * (k - 1) // 2 for k in counts.values())
        pairs += len(ids) * (len(ids) - 1) // 2
    return same / max(pairs, 1), same, pairs


def uniform_share(traj: dict) -> float:
    """The expected share for a uniform random order of all samples cut into any batch sizes: each pair in a
    batch is a uniformly drawn pair of samples, so the share is sum_t C(k_t, 2) / C(N, 2) exactly."""
    counts = Counter(traj.values())
    n = len(traj)
    return sum(k * (k - 1) / 2 for k in counts.values()) / (n * (n - 1) / 2)


BATCHINGS = [  # (ranks, label, options); the first is also checked against the real StepLoaders
    (WORLD, "pack_to=T", dict(micro_batch_size=1, grad_accum=1)),
    (WORLD, "pack_to=T,grad_accum=4", dict(micro_batch_size=1, grad_accum=4)),
    (WORLD, "micro_batch_size=1", dict(micro_batch_size=1, grad_accum=1, pack_to=0)),
    (WORLD, "micro_batch_size=4", dict(micro_batch_size=4, grad_accum=1, pack_to=0)),
    (2, "micro_batch_size=4", dict(micro_batch_size=4, grad_accum=1, pack_to=0)),  # the setting
]


def tiled_ranks(ds: Path, copies: int, world: int):
    """The dataset's sample index repeated `copies` times as distinct shards of distinct trajectories (no files:
    the order and the Packer need only token counts), planned over `world` ranks as rank_sources does."""
    from trainer.data.index import ShardIndex, index_shard
    from trainer.data.order import RankSource
    from trainer.data.sources import ShardRef, plan_shards

    source, _, _ = _loader_parts(ds)
    meta = trajectories(ds)
    base = [(s.name, index_shard(s.url)) for s in source.shards]
    refs, indexes, traj = [], {}, {}
    for j in range(copies):
        # Each copy in its own shard order (distinct trajectories per shard name).
        for name, ix in random.Random(j).sample(base, len(base)):
            tname = f"{j}-{name}"
            refs.append(ShardRef(url=tname, name=tname, num_samples=ix.num_samples, num_tokens=int(ix.tokens.sum())))
            indexes[tname] = ShardIndex(tname, ix.starts, ix.ends, ix.tokens, ix.trained)
            traj.update({(tname, i): (j, *meta[(name, i)][1:]) for i in range(ix.num_samples)})
    plan = plan_shards(tuple(refs), world)
    per_rank = []
    for r in range(world):
        shards = tuple(refs) if plan.stride else tuple(refs[i] for i in plan.per_rank[r])
        per_rank.append(
            [
                RankSource(
                    "",
                    1.0,
                    "repeat",
                    shards,
                    tuple(indexes[s.name] for s in shards),
                    (r, world) if plan.stride else (0, 1),
                    -1 if plan.stride else r,
                )
            ]
        )
    return plan, per_rank, traj


def correlation_row(
    data: str, per_rank: list, plan, traj: dict, *, label: str, pack_to: int, epochs: int, batching: dict
) -> dict:
    """Pooled pair shares over `epochs` epochs (each its own permutation) without and with the sample shuffle."""
    c = uniform_share(traj)
    split = Counter(traj.values())
    got = {}
    for shuffle in (False, True):
        runs = [
            simulated_steps(per_rank, epoch=e, shuffle=shuffle, **{"pack_to": pack_to, **batching})
            for e in range(epochs)
        ]
        assert all(sorted(k for st in r for k in st) == sorted(traj) for r in runs), "each sample once per epoch"
        got[shuffle] = (
            pair_share([st for r in runs for st in r], traj),
            float(np.mean([len(r) for r in runs])),
            float(np.mean([len(st) for r in runs for st in r])),
        )
    (a, _, _), (b, steps, size) = got[False], got[True]
    return emit(
        "order",
        metric="batch_correlation",
        data=data,
        batching=label.replace("T", str(pack_to)),
        ranks=len(per_rank),
        plan="stride" if plan.stride else "shards",
        samples=len(traj),
        trajectories=len(split),
        split_trajectories=sum(k > 1 for k in split.values()),
        epochs=epochs,
        steps_per_epoch=round(steps, 2),
        mean_global_batch_samples=round(size, 2),
        share_no_shuffle=round(a[0], 5),
        share_shuffle=round(b[0], 5),
        share_uniform=round(c, 5),
        ratio_shuffle_vs_uniform=round(b[0] / c, 3),
        ratio_no_shuffle_vs_uniform=round(a[0] / c, 3),
        same_pairs_no_shuffle=a[1],
        same_pairs_shuffle=b[1],
        pairs=b[2],
        goal_ratio_shuffle_vs_uniform=1.5,
    )


def correlation(ds: Path, pack_to: int, epochs: int, copies: int) -> list[dict]:
    meta = trajectories(ds)
    traj = {k: v[1:] for k, v in meta.items()}
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        setups = {}
        for world in sorted({w for w, _, _ in BATCHINGS}):
            _, plans, per_rank = rank_setup([("", ds, 1.0)], world=world, cache=Path(cache))
            setups[world] = (plans[0], per_rank)
        # The simulation is the trainer's order: epoch 0 of the first batching equals the real loaders' batches.
        for shuffle in (False, True):
            loaders = rank_loaders(
                [("", ds, 1.0)],
                world=WORLD,
                shuffle=shuffle,
                cache=Path(cache),
                pack_to=pack_to,
                pack_window=64,
                max_tokens_per_batch=0,
                micro_batch_size=1,
                grad_accum=1,
            )
            real = [[i for b in step for i in b.sample_ids] for step in global_batches(loaders)]
            sim = simulated_steps(setups[WORLD][1], epoch=0, shuffle=shuffle, pack_to=pack_to)
            assert real == [[meta[k][0] for k in step] for step in sim], f"simulation != StepLoader (shuffle={shuffle})"
    for world, label, batching in BATCHINGS:
        plan, per_rank = setups[world]
        rows.append(
            correlation_row(
                "demo", per_rank, plan, traj, label=label, pack_to=pack_to, epochs=epochs, batching=batching
            )
        )
    # The demo gives a rank ~13 samples, fewer than the packing window: the same traces as 16 copies give it ~200.
    for world, label, batching in BATCHINGS:
        plan, per_rank, ttraj = tiled_ranks(ds, copies, world)
        rows.append(
            correlation_row(
                f"demo_x{copies}",
                per_rank,
                plan,
                ttraj,
                label=label,
                pack_to=pack_to,
                epochs=max(epochs // 2, 1),
                batching=batching,
            )
        )
    return rows


def sorted_input(ds: Path, *, shards: int, per_shard: int, tasks: int, epochs: int) -> list[dict]:
    """An input sorted by task (most are): `shards` equal shards of `per_shard` samples (lengths drawn from the
    dataset's), task = which of `tasks` equal runs of the input a sample is in; 8 ranks, same-task pairs within a
    global batch without vs with the shuffle vs uniform. Equal shards give every rank the same sample count."""
    from trainer.data.index import ShardIndex, index_shard
    from trainer.data.order import RankSource
    from trainer.data.sources import ShardRef, plan_shards

    source, _, _ = _loader_parts(ds)
    pool = [
        (int(t), int(r)) for s in source.shards for ix in [index_shard(s.url)] for t, r in zip(ix.tokens, ix.trained)
    ]
    rng = random.Random(SEED)
    refs, indexes, task = [], {}, {}
    for k in range(shards):
        picks = [rng.choice(pool) for _ in range(per_shard)]
        toks, trained = (np.array(v, dtype=np.int64) for v in zip(*picks))
        name = f"sorted-{k:05d}"
        refs.append(ShardRef(url=name, name=name, num_samples=per_shard, num_tokens=int(toks.sum())))
        zero = np.zeros(per_shard, dtype=np.int64)
        indexes[name] = ShardIndex(name, zero, zero, toks, trained)
        task.update({(name, i): (k * per_shard + i) * tasks // (shards * per_shard) for i in range(per_shard)})
    plan = plan_shards(tuple(refs), WORLD)
    per_rank = [
        [RankSource("", 1.0, "repeat", tuple(refs[i] for i in o), tuple(indexes[refs[i].name] for i in o), (0, 1), r)]
        for r, o in enumerate(plan.per_rank)
    ]
    rows = []
    for label, batching in (
        ("micro_batch_size=1", dict(micro_batch_size=1)),
        ("micro_batch_size=4", dict(micro_batch_size=4)),
    ):
        share = {}
        for shuffle in (False, True):
            runs = [simulated_steps(per_rank, epoch=e, shuffle=shuffle, pack_to=0, **batching) for e in range(epochs)]
            share[shuffle] = pair_share([st for r in runs for st in r], task)[0]
        c = uniform_share(task)
        rows.append(
            emit(
                "order",
                metric="sorted_input_correlation",
                batching=label,
                ranks=WORLD,
                shards=shards,
                samples_per_shard=per_shard,
                tasks=tasks,
                epochs=epochs,
                share_no_shuffle=round(share[False], 4),
                share_shuffle=round(share[True], 4),
                share_uniform=round(c, 4),
                ratio_no_shuffle_vs_uniform=round(share[False] / c, 3),
                ratio_shuffle_vs_uniform=round(share[True] / c, 3),
            )
        )
    return rows


def trained_by_source(batch, n: int) -> np.ndarray:
    """The trainer's tokens_by_source rule (model.forward_loss): targets labels[:, 1:], by their token's source."""
    from trainer.data.collate import token_sources

    keep = batch.loss_mask[:, 1:].bool()
    return np.bincount(token_sources(batch)[:, 1:][keep].numpy(), minlength=n)[:n]


def mixture(datasets: list[tuple[str, Path, float]], ranks: int) -> dict:
    """Real StepLoaders over a weighted mixture, one epoch: trained-token shares per source from the batches (and
    from the schedule's stored counts), overall and, from step 50 on, of the running totals."""
    weights = np.array([w for _, _, w in datasets]) / sum(w for _, _, w in datasets)
    with tempfile.TemporaryDirectory() as cache:
        loaders = rank_loaders(
            datasets,
            world=ranks,
            shuffle=True,
            cache=Path(cache),
            pack_to=0,
            micro_batch_size=1,
            max_tokens_per_batch=0,
            grad_accum=1,
        )
        sched = np.zeros(len(datasets))
        for ld in loaders:  # schedule level: the stored trained-token counts in schedule order
            order = ld.streams.schedule(0)
            for s, src in enumerate(ld.streams.sources):
                at = np.flatnonzero(order.source == s)
                sched[s] += sum(
                    int(ix.trained[order.sample[at[order.shard[at] == k]]].sum()) for k, ix in enumerate(src.indexes)
                )
        steps = global_batches(loaders)
    per_step = np.array([sum(trained_by_source(b, len(datasets)) for b in step) for step in steps], dtype=np.float64)
    cum = per_step.cumsum(0)
    share = cum[-1] / cum[-1].sum()
    early = min(50, len(cum) - 1)
    running = cum[early:] / cum[early:].sum(1, keepdims=True)
    return dict(
        names=[n for n, _, _ in datasets],
        requested=[round(float(w), 4) for w in weights],
        realized=[round(float(x), 4) for x in share],
        schedule_level=[round(float(x), 4) for x in sched / sched.sum()],
        max_abs_error=round(float(np.abs(share - weights).max()), 4),
        max_abs_error_running_from_step=early,
        max_abs_error_running=round(float(np.abs(running - weights).max()), 4),
        steps=len(steps),
        ranks=ranks,
        trained_tokens=[int(x) for x in cum[-1]],
        samples=[int(sum(b.sources.count(s) for step in steps for b in step)) for s in range(len(datasets))],
    )


def loader_pass(ds: str, shuffle: bool, span: int, workers: int = 2, rss: bool = False) -> dict:
    """One epoch of one rank (all shards) through sample_loader; with rss, the peak of main + worker RSS (psutil,
    polled every 20 ms). Sequential: RankStream over the shards in (seeded) order; shuffle: ScheduledStream."""
    import psutil

    from trainer.config import DataSpec
    from trainer.data.batches import sample_loader
    from trainer.data.collate import keep_freed_buffers
    from trainer.data.order import schedule
    from trainer.data.pipeline import rank_sources
    from trainer.data.sources import plan_shards
    from trainer.data.streams import RankStream, ScheduledStream, epoch_shards

    keep_freed_buffers()  # as the trainer does at start-up
    source, spec, _ = _loader_parts(Path(ds))
    t_index = time.perf_counter()
    if shuffle:
        with tempfile.TemporaryDirectory() as cache:
            srcs, _ = rank_sources(
                (DataSpec(path=ds),), [source], [plan_shards(source.shards, 1)], rank=0, world=1, cache=Path(cache)
            )
        order = schedule(srcs, seed=SEED, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=span)
        stream = ScheduledStream(srcs, order, start=0, spec=spec)
    else:
        stream = RankStream(
            epoch_shards(list(source.shards), epoch=0, seed=SEED, shuffle_shards=True), start=0, spec=spec
        )
    t_index = time.perf_counter() - t_index  # the shuffle's start-up cost: reading every shard's sample index
    me, peak, done = psutil.Process(), [0], threading.Event()

    def poll():
        while not done.wait(0.02):
            try:
                procs = [me, *me.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                continue

    if rss:
        threading.Thread(target=poll, daemon=True).start()
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    samples = images = 0
    s = None
    loader = sample_loader(stream, num_workers=workers, prefetch_factor=4)
    for s in loader:
        samples += 1
        images += len(s.images)
    seconds = time.perf_counter() - t0
    done.set()
    del loader, s
    gc.collect()  # the workers are joined (and their CPU time counted) once the iterator is gone
    return dict(
        samples=samples,
        images=images,
        seconds=seconds,
        cpu_seconds=_cpu_seconds() - cpu0,
        rss_mb=peak[0] / 2**20,
        index_seconds=t_index,
    )


def _cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the DataLoader workers): unlike wall time, hardly moved
    by other jobs on a shared box."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _fresh_pass(ds: Path, shuffle: bool, span: int) -> dict:
    """loader_pass in a fresh process: the main process's RSS then holds nothing from earlier benchmarks."""
    code = (
        "import json; from benchmarks.bench_order import loader_pass;"
        f"print(json.dumps(loader_pass({str(ds)!r}, {shuffle}, {span}, rss=True)))"
    )
    res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def throughput(ds: Path, repeats: int) -> list[dict]:
    n_shards = len(json.loads((ds / "manifest.json").read_text())["shards"])
    runs = {False: [], True: []}
    for _ in range(repeats):  # interleaved, so a noisy neighbour hits both alike
        for shuffle in (False, True):
            runs[shuffle].append(loader_pass(str(ds), shuffle, 0))
    med = {k: statistics.median(r["samples"] / r["seconds"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_seconds"] * 1000 / r["samples"] for r in v) for k, v in runs.items()}
    pairwise = [no["seconds"] / sh["seconds"] for no, sh in zip(runs[False], runs[True])]  # passes back to back
    rows = [
        emit(
            "order",
            metric="loader_throughput",
            workers=2,
            shards=n_shards,
            samples=runs[True][0]["samples"],
            images=runs[True][0]["images"],
            repeats=repeats,
            samples_per_s_no_shuffle=round(med[False], 2),
            samples_per_s_shuffle=round(med[True], 2),
            ratio=round(med[True] / med[False], 3),
            ratio_pairwise_median=round(statistics.median(pairwise), 3),
            all_samples_per_s_no_shuffle=[round(r["samples"] / r["seconds"], 1) for r in runs[False]],
            all_samples_per_s_shuffle=[round(r["samples"] / r["seconds"], 1) for r in runs[True]],
            cpu_ms_per_sample_no_shuffle=round(cpu[False], 2),
            cpu_ms_per_sample_shuffle=round(cpu[True], 2),
            cpu_ratio=round(cpu[True] / cpu[False], 3),
            index_seconds_shuffle=round(statistics.median(r["index_seconds"] for r in runs[True]), 3),
            goal_ratio=">= 0.9",
        )
    ]
    rss = {"no_shuffle": _fresh_pass(ds, False, 0)}
    for span in (1, 4, 0):
        rss[f"span_{span or 'all'}"] = _fresh_pass(ds, True, span)
    spans = [v["rss_mb"] for k, v in rss.items() if k.startswith("span")]
    rows.append(
        emit(
            "order",
            metric="loader_rss",
            workers=2,
            shards=n_shards,
            **{f"peak_rss_mb_{k}": round(v["rss_mb"], 1) for k, v in rss.items()},
            **{f"samples_per_s_{k}": round(v["samples"] / v["seconds"], 2) for k, v in rss.items()},
            **{f"cpu_ms_per_sample_{k}": round(v["cpu_seconds"] * 1000 / v["samples"], 2) for k, v in rss.items()},
            rss_max_over_min_spans=round(max(spans) / min(spans), 3),
            goal="flat in the span",
        )
    )
    return rows


def datasets(quick: bool) -> tuple[Path, int, Path]:
    """The demo input (`make demo`: 64 traces, 1280x720) built as docs/build.md's agent-trace split example, its
    pack size, and many small shards of smaller screenshot traces for the loader."""
    if quick:
        demo = cached_build(
            traces(6, width=320, height=200),
            "order-split-quick",
            seq_len=1024,
            long_traces="split",
            samples_per_shard=4,
            workers=1,
        )
        screens = cached_build(
            traces(32, width=320, height=200, max_images=4, overlong_fraction=0.0),
            "order-screens-quick",
            seq_len=16384,
            samples_per_shard=2,
            workers=1,
        )
        return demo, 1024, screens
    demo = cached_build(traces(64), "order-split", seq_len=16384, long_traces="split", samples_per_shard=16, workers=2)
    screens = cached_build(
        traces(256, width=640, height=360, max_images=8, overlong_fraction=0.0),
        "order-screens",
        seq_len=16384,
        samples_per_shard=16,
        workers=2,
    )
    return demo, 16384, screens


def run(quick: bool) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    demo, pack_to, screens = datasets(quick)
    rows = correlation(demo, pack_to, 3 if quick else 50, 2 if quick else 16)
    rows += sorted_input(demo, shards=16 if quick else 160, per_shard=16, tasks=8, epochs=2 if quick else 10)
    # Both datasets mixed 0.7 / 0.3 by trained tokens, 2 ranks, one sample per step: >= 200 steps.
    m = mixture([("screens", screens, 0.7), ("agent", demo, 0.3)], ranks=2)
    rows.append(emit("order", metric="mixture", **m, goal_max_abs_error=0.02, goal_steps=200))
    rows += throughput(screens, 1 if quick else 3)
    return rows
