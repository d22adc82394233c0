import io
import json
import shutil
import tarfile

import pytest

from trainer.data.errors import DataError
from trainer.data.sources import ShardRef, plan_shards, resolve_data
from trainer.data.tars import iter_tar_samples


def test_dataset_dir_uses_the_manifest(dataset):
    src = resolve_data(str(dataset))
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert [s.name for s in src.shards] == [s["name"] for s in manifest["shards"]]
    assert [s.num_samples for s in src.shards] == [4, 4, 4, 4, 2]
    assert [s.num_tokens for s in src.shards] == [s["num_tokens"] for s in manifest["shards"]]
    assert src.processor == str(dataset / "processor") and src.counted


def test_unknown_format_version_is_refused(dataset, tmp_path):
    shutil.copytree(dataset, tmp_path / "d")
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    m["format_version"] = 99  # 3 is video (issue 26); an unknown one
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="format_version 99 is not supported"):
        resolve_data(str(tmp_path / "d"))


def test_brace_pattern_and_file_prefix_pick_up_manifest_counts(dataset):
    src = resolve_data(f"file:{dataset}/shard-{{000001..000003}}.tar")
    assert [s.name for s in src.shards] == ["shard-000001.tar", "shard-000002.tar", "shard-000003.tar"]
    assert [s.num_samples for s in src.shards] == [4, 4, 4] and src.processor == str(dataset / "processor")


def test_pattern_without_manifest_has_no_counts(dataset, tmp_path):
    for p in dataset.glob("shard-*.tar"):
        shutil.copy(p, tmp_path / p.name)
    src = resolve_data(str(tmp_path / "shard-{000000..000004}.tar"))
    assert len(src.shards) == 5 and not src.counted and src.processor is None
    with pytest.raises(DataError, match="1 shard\\(s\\) missing"):
        resolve_data(str(tmp_path / "shard-{000000..000005}.tar"))


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such dataset dir"):
        resolve_data(str(tmp_path / "nope"))


def test_token_balanced_plan():
    shards = tuple(
        ShardRef(f"s{i}", f"s{i}", n, t)
        for i, (n, t) in enumerate([(4, 100), (4, 90), (2, 30), (1, 20), (3, 10), (1, 10)])
    )
    plan = plan_shards(shards, 2)
    assert plan.per_rank == ((0, 3, 4), (1, 2, 5))  # 100+20+10 vs 90+30+10 tokens
    assert plan.rank_tokens == (130, 130) and plan.rank_samples == (8, 7) and plan.imbalance == 1.0
    plan3 = plan_shards(shards, 4)
    assert sorted(i for r in plan3.per_rank for i in r) == list(range(6))  # each shard on exactly one rank
    assert plan3.imbalance == pytest.approx(100 / (260 / 4))
    few = plan_shards(shards[:2], 3)  # fewer shards than ranks: all ranks stride over all 8 samples
    assert few.stride and few.per_rank == ((0, 1),) * 3 and few.rank_samples == (3, 3, 2)


def test_pipe_url_reads_the_same_samples(dataset):
    shard = dataset / "shard-000002.tar"
    direct = [(i, k, m) for i, k, m in iter_tar_samples(str(shard), lambda i: True)]
    piped = [(i, k, m) for i, k, m in iter_tar_samples(f"pipe:cat {shard}", lambda i: True)]
    assert direct == piped and len(direct) == 4
    assert set(direct[0][2]) >= {"input_ids.npy", "loss_mask.npy", "json"}


def test_skipped_samples_are_not_read(dataset):
    out = list(iter_tar_samples(str(dataset / "shard-000000.tar"), lambda i: i % 2 == 1))
    assert [(i, m is None) for i, _, m in out] == [(0, True), (1, False), (2, True), (3, False)]


def test_truncated_tar_names_the_url(tmp_path, dataset):
    data = (dataset / "shard-000000.tar").read_bytes()
    bad = tmp_path / "bad.tar"
    bad.write_bytes(data[: len(data) // 2 + 7])
    with pytest.raises(DataError, match="bad.tar"):
        list(iter_tar_samples(str(bad), lambda i: True))


def test_bad_member_name(tmp_path):
    p = tmp_path / "x.tar"
    with tarfile.open(p, "w") as tar:
        ti = tarfile.TarInfo("noext")
        ti.size = 1
        tar.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(DataError, match="no '<key>.<ext>' name"):
        list(iter_tar_samples(str(p), lambda i: True))


def test_the_vectorized_row_check_agrees_with_the_per_shard_one():
    """_check_all (every shard of a rank at once, from the dataset's sample index) refuses exactly the row tables
    that check_rows refuses for some shard: random tables over shards of 0-4 samples, each with one random flaw or
    none (a boundary between shards is not an order check)."""
    import numpy as np

    from trainer.data.index import ShardIndex, _check_all, check_rows

    rng = np.random.default_rng(7)
    refused = {True: 0, False: 0}
    for _ in range(3000):
        shards, rows = [], []
        for k in range(int(rng.integers(1, 6))):
            n = int(rng.integers(0, 5))
            starts = np.cumsum(rng.integers(0, 3, n)) + np.arange(n) * 10
            ends = starts + rng.integers(1, 10, n)
            tokens = rng.integers(0, 9, n)
            trained = np.minimum(tokens, rng.integers(0, 9, n))
            cols = [starts, ends, tokens, trained]
            size = int(ends[-1]) + int(rng.integers(0, 3)) if n else 10
            flaw = int(rng.integers(0, 36))  # 0-9: a flaw, one shard in about four
            if n and flaw < 8:
                i, c = int(rng.integers(0, n)), flaw % 4
                cols[c] = cols[c].copy()
                cols[c][i] += int(rng.choice([-40, -9, -1, 1, 9]))
            shards.append(ShardRef(f"s{k}", f"s{k}", n, int(tokens.sum()) + (flaw == 8), size - (flaw == 9) * 5))
            rows.append(cols)
        columns = [np.concatenate([r[c] for r in rows]).astype(np.int64) for c in range(4)]

        def per_shard_refuses(shards, rows):
            for s, r in zip(shards, rows):
                try:
                    check_rows(s, ShardIndex("", *(np.asarray(c, np.int64) for c in r)), "x")
                except DataError:
                    return True
            return False

        want = per_shard_refuses(shards, rows)
        try:
            _check_all(shards, columns, "x")
            got = False
        except DataError:
            got = True
        assert got == want, (shards, rows)
        refused[want] += 1
    assert min(refused.values()) > 500  # both outcomes are well exercised
