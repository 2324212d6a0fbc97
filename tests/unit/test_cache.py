import torch

from speedkv.core.cache import KVCache, LayerKV


def test_extend_write_commit_and_byte_counts():
    kv = LayerKV(heads=2, capacity=5, dim=4, dtype=torch.float32, device="cpu")
    kv.extend(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.tensor([0, 1, 2]))
    assert kv.length == 3 and kv.nbytes() == 2 * 2 * 3 * 4 * 4
    assert kv.allocated_bytes() == 2 * 2 * 5 * 4 * 4
    kv.write_next(torch.full((2, 1, 4), 7.0), torch.full((2, 1, 4), 7.0), 3)
    assert kv.length == 3  # written but not yet kept
    kv.commit()
    assert kv.length == 4 and kv.positions()[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(kv.keys()[:, 3], torch.full((2, 4), 7.0))


def test_growth_beyond_reserved_room_keeps_entries():
    kv = LayerKV(heads=1, capacity=1, dim=2, dtype=torch.float32, device="cpu")
    for i in range(40):
        kv.write_next(torch.full((1, 1, 2), float(i)), torch.zeros(1, 1, 2), i)
        kv.commit()
    assert kv.length == 40 and kv.keys()[0, :, 0].tolist() == [float(i) for i in range(40)]


def test_keep_per_head_selection_and_shrink():
    kv = LayerKV(heads=2, capacity=8, dim=1, dtype=torch.float32, device="cpu")
    vals = torch.arange(6, dtype=torch.float32).view(1, 6, 1).expand(2, 6, 1)
    kv.extend(vals, vals * 10, torch.arange(6))
    kv.keep(torch.tensor([[0, 4], [1, 5]]))  # different tokens in each head
    assert kv.length == 2
    assert kv.positions().tolist() == [[0, 4], [1, 5]]
    assert kv.values()[:, :, 0].tolist() == [[0.0, 40.0], [10.0, 50.0]]
    assert kv.capacity == 2 + 2  # the 2 slots reserved for decode survive the shrink


def test_cache_sums_layers():
    layers = [LayerKV(1, 4, 2, torch.bfloat16, "cpu") for _ in range(3)]
    layers[0].extend(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), torch.arange(4))
    layers[2].extend(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.arange(1))
    cache = KVCache(layers)
    assert cache.lengths() == [4, 0, 1]
    assert cache.nbytes() == (4 + 1) * 2 * 2 * 2
