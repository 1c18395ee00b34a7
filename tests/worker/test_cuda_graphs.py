"""Batch buckets of the decode CUDA graphs (the capture itself needs a GPU: benchmarks/bench_gpu.py
checks graph replay against eager and CPU outputs there)."""

from paphos.worker.cuda_graphs import batch_buckets


def test_buckets_are_dense_for_small_batches_and_end_at_max_num_seqs() -> None:
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(256)[-1] == 256
    assert batch_buckets(100)[-1] == 100
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]


def test_every_batch_size_has_a_bucket_with_little_padding() -> None:
    buckets = batch_buckets(256)
    for batch in range(1, 257):
        bucket = min(b for b in buckets if b >= batch)
        assert bucket - batch < max(8, batch // 4), (batch, bucket)
