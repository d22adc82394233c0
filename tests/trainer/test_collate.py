import numpy as np
import pytest
import torch

from trainer.data.batches import MicroBatcher
from trainer.data.collate import IGNORE_INDEX, CollateSpec, collate
from trainer.data.decode import DecodedSample
from trainer.data.errors import DataError
from trainer.options import Batching

SPEC = CollateSpec(pad_id=0, image_token_id=9, patch_size=14, merge_size=2)


def sample(sid, ids, mask, mm=None, images=(), grids=(), position=0):
    n = len(ids)
    mm = np.array(mm if mm is not None else [0] * n, dtype=np.uint8)
    return DecodedSample(
        key=sid,
        id=sid,
        input_ids=np.array(ids, dtype=np.int32),
        loss_mask=np.array(mask, dtype=np.uint8),
        mm_token_type_ids=mm,
        position_ids=np.stack([np.arange(n) + 10 * k for k in range(3)]).astype(np.int32),
        image_grid_thw=np.array(grids, dtype=np.int32).reshape(-1, 3),
        images=list(images),
        image_index=list(range(len(images))),
        position=position,
    )


def test_pad_labels_and_mixed_text_and_image_samples():
    img = np.full((28, 28, 3), 7, dtype=np.uint8)
    text = sample("t", [1, 2, 3], [0, 1, 1])
    with_image = sample("i", [4, 9, 5, 6, 7], [0, 0, 0, 1, 1], mm=[0, 1, 0, 0, 0], images=[img], grids=[[1, 2, 2]])
    b = collate([text, with_image], SPEC)
    assert b.input_ids.tolist() == [[1, 2, 3, 0, 0], [4, 9, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b.labels.tolist() == [[-100, 2, 3, -100, -100], [-100, -100, -100, 6, 7]]
    assert b.mm_token_type_ids.tolist() == [[0, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert b.position_ids.shape == (3, 2, 5) and b.position_ids[2, 1].tolist() == [20, 21, 22, 23, 24]
    assert b.position_ids[:, 0, :3].tolist() == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]
    assert (
        b.image_grid_thw.tolist() == [[1, 2, 2]]
        and b.image_index == [0]
        and torch.equal(b.images[0], torch.from_numpy(img))
    )
    assert (b.num_tokens, b.num_trained, b.sample_ids) == (8, 4, ["t", "i"])
    assert (b.input_ids.dtype, b.position_ids.dtype, b.loss_mask.dtype) == (torch.int32, torch.int32, torch.uint8)
    d = b.to("cpu")  # what the model gets: widened to int64, same values
    assert all(
        t.dtype == torch.int64
        for t in (d.input_ids, d.labels, d.attention_mask, d.position_ids, d.mm_token_type_ids, d.image_grid_thw)
    )
    assert d.labels.tolist() == b.labels.tolist() and d.attention_mask.tolist() == b.attention_mask.tolist()


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_row_copies_and_the_mask_fill_make_the_same_batch(monkeypatch, rows):
    """collate fills a few rows slice by row and many through one B x L mask: both ways give the same tensors."""
    import trainer.data.collate as C

    rng = np.random.default_rng(rows)
    img = np.full((28, 28, 3), 7, dtype=np.uint8)
    samples = []
    for r in range(rows):
        n = int(rng.integers(1, 30))
        mm = [0] * n
        if r % 2:
            mm[n // 2] = 1
        ids = [9 if t else int(x) for t, x in zip(mm, rng.integers(10, 99, n))]
        mask = rng.integers(0, 2, n).tolist()
        samples.append(sample(f"s{r}", ids, mask, mm, [img] if r % 2 else [], [[1, 2, 2]] if r % 2 else [], r))
    monkeypatch.setattr(C, "_ROW_COPY_MAX", 10**6)
    by_rows = collate(samples, SPEC)
    monkeypatch.setattr(C, "_ROW_COPY_MAX", 0)
    by_mask = collate(samples, SPEC)
    for f in ("input_ids", "loss_mask", "mm_token_type_ids", "position_ids", "lengths", "labels", "image_grid_thw"):
        assert torch.equal(getattr(by_rows, f), getattr(by_mask, f)), f
    assert by_rows.num_trained == by_mask.num_trained == sum(int(np.count_nonzero(s.loss_mask[1:])) for s in samples)
    assert by_rows.input_ids[rows - 1, : len(samples[-1].input_ids)].tolist() == samples[-1].input_ids.tolist()


def test_no_image_batch_gets_one_unlabelled_placeholder_after_row_zero():
    b = collate([sample("a", [1, 2], [0, 1]), sample("b", [3, 4, 5], [0, 1, 1])], SPEC)
    assert b.input_ids.tolist() == [[1, 2, 9], [3, 4, 5]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert b.labels[0].tolist() == [-100, 2, -100] and b.mm_token_type_ids[0].tolist() == [0, 0, 1]
    assert b.position_ids[:, 0, 2].tolist() == [2, 12, 22]
    assert b.image_grid_thw.tolist() == [[1, 2, 2]] and b.images[0].shape == (28, 28, 3) and not b.images[0].any()
    assert b.num_trained == 3 and b.num_tokens == 5  # the placeholder is neither a token nor trained
    longest_first = collate([sample("b", [3, 4, 5], [0, 1, 1])], SPEC)
    assert longest_first.input_ids.tolist() == [[3, 4, 5, 9]]


def test_empty_micro_batch_is_a_placeholder_only():
    b = collate([], SPEC)
    assert b.num_samples == b.num_trained == b.num_tokens == 0
    assert b.input_ids.tolist() == [[0, 9]] and (b.labels == IGNORE_INDEX).all()


def test_foreign_image_token_is_refused():
    s = sample("x", [4, 8, 5], [0, 0, 1], mm=[0, 1, 0], images=[np.zeros((28, 28, 3), np.uint8)], grids=[[1, 2, 2]])
    with pytest.raises(DataError, match="not the model's image token 9"):
        collate([s], SPEC)


def _stream(lengths):
    return [sample(f"s{k}", [1] * n, [0] + [1] * (n - 1), position=k) for k, n in enumerate(lengths)]


def test_micro_batches_by_count_and_by_token_budget():
    mb = MicroBatcher(iter(_stream([3, 5, 2, 2, 9])), SPEC, Batching(micro_batch_size=2))
    assert [b.sample_ids for b in iter(mb.next, None)] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert mb.consumed == 5
    # Budget 10 = rows x longest: [3,5] -> 2x5; [2,2] -> 2x2, adding 9 would be 3x9; 9 goes alone.
    mb = MicroBatcher(iter(_stream([3, 5, 2, 2, 9, 12])), SPEC, Batching(max_tokens_per_batch=10))
    assert [b.sample_ids for b in iter(mb.next, None)] == [["s0", "s1"], ["s2", "s3"], ["s4"], ["s5"]]


def test_batcher_resumes_from_a_position_and_checks_order():
    mb = MicroBatcher(iter(_stream([3, 5, 2, 2])[2:]), SPEC, Batching(micro_batch_size=2), consumed=2)
    assert mb.next().sample_ids == ["s2", "s3"] and mb.consumed == 4
    bad = MicroBatcher(iter(_stream([3, 5, 2])[1:]), SPEC, Batching(micro_batch_size=2))
    with pytest.raises(DataError, match="out of order"):
        bad.next()
