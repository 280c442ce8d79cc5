import pytest
import torch

from physis_ros.model.kv import KVBatch, KVTable


def chunk(value: float, t: int = 3) -> torch.Tensor:
    return torch.full((t, 2, 4), value)


def test_window_keeps_last_chunks_in_order():
    table = KVTable(slots=2, tokens_per_chunk=3, window=2, sink=False, heads=2, head_dim=4)
    for i in range(5):
        table.append(0, chunk(i), chunk(-i))
    k, v = table.cached(0)
    assert k.shape == (6, 2, 4)
    assert k[:3].eq(3).all() and k[3:].eq(4).all()
    assert v[3:].eq(-4).all()
    assert table.cached(1)[0].shape[0] == 0  # other slot untouched
    assert table.chunks_written[0] == 5


def test_sink_chunk_is_kept_forever():
    table = KVTable(slots=1, tokens_per_chunk=3, window=2, sink=True, heads=2, head_dim=4)
    for i in range(6):
        table.append(0, chunk(i), chunk(i))
    k, _ = table.cached(0)
    assert [k[i * 3, 0, 0].item() for i in range(3)] == [0, 4, 5]


def test_reset_forgets_slot():
    table = KVTable(slots=1, tokens_per_chunk=3, window=1, sink=False, heads=2, head_dim=4)
    table.append(0, chunk(1), chunk(1))
    table.reset(0)
    assert table.cached(0)[0].shape[0] == 0


def test_batch_pads_and_masks_unequal_histories():
    table = KVTable(slots=2, tokens_per_chunk=3, window=2, sink=False, heads=2, head_dim=4)
    table.append(0, chunk(7), chunk(7))
    kv = KVBatch(table, [0, 1])
    own = torch.stack([chunk(1), chunk(2)])
    keys, values, mask = kv.attend_inputs(own, own)
    assert keys.shape == (2, 6, 2, 4)
    assert mask[:, 0, 0].tolist() == [[True] * 6, [True] * 3 + [False] * 3] and mask.shape == (2, 1, 1, 6)
    assert keys[0, :3].eq(7).all() and keys[0, 3:].eq(1).all()
    assert keys[1, :3].eq(2).all()


def test_wrong_token_count_is_refused():
    table = KVTable(slots=1, tokens_per_chunk=3, window=1, sink=False, heads=2, head_dim=4)
    with pytest.raises(ValueError, match="expected 3 tokens"):
        table.append(0, chunk(1, t=4), chunk(1, t=4))


def test_slots_are_allocated_and_freed_one_by_one():
    table = KVTable(slots=0, tokens_per_chunk=3, window=2, sink=True, heads=2, head_dim=4)
    assert table.nbytes() == 0
    table.add(7)
    table.add(9)
    assert table.nbytes() == 2 * table.slot_bytes() == 2 * 2 * (3 * 3 * 2 * 4) * 4
    with pytest.raises(ValueError, match="already exists"):
        table.add(7)
    table.append(9, chunk(1), chunk(1))
    table.remove(7)
    assert table.nbytes() == table.slot_bytes() and table.cached(9)[0].shape[0] == 3
