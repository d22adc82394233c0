import numpy as np
import torch

from tests.conftest import tiny_qwen2vl_config
from vlmprep.render.positions import mrope_position_ids

IMG, VS, VE = 151655, 151652, 151653


def _sequence(rng, grids, merge=2):
    ids, runs = [], []
    for t, h, w in grids:
        ids += list(rng.integers(0, 1000, rng.integers(0, 7))) + [VS]
        n = t * h * w // merge**2
        runs.append((len(ids), len(ids) + n))
        ids += [IMG] * n + [VE]
    ids += list(rng.integers(0, 1000, rng.integers(1, 9)))
    return np.array(ids), runs


def test_positions_equal_model_get_rope_index():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    torch.manual_seed(0)
    model = Qwen2VLModel(tiny_qwen2vl_config()).eval()
    rng = np.random.default_rng(0)
    cases = [[], [(1, 4, 6)], [(1, 2, 2), (1, 8, 4), (1, 6, 10)], [(1, 36, 64)]]
    cases += [
        [(1, 2 * int(rng.integers(1, 8)), 2 * int(rng.integers(1, 8))) for _ in range(int(rng.integers(1, 5)))]
        for _ in range(8)
    ]
    for grids in cases:
        ids, runs = _sequence(rng, grids)
        grid_arr = np.array(grids, dtype=np.int64).reshape(-1, 3)
        ours = mrope_position_ids(len(ids), runs, grid_arr, 2)
        if not grids:  # the model only defines 3D positions for vision+text: text-only is arange
            assert (ours == np.arange(len(ids))[None].repeat(3, 0)).all()
            continue
        mm = torch.tensor((ids == IMG).astype(np.int64))[None]
        ref, _ = model.get_rope_index(torch.tensor(ids)[None], mm, image_grid_thw=torch.tensor(grid_arr))
        assert ours.dtype == np.int32
        np.testing.assert_array_equal(ours, ref[:, 0].numpy())
