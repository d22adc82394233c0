"""The shard cache's promises to its readers (trainer/data/cache.py, forks.py): DataLoader workers are never forked
while one of the cache's threads is mid-step (a lock it holds would stay held in the worker forever)."""

import threading
import time


def test_dataloader_workers_are_never_forked_while_a_cache_thread_is_mid_step(dataset, tmp_path, monkeypatch):
    """The resumed run that hung: the shard cache's threads were working (hashing the local shards a resume has not
    hashed yet, a torch op in the fetcher) while the DataLoader forked its workers, and a worker inherited a lock
    held mid-step (glibc's atexit lock) and waited on it forever in torch.set_num_threads. Here each hash chunk
    counts itself busy for 0.5 s (a lock held inside a library call); the workers are forked while a hash is under
    way, and each checks the busy count it inherited: 0, as the fork waited for the hashing threads to park."""
    import hashlib as real_hashlib

    import trainer.data.integrity as integrity
    import trainer.data.streams as streams
    from tests.trainer.conftest import make_loader_of, open_data_of
    from trainer.config import TrainConfig
    from trainer.data.collate import CollateSpec

    busy = {"n": 0}
    lock, started = threading.Lock(), threading.Event()

    class SlowSha256:
        def __init__(self):
            self.h = real_hashlib.sha256()

        def update(self, data):
            with lock:
                busy["n"] += 1
            started.set()
            time.sleep(0.5)
            self.h.update(data)
            with lock:
                busy["n"] -= 1

        def hexdigest(self):
            return self.h.hexdigest()

    class Hashlib:
        sha256 = SlowSha256

    real_read = streams.read_indexed

    def read(index, i, f=None):  # in a worker: what the fork copied of the parent's threads
        if busy["n"]:
            raise RuntimeError(f"forked while {busy['n']} shard-cache thread(s) were mid-step")
        return real_read(index, i, f)

    monkeypatch.setattr(integrity, "hashlib", Hashlib)
    monkeypatch.setattr(streams, "read_indexed", read)
    cfg = TrainConfig(data=str(dataset), tiny_random="qwen2-vl", num_workers=2, micro_batch_size=1, out=str(tmp_path))
    data = open_data_of(cfg)
    spec = CollateSpec(
        pad_id=0, image_token_id=151655, patch_size=data.image.patch_size, merge_size=data.image.merge_size
    )
    loader, _, _ = make_loader_of(cfg, data, collate_spec=spec)
    assert len(loader.streams.cache.check.deferred) == 5  # a first start: every local shard is hashed by the cache
    try:
        loader.start(0, 0)
        assert started.wait(30)
        batches = loader.next_step()  # forks the two workers now, while a hash is under way
    finally:
        loader.close()
    assert sum(b.num_samples for b in batches) == 1
