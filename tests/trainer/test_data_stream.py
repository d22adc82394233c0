import pytest

from trainer.data.batches import StepLoader, sample_loader
from trainer.data.collate import CollateSpec
from trainer.data.errors import DataError
from trainer.data.sources import ShardRef, plan_shards, resolve_data
from trainer.data.steps import steps_per_epoch
from trainer.data.streams import RankStream, ShardSequence, epoch_shards
from trainer.options import Batching

SPEC = CollateSpec(pad_id=0, image_token_id=151655, patch_size=14, merge_size=2)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _read(shards, spec, *, start=0, workers=0):
    loader = sample_loader(RankStream(shards, start=start, spec=spec), num_workers=workers, prefetch_factor=2)
    return [(s.position, s.id, s.worker) for s in loader]


@pytest.fixture(scope="module")
def shards(dataset):
    return list(resolve_data(str(dataset)).shards)


def test_order_is_the_same_for_any_worker_count_and_workers_are_disjoint(shards, image_spec):
    ref = _read(shards, image_spec)
    assert [p for p, _, _ in ref] == list(range(18)) and len({i for _, i, _ in ref}) == 18
    for workers in (1, 2, 3):
        got = _read(shards, image_spec, workers=workers)
        assert [(p, i) for p, i, _ in got] == [(p, i) for p, i, _ in ref], workers
        assert all(w == p % workers for p, _, w in got)  # worker w decoded exactly positions p % W == w


@pytest.mark.parametrize("start, workers", [(5, 2), (8, 3), (17, 2), (18, 2), (3, 0)])
def test_resume_position_continues_the_same_stream(shards, image_spec, start, workers):
    ref = _read(shards, image_spec)
    got = _read(shards, image_spec, start=start, workers=workers)
    assert [(p, i) for p, i, _ in got] == [(p, i) for p, i, _ in ref[start:]]
    assert all(w == (p - start) % max(workers, 1) for p, _, w in got)


def test_manifest_count_mismatch_is_detected(shards, image_spec):
    lying = [ShardRef(shards[0].url, shards[0].name, 5, shards[0].num_tokens)]
    with pytest.raises(DataError, match="holds 4 samples but the manifest says 5"):
        _read(lying, image_spec)


def test_epoch_shard_order_is_seeded(shards):
    a = epoch_shards(shards, epoch=0, seed=3, shuffle_shards=True)
    assert a == epoch_shards(shards, epoch=0, seed=3, shuffle_shards=True)
    assert sorted(s.name for s in a) == [s.name for s in shards]
    assert any(epoch_shards(shards, epoch=e, seed=3, shuffle_shards=True) != a for e in range(1, 5))
    assert epoch_shards(shards, epoch=2, seed=3, shuffle_shards=False) == shards


def test_pad_policy_gives_every_rank_the_same_steps_and_drops_nothing(shards, image_spec):
    plan = plan_shards(tuple(shards), 2)
    assert plan.rank_samples == (8, 10)  # 5 uneven shards, balanced by tokens, not samples
    batching = Batching(micro_batch_size=2, grad_accum=2)
    loaders = [
        StepLoader(
            ShardSequence([shards[i] for i in plan.per_rank[r]], spec=image_spec, seed=0, shuffle_shards=False),
            collate_spec=SPEC,
            batching=batching,
            num_workers=0,
            prefetch_factor=2,
        )
        for r in range(2)
    ]
    for ld in loaders:
        ld.start(0, 0)
    n_steps = steps_per_epoch(list(plan.rank_samples), batching)
    seen = []
    for _ in range(n_steps):
        steps = [ld.next_step() for ld in loaders]
        assert all(len(mbs) == 2 for mbs in steps)
        seen += [i for mbs in steps for b in mbs for i in b.sample_ids]
    assert n_steps == 3 and len(seen) == len(set(seen)) == 18
    assert all(b.num_samples == 0 for ld in loaders for b in ld.next_step())  # then only empty micro-batches


@pytest.mark.parametrize("start, workers", [(0, 0), (0, 2), (2, 3)])
def test_stride_mode_splits_samples_across_ranks_for_any_workers(shards, image_spec, start, workers):
    ref = [i for _, i, _ in _read(shards[:2], image_spec)]
    per_rank = []
    for r in range(3):
        loader = sample_loader(
            RankStream(shards[:2], start=start, spec=image_spec, stride=(r, 3)), num_workers=workers, prefetch_factor=2
        )
        got = [(s.position, s.id) for s in loader]
        assert [p for p, _ in got] == list(range(start, start + len(got)))
        per_rank.append([i for _, i in got])
    assert per_rank == [ref[r::3][start:] for r in range(3)]


def _pixels(samples):
    return [
        (s.position, [bytes(memoryview(im.numpy() if hasattr(im, "numpy") else im)) for im in s.images])
        for s in samples
    ]


@pytest.mark.parametrize("hold", [0, 5, 99])
def test_worker_images_equal_in_process_decode_whether_slabs_are_reused_or_held(shards, image_spec, hold, monkeypatch):
    """Workers decode into reused shared-memory slabs: a slab is rewritten only after the training process
    dropped every view of it. Holding `hold` samples, each image must still read what it read on arrival."""
    import collections
    import hashlib

    ref = _pixels(sample_loader(RankStream(shards, start=0, spec=image_spec), num_workers=0, prefetch_factor=2))
    assert sum(len(ims) for _, ims in ref) > 0
    monkeypatch.setattr("trainer.data.batches.SLABS_PER_WORKER", 3)  # fewer slabs than image samples per worker
    loader = sample_loader(RankStream(shards, start=0, spec=image_spec), num_workers=2, prefetch_factor=2)
    held, got = collections.deque(), []

    def digest(s):
        return [hashlib.sha256(memoryview(im.numpy())).hexdigest() for im in s.images]

    for s in loader:
        held.append((s, digest(s)))
        got.append(_pixels([s])[0])
        while len(held) > hold:
            old, d = held.popleft()
            assert digest(old) == d, f"sample {old.position} changed while it was held"
    for old, d in held:
        assert digest(old) == d, f"sample {old.position} changed while it was held"
    assert got == ref
    if hold == 0:
        assert loader.pool.reused > 0  # the transport really reuses slabs
    if hold == 99:
        assert loader.pool.fresh > 0  # more held samples than slabs: fresh segments, still correct


def test_the_shard_plan_is_longest_first_to_the_least_loaded_rank():
    """plan_shards picks the least-loaded rank (ties: fewer shards, lower rank) from a heap: the same plan as the
    scan over every rank per shard it replaced (O(shards x ranks): 0.6 s for 10^4 shards on 64 ranks)."""
    import random

    def scan(shards, world):
        weight = [s.num_tokens if s.num_tokens is not None else 1 for s in shards]
        loads, owned = [0] * world, [[] for _ in range(world)]
        for i in sorted(range(len(shards)), key=lambda i: (-weight[i], i)):
            r = min(range(world), key=lambda k: (loads[k], len(owned[k]), k))
            owned[r].append(i)
            loads[r] += weight[i]
        return tuple(tuple(sorted(o)) for o in owned), tuple(loads)

    rnd = random.Random(7)
    for _ in range(300):
        world = rnd.randint(1, 12)
        shards = tuple(
            ShardRef(f"s{i}.tar", f"s{i}.tar", rnd.randint(1, 5), rnd.choice([None, 0, 5, rnd.randint(0, 999)]))
            for i in range(rnd.randint(world, 80))
        )
        plan = plan_shards(shards, world)
        assert (plan.per_rank, plan.rank_tokens) == scan(shards, world)
