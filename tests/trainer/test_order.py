"""The data order (trainer/data/order.py) and its reader (ScheduledStream): sample-level shuffle, weighted mixing, and
the step predictor, in process; the CLI runs (mixture + packing, incompatible mixtures) are at the end."""

import collections
import itertools

import numpy as np
import pytest

from tests.trainer.conftest import (
    build_dataset,
    deadline,
    kill_at_step,
    read_metrics,
    run_trainer,
    trainer_cmd,
    trainer_env,
)
from trainer.data import steps as steps_mod
from trainer.data.batches import StepLoader, sample_loader
from trainer.data.collate import CollateSpec
from trainer.data.index import ShardIndex, index_shard, read_indexed
from trainer.data.order import RankSource, pass_order, schedule
from trainer.data.sources import plan_shards, resolve_data
from trainer.data.steps import rank_steps, token_batches
from trainer.data.streams import EpochSchedule, ScheduledStream
from trainer.options import Batching

SPEC = CollateSpec(pad_id=0, image_token_id=151655, patch_size=14, merge_size=2)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _source(shards, *, name="", weight=1.0, on_end="repeat", stride=(0, 1), owner=-1) -> RankSource:
    return RankSource(
        name,
        weight,
        on_end,
        tuple(shards),
        tuple(index_shard(s.url, expect=s.num_samples) for s in shards),
        stride,
        owner,
    )


def _fake(name, tokens_per_shard, *, weight=1.0, on_end="repeat", trained=None) -> RankSource:
    """A source of synthetic shards (no files): only the counts the order needs."""
    idx = []
    for k, toks in enumerate(tokens_per_shard):
        t = np.asarray(toks, dtype=np.int64)
        tr = t // 2 if trained is None else np.asarray(trained[k], dtype=np.int64)
        idx.append(
            ShardIndex(f"/nonexistent/{name}-{k}.tar", np.zeros(len(t), np.int64), np.zeros(len(t), np.int64), t, tr)
        )
    return RankSource(name, weight, on_end, tuple(range(len(idx))), tuple(idx))


@pytest.fixture(scope="module")
def shards(dataset):
    return list(resolve_data(str(dataset)).shards)


def _pairs(order):
    return list(zip(order[0].tolist(), order[1].tolist()))


def test_a_pass_holds_every_sample_once_is_seeded_and_spreads_each_shard(shards):
    src = _source(shards)
    everything = sorted((k, i) for k, ix in enumerate(src.indexes) for i in range(ix.num_samples))
    kw = dict(seed=3, pass_no=0, shuffle=True, shuffle_shards=True, shuffle_span=0)
    epochs = [_pairs(pass_order(src, epoch=e, **kw)) for e in range(4)]
    assert all(sorted(e) == everything for e in epochs)
    assert epochs[0] == _pairs(pass_order(src, epoch=0, **kw))  # deterministic for (seed, epoch)
    assert len({tuple(e) for e in epochs}) == 4 and _pairs(pass_order(src, epoch=0, **{**kw, "seed": 4})) != epochs[0]
    # Each shard's samples are spread over the epoch, not one run: consecutive positions rarely share a shard.
    same = sum(a[0] == b[0] for e in epochs for a, b in zip(e, e[1:])) / sum(len(e) - 1 for e in epochs)
    assert same < 0.5, same  # a shard-sequential order has 13/17 here
    # --shuffle-span 1: only within each shard, so each shard is one contiguous run of its own samples.
    one = _pairs(pass_order(src, epoch=0, **{**kw, "shuffle_span": 1}))
    runs = [k for k, _ in itertools.groupby(s for s, _ in one)]
    assert sorted(one) == everything and len(runs) == len(shards)
    # No shuffle: exactly the sequential reader's order (shards in manifest order, samples in tar order).
    assert _pairs(pass_order(src, epoch=0, **{**kw, "shuffle": False, "shuffle_shards": False})) == everything


# The schedule of these synthetic sources, as every release so far has made it: a run resumed by a later version
# reads exactly the samples it would have read (a faster pass_order or mixture must not change one position).
PINNED_SCHEDULE = "79fd7ed8dcb40f9e256b536015106c0d9177adef33311798760ee36f1d2ab1f1"


def test_the_schedule_is_the_one_earlier_versions_made():
    import hashlib

    rng = np.random.default_rng(0)
    a = [rng.integers(1, 900, int(n)).tolist() for n in rng.integers(0, 40, 9)]  # shards of 0 to 39 samples
    b = [rng.integers(1, 300, int(n)).tolist() for n in rng.integers(1, 25, 4)]

    def fake(name, tokens, **kw):
        src = _fake(name, tokens, weight=kw.pop("weight", 1.0), on_end=kw.pop("on_end", "repeat"))
        return RankSource(src.name, src.weight, src.on_end, src.shards, src.indexes, **kw)

    h = hashlib.sha256()
    on = dict(shuffle=True, shuffle_shards=True)
    for sources, kw in (
        ([fake("a", a, owner=2)], dict(on, shuffle_span=0)),
        ([fake("a", a, owner=2)], dict(on, shuffle_span=2)),
        ([fake("a", a)], dict(shuffle=False, shuffle_shards=True, shuffle_span=0)),
        ([fake("", a, stride=(1, 3))], dict(on, shuffle_span=0)),
        ([fake("a", a, weight=0.7), fake("b", b, weight=0.3, on_end="stop")], dict(on, shuffle_span=0)),
    ):
        for epoch in (0, 1):
            s = schedule(sources, seed=5, epoch=epoch, **kw)
            for arr in (s.source, s.shard, s.sample):
                h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    assert h.hexdigest() == PINNED_SCHEDULE


def test_ranks_owning_equal_shards_do_not_read_them_in_lockstep(shards):
    """4 shards of 4 samples: ranks 0 and 1 each own two. One permutation for both would read the same slot of
    neighbouring shards at every step (one task of a task-sorted input in one global batch)."""
    kw = dict(seed=0, epoch=0, pass_no=0, shuffle=True, shuffle_shards=True, shuffle_span=0)
    a, b = (_pairs(pass_order(_source(shards[r:4:2], owner=r), **kw)) for r in range(2))
    assert a != b and sorted(a) == sorted(b)  # the same (local shard, sample) slots, in different orders


def test_stride_ranks_take_disjoint_slices_of_one_permutation(shards):
    kw = dict(seed=0, epoch=1, pass_no=0, shuffle=True, shuffle_shards=True, shuffle_span=0)
    full = _pairs(pass_order(_source(shards[:2]), **kw))
    per_rank = [_pairs(pass_order(_source(shards[:2], stride=(r, 3)), **kw)) for r in range(3)]
    assert per_rank == [full[r::3] for r in range(3)]


@pytest.mark.parametrize("start, workers", [(0, 0), (0, 2), (5, 3), (17, 2), (18, 2)])
def test_scheduled_stream_is_the_schedule_for_any_worker_count_and_start(shards, image_spec, start, workers):
    src = [_source(shards)]
    order = schedule(src, seed=1, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=2)
    loader = sample_loader(
        ScheduledStream(src, order, start=start, spec=image_spec), num_workers=workers, prefetch_factor=2
    )
    got = [(s.position, s.key, s.worker) for s in loader]
    want = [
        (p, read_indexed(src[0].indexes[int(order.shard[p])], int(order.sample[p]))[0])
        for p in range(start, len(order))
    ]
    assert [(p, k) for p, k, _ in got] == want
    assert all(w == (p - start) % max(workers, 1) for p, _, w in got)


def test_a_mixture_keeps_each_source_at_its_share_of_trained_tokens():
    rng = np.random.default_rng(0)
    big = _fake("agent", [rng.integers(50, 3000, 40) for _ in range(6)], weight=0.7)
    small = _fake("vqa", [rng.integers(20, 400, 30) for _ in range(2)], weight=0.3)
    order = schedule([big, small], seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=0)
    trained = np.array(
        [[big, small][s].indexes[k].trained[i] for s, k, i in zip(order.source, order.shard, order.sample)]
    )
    mine, total = np.cumsum(trained * (order.source == 0)), np.cumsum(trained)
    # Off by at most one sample's trained tokens at every position, so within 0.02 once 50 samples in.
    assert np.all(np.abs(mine - 0.7 * total) <= trained.max()), np.abs(mine - 0.7 * total).max()
    assert np.all(np.abs(mine / total - 0.7)[100:] < 0.02)
    # The epoch ends when both were read through once: the small set repeats (fresh passes), the big one once.
    seen = collections.Counter(zip(order.source.tolist(), order.shard.tolist(), order.sample.tolist()))
    assert {v for (s, _, _), v in seen.items() if s == 0} == {1} and len([k for k in seen if k[0] == 0]) == 240
    assert len([k for k in seen if k[0] == 1]) == 60 and max(v for (s, _, _), v in seen.items() if s == 1) > 1
    assert (
        schedule([big, small], seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=0).source.tolist()
        == order.source.tolist()
    )


def test_a_stop_source_leaves_the_mixture_once_read_through():
    a = _fake("a", [[100] * 10], weight=0.5, on_end="stop")
    b = _fake("b", [[100] * 50], weight=0.5)
    order = schedule([a, b], seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=0)
    src = order.source.tolist()
    assert src.count(0) == 10 and src.count(1) == 50  # a once, then b alone until it is read through
    assert src[:20].count(0) == 10


def _mixture_loop(sources, **kw):
    """The mixture schedule one position at a time (what schedule() computes with one lexsort): the source whose
    next sample ends earliest on its own clock (trained tokens / weight; ties: the lower source); 'repeat' starts a
    fresh pass, 'stop' leaves; the epoch ends once every source has been read through once."""
    from trainer.data.order import _counts_of

    n = len(sources)
    one = lambda s, k: pass_order(sources[s], pass_no=k, **kw)  # noqa: E731
    cur = [one(s, 0) for s in range(n)]
    trained = [np.maximum(_counts_of(sources[s], "trained", *cur[s]), 1) for s in range(n)]
    at, passes, total = [0] * n, [0] * n, [0.0] * n
    active = [len(cur[s][0]) > 0 for s in range(n)]
    unfinished = {s for s in range(n) if active[s]}
    out = []
    while unfinished:
        s = min(
            (s for s in range(n) if active[s]), key=lambda s: ((total[s] + trained[s][at[s]]) / sources[s].weight, s)
        )
        i = at[s]
        out.append((s, int(cur[s][0][i]), int(cur[s][1][i])))
        total[s] += float(trained[s][i])
        at[s] = i + 1
        if at[s] == len(cur[s][0]):
            unfinished.discard(s)
            if not unfinished:
                break
            if sources[s].on_end == "stop":
                active[s] = False
            else:
                passes[s] += 1
                cur[s] = one(s, passes[s])
                trained[s] = np.maximum(_counts_of(sources[s], "trained", *cur[s]), 1)
                at[s] = 0
    return out


def test_the_mixture_schedule_equals_the_one_position_at_a_time_loop():
    """Random mixtures of 2-4 sources (weights from even to 7:1, 'repeat' and 'stop', empty sources, samples with no
    trained token, equal end times across sources): the lexsort merge gives the loop's positions exactly."""
    rng = np.random.default_rng(1)
    for case in range(60):
        sources = []
        for k in range(int(rng.integers(2, 5))):
            shards = [rng.integers(1, 400, int(rng.integers(0, 8))).tolist() for _ in range(int(rng.integers(1, 4)))]
            trained = [(np.asarray(t) * rng.choice([0, 1, 2, 3]) // 3).tolist() for t in shards]
            if case % 7 == 0:  # all the same: end times tie across sources
                shards, trained = [[100] * 5], [[10] * 5]
            sources.append(
                _fake(
                    f"s{k}",
                    shards,
                    trained=trained,
                    weight=float(rng.choice([1, 2, 3, 7])),
                    on_end=str(rng.choice(["repeat", "stop"])),
                )
            )
        total = sum(src.weight for src in sources)
        sources = [RankSource(s.name, s.weight / total, s.on_end, s.shards, s.indexes) for s in sources]
        kw = dict(seed=case, epoch=case % 3, shuffle=bool(case % 2), shuffle_shards=True, shuffle_span=0)
        order = schedule(sources, **kw)
        assert list(zip(order.source.tolist(), order.shard.tolist(), order.sample.tolist())) == _mixture_loop(
            sources, **kw
        ), case
        assert order.source.dtype == np.int16 and order.shard.dtype == order.sample.dtype == np.int32


def _token_batches_loop(lengths, budget: int) -> int:
    """MicroBatcher's rule, one sample at a time (what token_batches computes in numpy)."""
    batches, size, longest = 0, 0, 0
    for n in lengths:
        wider = max(longest, n)
        if size and wider * (size + 1) > budget:
            batches, size, longest = batches + 1, 1, n
        else:
            size, longest = size + 1, wider
    return batches + (size > 0)


@pytest.mark.parametrize("short_batches", [0, steps_mod.SHORT_BATCHES, 1000])
def test_token_batches_equals_the_batchers_loop(short_batches, monkeypatch):
    """Each of its paths (every start's batch size at once for short batches: by the table of range maxima, or by
    passes where no batch can hold more than SHORT_BATCHES samples (0: never; 1000: always here); one window search
    per batch for long ones), on random lengths with and without zeros, samples longer than the budget and budgets
    from 1 to 2^31."""
    monkeypatch.setattr(steps_mod, "SHORT_BATCHES", short_batches)
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n, top, low = int(rng.integers(0, 300)), int(rng.choice([2, 10, 1000, 20000])), int(rng.choice([0, 1, 50]))
        lengths, budget = rng.integers(low, low + top, n), int(rng.choice([1, 5, 100, 8192, 40000, 65536, 2**31 - 2]))
        assert token_batches(lengths, max_tokens_per_batch=budget) == _token_batches_loop(lengths.tolist(), budget)
    long = rng.integers(1, 400, 20000)  # hundreds of samples a batch: the window walk, past its first window
    assert token_batches(long, max_tokens_per_batch=65536) == _token_batches_loop(long.tolist(), 65536)


@pytest.mark.parametrize("batching", [dict(pack_to=2048, pack_window=4), dict(max_tokens_per_batch=600), dict()])
def test_predicted_steps_equal_the_steps_the_loader_gives(shards, image_spec, batching):
    plan = plan_shards(tuple(shards), 2)
    sources = [[_source([shards[i] for i in plan.per_rank[r]])] for r in range(2)]
    batching = Batching(micro_batch_size=2, grad_accum=2, **batching)
    for epoch in range(2):
        predicted = max(
            rank_steps(
                schedule(src, seed=5, epoch=epoch, shuffle=True, shuffle_shards=True, shuffle_span=0).tokens(src),
                batching,
            )
            for src in sources
        )
        loaders = [
            StepLoader(
                EpochSchedule(src, spec=image_spec, seed=5, shuffle=True, shuffle_shards=True, shuffle_span=0),
                collate_spec=SPEC,
                batching=batching,
                num_workers=0,
                prefetch_factor=2,
            )
            for src in sources
        ]
        for ld in loaders:
            ld.start(epoch, 0)
        steps, seen = 0, []
        while True:
            got = [b for ld in loaders for b in ld.next_step()]
            if not any(b.num_samples for b in got):
                break
            steps += 1
            seen += [i for b in got for i in b.sample_ids]
        assert steps == predicted and sorted(seen) == sorted(set(seen)) and len(seen) == 18, (epoch, steps, predicted)


@pytest.mark.slow  # a CLI training run (make-test budget); in process: test_predicted_steps_equal_the_steps_the_loader_gives
def test_mixture_with_packing_runs_its_predicted_steps_and_logs_per_source(dataset, traces, tmp_path):
    """Two datasets (one built with another --seq-len, same processor) at 0.7/0.3, packed, --epochs 1 and no
    --max-steps: the run takes exactly the predicted steps and reports tokens and loss per source."""
    other = build_dataset(traces, tmp_path / "seq1024", seq_len=1024, samples_per_shard=3, truncate=True)
    out = tmp_path / "run"
    proc = run_trainer(
        [
            "--data",
            f"name=agent,path={dataset},weight=0.7",
            "--data",
            f"name=short,path={other},weight=0.3",
            "--out",
            out,
            "--pack-to",
            2048,
            "--pack-window",
            8,
            "--num-workers",
            2,
            "--micro-batch-size",
            2,
        ]
    )
    metrics = read_metrics(out)
    line = next(ln for ln in proc.stderr.splitlines() if "predicted steps per epoch" in ln)
    assert line.endswith(f"(total {len(metrics)})"), (line, len(metrics))
    assert "mixture by share of trained tokens: agent weight 0.700" in proc.stderr
    assert all(set(m["tokens_by_source"]) == {"agent", "short"} for m in metrics)
    assert all(sum(m["tokens_by_source"].values()) == m["num_trained_tokens"] for m in metrics)
    assert {i.split("/", 1)[0] for m in metrics for i in m["sample_ids"]} == {"agent", "short"}
    # Same trained tokens in both: at 0.3, 'short' sets the epoch's length and is read once; 'agent' repeats.
    short = [i for m in metrics for i in m["sample_ids"] if i.startswith("short/")]
    agent = collections.Counter(i for m in metrics for i in m["sample_ids"] if i.startswith("agent/"))
    assert len(short) == len(set(short)) == 18 and len(agent) == 18 and max(agent.values()) >= 2
    shares = sum(m["tokens_by_source"]["agent"] for m in metrics) / sum(m["num_trained_tokens"] for m in metrics)
    assert shares == pytest.approx(0.7, abs=0.03)
    assert "realized trained-token shares" in proc.stderr


@pytest.mark.slow  # a CLI training run (make-test budget); in process: test_predicted_steps_equal_the_steps_the_loader_gives
def test_one_packed_dataset_runs_its_predicted_steps_without_max_steps(dataset, tmp_path):
    out = tmp_path / "run"
    proc = run_trainer(
        ["--data", dataset, "--out", out, "--pack-to", 2048, "--pack-window", 6, "--epochs", 1, "--num-workers", 2]
    )
    metrics = read_metrics(out)
    assert f"predicted steps per epoch: {len(metrics)} (total {len(metrics)})" in proc.stderr
    seen = [i for m in metrics for i in m["sample_ids"]]
    assert len(seen) == len(set(seen)) == 18 and len(metrics) >= 2  # exactly one epoch
    from trainer.train import lr_at

    # The cosine was given exactly the steps run as its length.
    assert [m["lr"] for m in metrics] == [
        lr_at(k, lr=2e-5, warmup_steps=0, total=len(metrics), min_lr_ratio=0.1) for k in range(len(metrics))
    ]


@pytest.mark.slow  # make-test budget: builds a qwen3-vl dataset (~12 s)
def test_an_incompatible_mixture_is_refused_before_any_step(dataset, traces, tmp_path):
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    qwen3 = tmp_path / "qwen3"
    build(
        BuildConfig(
            inputs=(str(traces),),
            out=str(qwen3),
            processor="builtin:qwen3-vl",
            seq_len=2048,
            progress=False,
            max_reject_fraction=1.0,
            min_turn_coverage=0.0,
        )
    )
    import subprocess

    from tests.trainer.conftest import ROOT

    proc = subprocess.run(
        trainer_cmd(
            [
                "--data",
                f"name=agent,path={dataset},weight=0.5",
                "--data",
                f"name=docs,path={qwen3},weight=0.5",
                "--out",
                tmp_path / "run",
            ],
            1,
        ),
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("trainer: error")]
    assert len(err) == 1 and "'agent'" in err[0] and "'docs'" in err[0] and "incompatible processors" in err[0], err
    assert "family Qwen2VLProcessor vs Qwen3VLProcessor" in err[0] and "image processor" in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # make test-all; long in make test (issue 33's 8-minute budget)
def test_mixed_datasets_must_agree_on_the_video_processors_pixel_math_not_on_frame_sampling(dataset, tmp_path):
    import json
    import shutil

    from trainer.data.processors import processor_difference
    from trainer.data.sources import DataSource

    def variant(name: str, **video) -> DataSource:
        """The dataset's saved processor with its video processor changed (None: removed)."""
        out = tmp_path / name
        shutil.copytree(dataset / "processor", out)
        cfg = json.loads((out / "processor_config.json").read_text())
        if video.pop("remove", False):
            del cfg["video_processor"]
        cfg["video_processor"] = cfg.get("video_processor") and {**cfg["video_processor"], **video}
        (out / "processor_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
        return DataSource(shards=(), processor=str(out), manifest=base.manifest)

    base = resolve_data(str(dataset))
    # Frames are stored sampled and resized: other sampling or budgets train the same pixels.
    assert processor_difference(base, variant("fps", fps=1.0, max_frames=8, max_pixels=9999)) == []
    diff = processor_difference(base, variant("mean", image_mean=[0.5, 0.5, 0.5]))
    assert len(diff) == 1 and diff[0].startswith("video processor "), diff
    diff = processor_difference(base, variant("none", remove=True))
    assert len(diff) == 1 and diff[0].startswith("video processor ") and diff[0].endswith(" vs none"), diff


@pytest.mark.slow  # two 200-step runs (one killed and resumed): ~6 min on 2 cores
def test_a_mixture_over_200_steps_holds_its_shares_and_resumes_bit_exactly(dataset, tmp_path):
    from scripts.demo_traces import write_traces

    traces = tmp_path / "other.jsonl.zst"
    write_traces(
        traces,
        n=12,
        seed=7,
        min_images=1,
        max_images=2,
        width=192,
        height=160,
        overlong_fraction=0.0,
        text_only_fraction=0.5,
    )
    other = build_dataset(traces, tmp_path / "other", samples_per_shard=5)
    args = [
        "--data",
        f"name=agent,path={dataset},weight=0.7",
        "--data",
        f"name=chat,path={other},weight=0.3",
        "--max-steps",
        200,
        "--save-every",
        50,
        "--micro-batch-size",
        1,
        "--seed",
        3,
    ]
    ref_dir = tmp_path / "ref"
    run_trainer([*args, "--out", ref_dir, "--num-workers", 1], timeout=900)
    ref = read_metrics(ref_dir)
    assert len(ref) == 200 and max(m["epoch"] for m in ref) >= 2  # several mixture epochs
    agent = sum(m["tokens_by_source"]["agent"] for m in ref) / sum(m["num_trained_tokens"] for m in ref)
    assert abs(agent - 0.7) <= 0.02, agent

    out = tmp_path / "killed"
    kill_at_step([*args, "--num-workers", 1], out, 120, tmp_path / "killed.log")
    assert (out / "checkpoints" / "step-00000100").is_dir() and not (out / "checkpoints" / "step-00000150").exists()
    proc = run_trainer([*args, "--out", out, "--num-workers", 3], timeout=900)
    assert "resumed from" in proc.stderr
    got = read_metrics(out)
    keys = ("step", "epoch", "sample_ids", "loss", "grad_norm", "tokens_by_source", "loss_by_source")
    assert [[m[k] for k in keys] for m in got] == [[m[k] for k in keys] for m in ref]  # bit-exact


def test_pipe_shards_are_indexed_by_streaming_and_cached_once_when_read(dataset, image_spec, tmp_path):
    """A pipe: shard has no manifest, so no sample index: it is indexed by streaming its tar once (nothing stored);
    the shard cache copies it when the schedule reads it (once: another epoch reuses the copy), and the schedule
    and the samples equal those of the local shards."""
    from trainer.config import DataSpec
    from trainer.data.cache import ShardCache
    from trainer.data.pipeline import rank_sources

    local = resolve_data(str(dataset))
    piped = resolve_data(f"pipe:cat {dataset}/shard-{{000000..000004}}.tar")
    cache = tmp_path / "cache"
    srcs, derived = zip(
        *[
            rank_sources((DataSpec(path="x"),), [d], [plan_shards(d.shards, 1)], rank=0, world=1, cache=cache)
            for d in (local, piped)
        ]
    )
    assert derived == (0, 5) and not cache.exists()  # the local shards' sidecars; nothing copied yet
    orders = [schedule(s, seed=2, epoch=1, shuffle=True, shuffle_shards=True, shuffle_span=0) for s in srcs]
    shard_cache = ShardCache(srcs[1], cache)

    def read(src, order, view=None):
        return [s.id for s in ScheduledStream(src, order, start=0, spec=image_spec, cache=view)]

    try:
        shard_cache.begin(orders[1], 0, 0)
        assert read(srcs[0], orders[0]) == read(srcs[1], orders[1], shard_cache.view)
        copies = sorted(cache.glob("*.tar"))
        assert len(copies) == 5 and len(read(srcs[0], orders[0])) == 18
        mtimes = [p.stat().st_mtime_ns for p in copies]
        shard_cache.begin(orders[1], 0, 0)
        read(srcs[1], orders[1], shard_cache.view)
        assert [p.stat().st_mtime_ns for p in copies] == mtimes and shard_cache.fetched == 5  # not fetched again
    finally:
        shard_cache.close()


def test_the_epoch_size_estimate_is_the_schedules_length():
    """order.epoch_size, from counts alone, gives the length schedule() builds (within a sample per source), for a
    repeating source, a 'stop' one and one with no samples on this rank."""
    rng = np.random.default_rng(1)
    big = _fake("big", [rng.integers(50, 3000, 40) for _ in range(3)], weight=0.2)
    small = _fake("small", [rng.integers(20, 400, 30)], weight=0.8)
    stop = _fake("stop", [[100] * 5], weight=0.8, on_end="stop")
    empty = _fake("empty", [[]], weight=0.5)
    from trainer.data.order import epoch_size

    for sources in ([big, small], [small, big], [big, stop], [big, small, empty], [big]):
        n = len(schedule(sources, seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=0))
        size = epoch_size(sources)
        assert abs(size.positions - n) <= len(sources), ([s.name for s in sources], size, n)
        assert size.positions < size.limit
    assert epoch_size([big, small]).last == 0 and epoch_size([big, small]).passes[1] > 1


def test_a_tiny_mixture_weight_is_refused_at_once_not_predicted_forever():
    """Weight 1e-12 is a valid number, but its epoch (every dataset read through once) is ~1e12 times the data:
    the run stops at start-up with one line naming the dataset and the fix, even with --max-steps 1. Before,
    the step prediction built that schedule position by position and never returned."""
    import torch

    from trainer.config import ConfigError, TrainConfig
    from trainer.data.steps import predict_steps as predict
    from trainer.options import Batching, DataOptions

    def predict_steps(cfg, sources, device):  # as make_loader calls it
        return predict(
            sources, DataOptions.of(cfg), Batching.of(cfg), specs=cfg.sources, epochs=cfg.epochs, device=device
        )

    cfg = TrainConfig(data=("name=a,path=x", "name=b,path=y,weight=1e-12"), tiny_random="qwen2-vl", max_steps=1)
    a, b = _fake("a", [[500] * 20], weight=1 / (1 + 1e-12)), _fake("b", [[500] * 20], weight=1e-12 / (1 + 1e-12))
    with (
        deadline(30),
        pytest.raises(
            ConfigError,
            match=r"one epoch would read about 2e\+13 samples on this rank \("
            r"its datasets hold 40 there\).*'b' \(weight 1e-12\) is read "
            r"through only after a 1e\+12 times: raise b's weight",
        ),
    ):
        predict_steps(cfg, [a, b], torch.device("cpu"))
    # Weights apart but the epoch bounded: predicted as before.
    cfg = TrainConfig(data=("name=a,path=x", "name=b,path=y,weight=0.05"), tiny_random="qwen2-vl")
    steps, first = predict_steps(
        cfg, [_fake("a", [[500] * 20], weight=0.95), _fake("b", [[500] * 20], weight=0.05)], torch.device("cpu")
    )
    assert steps == [len(first)] and 20 * 19 <= len(first) <= 20 * 19 + 21


@pytest.mark.slow  # a trainer start-up up to the loader (model, FSDP); in process: the test above
def test_a_tiny_mixture_weight_stops_the_trainer_with_one_line(dataset, tmp_path, capsys):
    from trainer.train import main

    with deadline(300):
        assert (
            main(
                [
                    "--data",
                    f"name=a,path={dataset}",
                    "--data",
                    f"name=b,path={dataset},weight=1e-12",
                    "--out",
                    str(tmp_path / "run"),
                    "--tiny-random",
                    "qwen2-vl",
                    "--no-progress",
                    "--max-steps",
                    "1",
                    "--num-workers",
                    "0",
                    "--no-tensorboard",
                ]
            )
            == 1
        )
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trainer: error")]
    assert len(err) == 1 and "raise b's weight" in err[0], err


def test_a_dataset_with_0_samples_in_a_mixture_is_refused(dataset, tmp_path):
    """Its realized share would be 0.0 against its weight, in silence: refused at start-up, naming it and the fix.
    One dataset alone with 0 samples is left to the run's own 'yielded no samples'."""
    import json
    import shutil

    from tests.trainer.conftest import open_data_of
    from trainer.config import ConfigError, TrainConfig

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copytree(dataset / "processor", empty / "processor")
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest.update(shards=[], totals={**manifest["totals"], "samples": 0})
    (empty / "manifest.json").write_text(json.dumps(manifest))
    cfg = TrainConfig(data=(f"name=full,path={dataset},weight=3", f"name=none,path={empty}"), tiny_random="qwen2-vl")
    with pytest.raises(
        ConfigError,
        match=rf"dataset 'none' \({empty}\) holds 0 samples, so the mixture cannot give "
        r"it its weight 0.25 of the trained tokens: drop it from --data",
    ):
        open_data_of(cfg)
    assert open_data_of(TrainConfig(data=str(empty), tiny_random="qwen2-vl")).datasets[0].shards == ()
