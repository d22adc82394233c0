"""Packing: best-fit decreasing, the packer's window and its resume state, the packed batch layout, and the
isolation proof: each sample of a packed row gives the logits it gives alone, and a packed step the loss and
gradient norm of the same samples unpacked (tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL; sdpa and eager). Two broken
packings (text positions not reset, so segments attend to each other; MRoPE rows flattened to 1-D) are shown to
fail the same check."""

import dataclasses

import numpy as np
import pytest
import torch

from tests.trainer.conftest import read_all_samples
from tests.trainer.test_model import FAMILIES
from trainer.config import ConfigError
from trainer.data.collate import IGNORE_INDEX, CollateSpec, collate
from trainer.data.decode import DecodedSample
from trainer.data.errors import DataError
from trainer.data.pack import Packer, best_fit_decreasing, collate_packed
from trainer.data.vision import ImageSpec, Patchifier
from trainer.model import build_model, forward_loss, tiny_config
from trainer.options import Batching, ModelOptions

IMG = 151655


def test_best_fit_decreasing_literal():
    # 7 -> new bin0, 5 -> new bin1, 4 -> new bin2, 3 -> bin1 (room 3: the tightest fit), 2 -> bin2 (bin0's room
    # of 1 is too small), 1 -> bin0 (room 1).
    assert best_fit_decreasing([4, 7, 1, 5, 3, 2], 8) == [[1, 2], [3, 4], [0, 5]]
    assert best_fit_decreasing([], 8) == []
    assert best_fit_decreasing([3, 3, 3], 3) == [[0], [1], [2]]


def _fake(position: int, n: int) -> DecodedSample:
    z = np.zeros(n, np.int32)
    return DecodedSample(
        key=str(position),
        id=f"s{position}",
        input_ids=z,
        loss_mask=z.astype(np.uint8),
        mm_token_type_ids=z.astype(np.uint8),
        position_ids=np.zeros((3, n), np.int32),
        image_grid_thw=np.zeros((0, 3), np.int32),
        images=[],
        image_index=[],
        position=position,
    )


def _lengths(n=200, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(50, 1000, n)]


def _rows(packer):
    out = []
    while (row := packer.next_row()) is not None:
        out.append([s.position for s in row])
    return out


@pytest.mark.parametrize("window", [1, 7, 32, 500])
def test_packer_takes_every_sample_once_in_rows_of_at_most_t(window):
    lengths = _lengths()
    rows = _rows(Packer(iter(_fake(i, n) for i, n in enumerate(lengths)), capacity=2048, window=window))
    flat = [p for r in rows for p in r]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[p] for p in r) <= 2048 for r in rows)
    assert all(r == sorted(r) for r in rows)  # stream order inside a row
    again = _rows(Packer(iter(_fake(i, n) for i, n in enumerate(lengths)), capacity=2048, window=window))
    assert again == rows  # deterministic for a given data order
    fill = sum(lengths) / (len(rows) * 2048)
    if window >= 32:
        assert fill >= 0.95, fill
    if window == 1:
        assert rows == [[i] for i in range(len(lengths))]


def test_packer_refuses_a_sample_longer_than_t_and_an_out_of_order_stream():
    with pytest.raises(DataError, match="more than --pack-to 100"):
        Packer(iter([_fake(0, 50), _fake(1, 101)]), capacity=100, window=4).next_row()
    with pytest.raises(DataError, match="out of order"):
        Packer(iter([_fake(0, 50), _fake(2, 10)]), capacity=100, window=4).next_row()


@pytest.mark.parametrize("window", [5, 32])
def test_packer_state_resumes_with_exactly_the_rows_of_an_uninterrupted_run(window):
    lengths = _lengths(120, seed=1)
    ref = _rows(Packer(iter(_fake(i, n) for i, n in enumerate(lengths)), capacity=2048, window=window))
    for cut in range(len(ref) + 1):
        a = Packer(iter(_fake(i, n) for i, n in enumerate(lengths)), capacity=2048, window=window)
        head = [[s.position for s in a.next_row()] for _ in range(cut)]
        state = a.state()
        start = Packer.resume_start(state)
        b = Packer(
            iter(_fake(i, lengths[i]) for i in range(start, len(lengths))), capacity=2048, window=window, state=state
        )
        assert head + _rows(b) == ref, cut


def test_packer_state_must_match_the_pack_options():
    a = Packer(iter(_fake(i, 10) for i in range(10)), capacity=100, window=4)
    a.next_row()
    with pytest.raises(ConfigError, match="--pack-to 100 --pack-window 4"):
        Packer(iter([]), capacity=200, window=4, state=a.state())


# --- isolation -------------------------------------------------------------------------------------------------


def _synthetic(key: str, parts: list, *, patch: int, seed: int) -> DecodedSample:
    """A sample from text runs (int: that many tokens) and images ((h, w) merged tokens), MRoPE positions laid
    out as get_rope_index does: an image at t=start, h=start+i, w=start+j; text resumes at start + max(h, w)."""
    rng = np.random.default_rng(seed)
    ids, mm, pos, grids, images = [], [], [[], [], []], [], []
    nxt = 0
    for part in parts:
        if isinstance(part, int):
            ids += [int(x) for x in rng.integers(10, 5000, part)]
            mm += [0] * part
            for k in range(3):
                pos[k] += list(range(nxt, nxt + part))
            nxt += part
        else:
            h, w = part
            ids += [IMG] * (h * w)
            mm += [1] * (h * w)
            pos[0] += [nxt] * (h * w)
            pos[1] += [nxt + i for i in range(h) for _ in range(w)]
            pos[2] += [nxt + j for _ in range(h) for j in range(w)]
            nxt += max(h, w)
            grids.append([1, 2 * h, 2 * w])
            images.append(rng.integers(0, 256, (2 * h * patch, 2 * w * patch, 3), dtype=np.uint8))
    n = len(ids)
    loss = (rng.random(n) < 0.6).astype(np.uint8)
    loss[np.array(mm) == 1] = 0
    loss[0] = 1  # a trained first token: packing must still never predict it from the previous sample
    return DecodedSample(
        key=key,
        id=key,
        input_ids=np.array(ids, np.int32),
        loss_mask=loss,
        mm_token_type_ids=np.array(mm, np.uint8),
        position_ids=np.array(pos, np.int32),
        image_grid_thw=np.array(grids, np.int32).reshape(-1, 3),
        images=images,
        image_index=list(range(len(images))),
    )


def _segments(patch: int) -> list[DecodedSample]:
    return [
        _synthetic("two_images", [5, (2, 2), 6, (2, 3), 9], patch=patch, seed=1),
        _synthetic("text_only", [23], patch=patch, seed=2),
        _synthetic("one_image", [4, (2, 2), 12], patch=patch, seed=3),
        _synthetic("text_only_2", [17], patch=patch, seed=4),
        _synthetic("one_image_2", [7, (3, 2), 5], patch=patch, seed=5),
    ]


def _net(family: str, attn: str):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    if family == "qwen2_vl":
        cfg = tiny_config("qwen2-vl")
    else:
        cfg = AutoConfig.for_model(
            family,
            image_token_id=IMG,
            video_token_id=151656,
            vision_start_token_id=151652,
            vision_end_token_id=151653,
            **FAMILIES[family][1],
        )
    net = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()
    net.config.use_cache = False
    return net


def _patch(family):
    return 14 if family == "qwen2_vl" else FAMILIES[family][0]


def _logits(net, batch, pixels):
    with torch.no_grad():
        return net(
            input_ids=batch.input_ids,
            attention_mask=None if batch.packed else batch.attention_mask,
            position_ids=batch.position_ids,
            mm_token_type_ids=batch.mm_token_type_ids,
            pixel_values=pixels,
            image_grid_thw=batch.image_grid_thw,
            use_cache=False,
        ).logits[0]


def _worst_segment_diff(net, samples, packed, patchify, spec, device="cpu") -> float:
    """Max abs difference between each sample's logits alone and its slice of the packed row's logits."""
    packed = packed.to(device)
    got = _logits(net, packed, patchify(packed.images, packed.image_index)).float()
    worst, start = 0.0, 0
    for s in samples:
        alone = collate([s], spec).to(device)
        ref = _logits(net, alone, patchify(alone.images, alone.image_index)).float()
        worst = max(worst, float((got[start : start + s.num_tokens] - ref[: s.num_tokens]).abs().max()))
        start += s.num_tokens
    return worst


def _variant(packed, kind: str):
    """'attend': text positions run on (no resets), so the model sees one causal block and samples attend to each
    other (what a packer that does not reset positions gets). 'flat_mrope': resets kept, but rows 1-3 are the plain
    per-sample positions (a 2-D position packer: images lose their MRoPE layout). 'shifted': every sample's MRoPE
    rows shifted by the tokens before it, resets kept: harmless, since RoPE scores depend only on differences
    within a sample, which is why the resets of row 0 are what isolation hangs on."""
    pos = packed.position_ids.clone()
    text = pos[0, 0].clone()
    if kind == "attend":
        pos[0, 0] = torch.arange(len(text), dtype=pos.dtype)
    elif kind == "flat_mrope":
        pos[1:, 0] = text
    else:
        pos[1:, 0] += (torch.arange(len(text)) - text).to(pos.dtype)
    return dataclasses.replace(packed, position_ids=pos)


@pytest.fixture(scope="module")
def spec_for(image_spec):
    return lambda patch: ImageSpec.from_config({**image_spec.config, "patch_size": patch})


def test_packed_layout_literal():
    spec = CollateSpec(0, IMG, 14, 2)
    a, b = _synthetic("a", [3, (1, 2), 2], patch=14, seed=0), _synthetic("b", [4], patch=14, seed=1)
    p = collate_packed([[a], [b]], spec)  # two rows end to end
    assert p.packed and p.rows == 2 and p.sample_ids == ["a", "b"] and p.input_ids.shape == (1, 11)
    assert p.position_ids[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    assert p.position_ids[1:, 0, :7].tolist() == a.position_ids.tolist()
    assert p.position_ids[1:, 0, 7:].tolist() == b.position_ids.tolist()
    assert p.loss_mask[0, [0, 7]].tolist() == [0, 0]  # first tokens are never targets
    assert p.num_trained == int((p.labels[0] != IGNORE_INDEX).sum()) == int(p.loss_mask.sum())
    assert p.image_grid_thw.tolist() == [[1, 2, 4]] and p.image_index == [0] and p.num_tokens == 11
    text = collate_packed([[b]], spec)  # no image: a placeholder after the last token, no label
    assert text.input_ids[0, -1] == IMG and text.loss_mask[0, -1] == 0 and text.position_ids[0, 0, -1] == 4


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "family",
    ["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow), pytest.param("qwen3_vl", marks=pytest.mark.slow)],
)
def test_packed_row_gives_each_sample_its_own_logits_and_broken_packing_does_not(family, attn, spec_for):
    patch = _patch(family)
    net = _net(family, attn)
    spec = CollateSpec(0, IMG, patch, 2)
    samples = _segments(patch)
    packed = collate_packed([samples[:3], samples[3:]], spec)
    patchify = Patchifier(spec_for(patch), "cpu")
    assert _worst_segment_diff(net, samples, packed, patchify, spec) <= 1e-5
    for kind in ("attend", "flat_mrope"):
        assert _worst_segment_diff(net, samples, _variant(packed, kind), patchify, spec) > 1e-3, kind
    assert _worst_segment_diff(net, samples, _variant(packed, "shifted"), patchify, spec) <= 1e-4


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_packed_step_equals_unpacked_loss_and_grad_norm(family, spec_for):
    from trainer.config import TrainConfig
    from trainer.options import Optimization
    from trainer.startup import build_optimizer
    from trainer.train import train_step

    patch = _patch(family)
    spec = CollateSpec(0, IMG, patch, 2)
    samples = _segments(patch)
    patchify = Patchifier(spec_for(patch), "cpu")
    out = []
    for batch in (collate_packed([samples], spec), collate(samples, spec)):
        net = _net(family, "sdpa").train()
        opt = build_optimizer(Optimization.of(TrainConfig(data="-", tiny_random="qwen2-vl")), net)
        out.append(
            (
                batch.num_trained,
                *train_step(
                    net, opt, [batch], patchifier=patchify, global_trained=batch.num_trained, max_grad_norm=1.0
                ),
            )
        )
    (n_p, loss_p, norm_p), (n_u, loss_u, norm_u) = out
    assert n_p == n_u
    assert loss_p == pytest.approx(loss_u, rel=1e-6, abs=0) and norm_p == pytest.approx(norm_u, rel=1e-4, abs=0)


def test_packed_real_samples_equal_unpacked(dataset, image_spec):
    """Shard samples (image and text-only, several images) in one packed row: loss and per-token losses of the
    packed forward equal the padded unpacked batch's."""
    samples = read_all_samples(dataset, image_spec)
    pick = sorted(samples, key=lambda s: s.num_tokens)
    text = [s for s in pick if not s.image_index][:1]
    multi = [s for s in pick if len(s.image_index) >= 2][:1]
    one = [s for s in pick if len(s.image_index) == 1][:2]
    group = text + multi + one
    assert len(group) == 4
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)).eval()
    spec = CollateSpec(0, IMG, 14, 2)
    patchify = Patchifier(image_spec, "cpu")
    packed, plain = collate_packed([group], spec), collate(group, spec)
    with torch.no_grad():
        a = forward_loss(net, packed, patchify(packed.images, packed.image_index))
        b = forward_loss(net, plain, patchify(plain.images, plain.image_index))
    assert packed.num_trained == plain.num_trained
    assert float(a) == pytest.approx(float(b), rel=1e-6, abs=0)


# --- the rank's step loader with packing -------------------------------------------------------------------------


def _pack_loader(shards, image_spec, workers):
    from trainer.data.batches import StepLoader
    from trainer.data.streams import ShardSequence

    return StepLoader(
        ShardSequence(shards, spec=image_spec, seed=0, shuffle_shards=True),
        collate_spec=CollateSpec(0, IMG, 14, 2),
        batching=Batching(micro_batch_size=1, grad_accum=2, pack_to=400, pack_window=5),
        num_workers=workers,
        prefetch_factor=2,
    )


def _steps(loader, n=None):
    out = []
    while n is None or len(out) < n:
        step = loader.next_step()
        assert len(step) == 2  # grad_accum micro-batches, also once exhausted
        if not any(b.num_samples for b in step):
            break
        out.append([(b.rows, b.sample_ids) for b in step])
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_step_loader_packs_every_sample_once_and_resumes_from_its_state_with_other_workers(dataset, image_spec):
    from trainer.data.sources import plan_shards, resolve_data

    shards = list(resolve_data(str(dataset)).shards)
    plan = plan_shards(tuple(shards), 2)
    seen, ref = [], []
    for r in range(2):
        ld = _pack_loader([shards[i] for i in plan.per_rank[r]], image_spec, 0)
        ld.start(0, 0)
        ref.append(_steps(ld))
        assert all(b.num_samples == 0 and b.rows == 0 for b in ld.next_step())  # then only empty micro-batches
        seen += [i for step in ref[-1] for _, ids in step for i in ids]
        assert all(rows == 1 for step in ref[-1] for rows, ids in step if ids)
    assert len(seen) == len(set(seen)) == 18 and len(ref[1]) >= 3
    mine = [shards[i] for i in plan.per_rank[1]]
    for cut in range(1, len(ref[1])):
        a = _pack_loader(mine, image_spec, 2)
        a.start(0, 0)
        head = _steps(a, cut)
        state, position = a.pack_state, a.position
        a.close()
        b = _pack_loader(mine, image_spec, 3)
        b.start(0, position, state)
        assert head + _steps(b) == ref[1], cut


def test_flop_count_sees_the_same_samples_packed_or_not():
    from trainer.metrics import FlopCounter

    spec = CollateSpec(0, IMG, 14, 2)
    samples = _segments(14)
    counter = FlopCounter(_net("qwen2_vl", "sdpa"))
    packed, plain = counter.step([collate_packed([samples], spec)]), counter.step([collate(samples, spec)])
    lens = [s.num_tokens for s in samples]
    attn = 6 * counter.layers * counter.hidden * sum(n * n for n in lens)
    assert packed == plain > attn + 6 * counter.text * sum(lens)  # vision patches on top
    assert counter.step([collate([], spec)]) == 0


def test_a_window_hands_out_its_rows_in_a_fixed_shuffled_order_not_longest_first():
    """Best-fit decreasing opens rows longest sample first; the related long samples of a window (late steps of one
    trajectory) must not all leave in the first rows, i.e. in one step."""
    lengths = [900, 100, 850, 120, 800, 150, 950, 60, 700, 200, 880, 90]  # six long, six short; T = 1000
    rows = _rows(Packer(iter(_fake(i, n) for i, n in enumerate(lengths)), capacity=1000, window=12))
    longest = [max(lengths[p] for p in r) for r in rows]
    assert sorted(p for r in rows for p in r) == list(range(12)) and len(rows) == 6
    assert longest != sorted(longest, reverse=True), longest  # best-fit decreasing's own order
    assert rows == _rows(Packer(iter(_fake(i, n) for i, n in enumerate(lengths)), capacity=1000, window=12))
