import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vlmprep.render.positions import mrope_position_ids
from vlmprep.render.truncate import truncate_sample
from vlmprep.types import ImageData, PreparedImage, RecordError, RenderedSample, Source

IMG, VS, VE = 151655, 151652, 151653


def make_sample(texts, grids, trained):
    """texts[i] tokens, then image i (wrapper + placeholders), ..., then texts[-1]; trained[i] marks text runs."""
    ids, mask, runs, spans = [], [], [], []
    for i, (t, h, w) in enumerate(grids):
        ids += [7] * texts[i]
        mask += [int(trained[i])] * texts[i]
        spans.append((len(ids), None))
        ids.append(VS)
        mask.append(0)
        n = t * h * w // 4
        runs.append((len(ids), len(ids) + n))
        ids += [IMG] * n
        mask += [0] * n
        ids.append(VE)
        mask.append(0)
        spans[-1] = (spans[-1][0], len(ids))
    ids += [7] * texts[-1]
    mask += [int(trained[-1])] * texts[-1]
    ids = np.array(ids, dtype=np.int32)
    grid_arr = np.array(grids, dtype=np.int32).reshape(-1, 3)
    images = [
        PreparedImage(
            pixels=np.zeros((h * 14, w * 14, 3), np.uint8), grid_thw=g, source=ImageData(b"", "x"), digest=str(k)
        )
        for k, g in enumerate(grids)
        for (_, h, w) in [g]
    ]
    return RenderedSample(
        id="s",
        source=Source("f", 1),
        input_ids=ids,
        loss_mask=np.array(mask, np.uint8),
        mm_token_type_ids=(ids == IMG).astype(np.uint8),
        position_ids=mrope_position_ids(len(ids), runs, grid_arr, 2),
        image_grid_thw=grid_arr,
        images=images,
        image_spans=spans,
        num_tokens_before_truncation=len(ids),
    )


def check_invariants(out, full):
    n = len(out.input_ids)
    assert len(out.loss_mask) == len(out.mm_token_type_ids) == out.position_ids.shape[1] == n
    # No wrapper is split: every vision start in the kept prefix has its end.
    assert (out.input_ids == VS).sum() == (out.input_ids == VE).sum() == len(out.images) == len(out.image_grid_thw)
    # Placeholder count equals the kept grids' merged sizes.
    assert (out.input_ids == IMG).sum() == int((out.image_grid_thw.prod(axis=1) // 4).sum())
    # Everything kept is an exact prefix of the full sample.
    assert (out.input_ids == full.input_ids[:n]).all()
    assert (out.position_ids == full.position_ids[:, :n]).all()
    assert (out.loss_mask == full.loss_mask[:n]).all()
    assert out.dropped_images == len(full.images) - len(out.images)


grid_st = st.tuples(st.just(1), st.integers(1, 6).map(lambda x: 2 * x), st.integers(1, 6).map(lambda x: 2 * x))


@given(grids=st.lists(grid_st, max_size=6), data=st.data())
def test_truncation_never_splits_an_image(grids, data):
    texts = data.draw(st.lists(st.integers(0, 20), min_size=len(grids) + 1, max_size=len(grids) + 1))
    trained = data.draw(st.lists(st.booleans(), min_size=len(grids) + 1, max_size=len(grids) + 1))
    full = make_sample(texts, grids, trained)
    assume(full.loss_mask.any())  # render rejects untrainable samples before truncation
    seq_len = data.draw(st.integers(1, len(full.input_ids) + 5))
    try:
        out = truncate_sample(full, seq_len)
    except RecordError as e:
        assert e.reason == "no_trainable_tokens_after_truncation"
        return
    assert len(out.input_ids) <= seq_len
    assert out.loss_mask.any()
    assert out.truncated == (len(full.input_ids) > seq_len)
    check_invariants(out, full)


def test_cut_inside_image_moves_before_its_wrapper():
    full = make_sample([3, 2, 4], [(1, 4, 4), (1, 2, 2)], [True, True, True])
    # tokens: 3 text, VS, 4 img, VE (idx 3..8), 2 text, VS, 1 img, VE (idx 11..13), 4 text
    out = truncate_sample(full, 12)  # would cut after the second VS
    assert len(out.input_ids) == 11 and len(out.images) == 1 and out.dropped_images == 1
    out = truncate_sample(full, 6)
    assert len(out.input_ids) == 3 and len(out.images) == 0 and out.dropped_images == 2


def test_untrainable_prefix_is_rejected():
    full = make_sample([3, 5], [(1, 4, 4)], [False, True])
    with pytest.raises(RecordError) as e:
        truncate_sample(full, 9)
    assert e.value.reason == "no_trainable_tokens_after_truncation"


def test_an_image_that_alone_fills_most_of_seq_len_names_the_pixel_budget():
    """The reject of a sample whose only trained text lies past one huge image (SeeAct's 1280x5808 page) says so."""
    full = make_sample([2, 5], [(1, 8, 8)], [False, True])  # 2 text, an image of 16 + 2 wrapper tokens, 5 trained
    full.images[0].source_size = (1280, 5808)
    with pytest.raises(RecordError) as e:
        truncate_sample(full, 10)
    assert e.value.message == (
        "25 tokens cut to 2 (seq_len=10) leaves no trained token; image 1 (1280x5808) alone "
        "takes 18 tokens: lower --max-pixels, or raise --seq-len"
    )
    with pytest.raises(RecordError) as e:  # an image of under half of seq_len: no hint
        truncate_sample(make_sample([30, 5], [(1, 8, 8)], [False, True]), 40)
    assert e.value.message == "53 tokens cut to 30 (seq_len=40) leaves no trained token"
