"""The decode pool's KV cache with room (mlx_tier.job.pool_kv): sequences join and leave
in place, and every sequence's keys, values, offset and mask are what mlx-lm's
BatchKVCache holds for it, through joins (shorter and longer than the batch), decode
steps, finishes and shifts of the shared padding."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

import mlx_tier.job.pool_kv as pool_kv
from mlx_tier.job.pool_kv import RoomyKVCache, make_roomy, tail_into_holes

H, D = 2, 8


def sequence(n: int) -> BatchKVCache:
    """A one-sequence batch cache of ``n`` random tokens, as a started sequence joins the pool."""
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    return BatchKVCache.merge([c])


def pool(c: RoomyKVCache) -> SimpleNamespace:
    """A stand-in for the ``GenerationBatch`` whose cache ``c`` is (nothing evaluated ahead)."""
    return SimpleNamespace(prompt_cache=[c], _next_tokens=None, _next_logprobs=None)


def spans(c: BatchKVCache) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Each row's keys and values over its own tokens, and its offset."""
    k, v = (np.array(a) for a in c.keys_and_values())
    pad, off = c.left_padding.tolist(), c.offset.tolist()
    return [(k[i, :, pad[i]:], v[i, :, pad[i]:], off[i]) for i in range(len(pad))]


def attended(c: BatchKVCache) -> list[int]:
    """How many keys each row's decode query attends (from the cache's own mask)."""
    mask = c.make_mask(1, return_array=True)
    m = np.array(mask).reshape(len(c.offset.tolist()), -1) if mask is not None else None
    return [int(r.sum()) for r in m] if m is not None else [c._idx] * len(c.offset.tolist())


def same(ref: BatchKVCache, ours: BatchKVCache) -> None:
    assert ours.keys_and_values()[0].shape[0] == ours.batch == ours.offset.shape[0]  # no spare row leaks out
    mask = ours.make_mask(1, return_array=True)
    assert mask is None or mask.shape[0] == ours.batch
    a, b = spans(ref), spans(ours)
    assert len(a) == len(b) and ours.batch == len(b)
    for (ka, va, oa), (kb, vb, ob) in zip(a, b):
        assert oa == ob and ka.shape == kb.shape and (ka == kb).all() and (va == vb).all()
    assert attended(ref) == attended(ours)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joins_steps_and_finishes_keep_every_sequence_as_mlx_lm_does(seed, monkeypatch):
    monkeypatch.setattr(pool_kv, "SHIFT_COLUMNS", 8)  # shifts of the shared padding happen here too
    rng = random.Random(seed)
    mx.random.seed(seed)
    first = sequence(rng.randrange(5, 30))
    ref, ours = first, make_roomy([copy.deepcopy(first)], rows=4)[0]
    assert isinstance(ours, RoomyKVCache)
    for _ in range(60):
        op = rng.random()
        if op < 0.25 and ref.offset.shape[0] < 12:  # a sequence joins: shorter or longer than the batch
            s = sequence(rng.randrange(1, ref._idx + 12))
            ref.extend(copy.deepcopy(s))
            ours.extend(s)
        elif op < 0.4 and ref.offset.shape[0] > 1:  # some finish
            n = ref.offset.shape[0]
            keep = sorted(rng.sample(range(n), rng.randrange(1, n)))
            keep = tail_into_holes(keep) if rng.random() < 0.5 else keep  # the pool engine's order, or mlx-lm's
            ref.filter(keep)
            ours.filter(keep)
        else:  # a decode step: its mask made before its layers write (as the model does)
            n = ref.offset.shape[0]
            k, v = mx.random.normal((n, H, 1, D)), mx.random.normal((n, H, 1, D))
            ref.update_and_fetch(k, v)
            pool_kv.make_room(pool(ours))
            mask = ours.make_mask(1, return_array=True)
            keys, _ = ours.update_and_fetch(k, v)
            assert mask is None or mask.shape[-1] == keys.shape[2]
        same(ref, ours)


def test_a_shorter_join_and_a_finish_write_in_place_without_a_new_buffer():
    """The rows live in one buffer while they fit: a join shorter than the batch and a
    finish leave ``keys`` the same size, and only a longer join grows it."""
    big = make_roomy([sequence(40)], rows=8)[0]
    big.extend(sequence(3))  # grows once to the pool's 8 rows
    shape = big.keys.shape
    for n in (10, 39, 1):
        big.extend(sequence(n))
    big.update_and_fetch(mx.zeros((5, H, 1, D)), mx.zeros((5, H, 1, D)))
    big.filter([0, 2, 4])
    assert big.keys.shape == shape and big.batch == 3 and big._idx == 41
    big.extend(sequence(60))  # longer than the batch: the rows move right, once
    assert big._idx == 60 and big.left_padding.tolist() == [0 + 19, 30 + 19, 39 + 19, 0]  # paddings of 40, 10, 1


def test_finished_rows_are_filled_from_the_tail():
    assert tail_into_holes([0, 1, 3, 4, 5]) == [0, 1, 5, 3, 4]
    assert tail_into_holes([2, 5, 6, 7]) == [5, 6, 2, 7]
    assert tail_into_holes([0, 1, 2]) == [0, 1, 2] and tail_into_holes([4]) == [4] and tail_into_holes([]) == []
    order = tail_into_holes([1, 2, 4, 6, 7, 9])
    assert sorted(order) == [1, 2, 4, 6, 7, 9] and sum(i != r for i, r in enumerate(order) if r < 6) == 0


def test_a_finish_moves_one_row_for_each_sequence_that_left(monkeypatch):
    big = make_roomy([sequence(30)], rows=8)[0]
    for n in (5, 10, 20, 25, 29):
        big.extend(sequence(n))
    copied = []
    real = mx.take
    monkeypatch.setattr(pool_kv.mx, "take", lambda a, i, axis: copied.append(i.size) or real(a, i, axis=axis))
    big.filter(tail_into_holes([0, 2, 3, 5]))  # rows 1 and 4 left: row 5 fills 1, row 4 is beyond
    assert copied == [1, 1] and big.batch == 4  # keys and values of one row


def test_a_reused_rows_padding_is_zeros_as_mlx_lm_s():
    """A sequence that holds inf leaves; the row it held is reused by a shorter one, whose
    padding must not carry the inf (times a weight of 0 it would be nan)."""
    c = make_roomy([sequence(20)], rows=4)[0]
    bad = KVCache()
    bad.update_and_fetch(mx.full((1, H, 20, D), mx.inf), mx.full((1, H, 20, D), mx.inf))
    c.extend(BatchKVCache.merge([bad]))
    c.filter([0])
    c.extend(sequence(5))
    k, v = (np.array(a) for a in c.keys_and_values())
    assert np.isfinite(k).all() and np.isfinite(v).all() and (k[1, :, :15] == 0).all()


def test_mlx_lm_still_has_what_the_pool_needs():
    """in_place_pool reads a GenerationBatch's pending step (private attributes): a newer
    mlx-lm without them fails here, not silently copying the pool at every finish."""
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.sample_utils import greedy_sampler

    from mlx_tier.job.pool_kv import in_place_pool

    batch = GenerationBatch.empty(None, greedy_sampler)
    in_place_pool(batch)
    assert batch.extract_cache(0) is None


def held_peak(fn) -> int:
    """Bytes MLX allocated beyond what it held before ``fn()``, at the peak."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    mx.synchronize()
    return mx.get_peak_memory() - before


def test_the_pool_is_allocated_once_with_room_for_the_longest_sequence_expected():
    """Room for 8 rows of up to 300 tokens from the first growth: later joins (longer than
    the batch too), decode steps and drops of the shared padding stay in that buffer, each
    through a copy of the live part only."""
    c = make_roomy([sequence(40)], rows=8, longest=300)[0]
    c.extend(sequence(3))  # grows once
    mx.eval(c.keys, c.values)
    shape = c.keys.shape
    assert shape == (8, H, 300 + pool_kv.ROOM_SLACK, D)
    whole = c.keys.nbytes + c.values.nbytes
    assert held_peak(lambda: c.extend(sequence(120))) < whole / 4  # longer: the rows move right in place
    assert c._idx == 120 and c.left_padding.tolist() == [80, 117, 0]
    for n in (7, 119, 60):
        c.extend(sequence(n))
    for _ in range(150):  # decode steps, each evaluated as the pool's are
        mx.eval(c.update_and_fetch(mx.zeros((c.batch, H, 1, D)), mx.zeros((c.batch, H, 1, D))))
    assert held_peak(lambda: c.filter([3, 5])) < whole / 4  # the shared padding (60) is kept: below 256
    assert c._idx == 270 and c.left_padding.tolist() == [113, 60]
    c.update_and_fetch(mx.zeros((2, H, 1, D)), mx.zeros((2, H, 1, D)))
    assert c.keys.shape == shape


def test_a_new_buffer_is_sized_from_the_sequences_held_not_from_the_old_one():
    """After the long sequences left, a join that needs another row makes a buffer for the
    rows and the longest sequence held now (what the scheduler admitted), narrower than the
    old one; every sequence stays mlx-lm's."""
    first, second = sequence(40), sequence(30)
    ref = copy.deepcopy(first)
    c = make_roomy([first], rows=2, longest=300)[0]
    ref.extend(copy.deepcopy(second))
    c.extend(second)
    assert c.keys.shape == (2, H, 300 + pool_kv.ROOM_SLACK, D)
    ref.filter([0])
    c.filter([0])
    make_roomy([c], rows=3, longest=60)
    for n in (20, 25):
        s = sequence(n)
        ref.extend(copy.deepcopy(s))
        c.extend(s)
    mx.eval(c.keys, c.values)
    assert c.keys.shape == (3, H, 60 + pool_kv.ROOM_SLACK, D)
    same(ref, c)


def pool_of(lengths, longest: int) -> tuple[BatchKVCache, RoomyKVCache]:
    """mlx-lm's batch cache of sequences of these lengths, and the same as a pool with room
    for 4 rows of up to ``longest`` tokens (evaluated)."""
    ref = sequence(lengths[0])
    c = make_roomy([copy.deepcopy(ref)], rows=4, longest=longest)[0]
    for n in lengths[1:]:
        s = sequence(n)
        ref.extend(copy.deepcopy(s))
        c.extend(s)
    mx.eval(c.keys, c.values)
    return ref, c


def test_a_drop_of_the_shared_padding_moves_the_rows_left_in_place(monkeypatch):
    monkeypatch.setattr(pool_kv, "SHIFT_COLUMNS", 16)
    ref, c = pool_of((100, 10, 30), longest=600)
    shape = c.keys.shape
    whole = c.keys.nbytes + c.values.nbytes
    ref.filter([1, 2])
    assert held_peak(lambda: c.filter([1, 2])) < whole / 4
    assert c._idx == 30 and c.left_padding.tolist() == [20, 0] and c.keys.shape == shape
    same(ref, c)
    s = sequence(50)  # longer again: moved right, in place
    ref.extend(copy.deepcopy(s))
    c.extend(s)
    same(ref, c)
    assert c.keys.shape == shape


def test_a_decode_step_without_room_drops_the_shared_padding_in_place_before_it():
    """Room for sequences of up to 100 tokens: the longest finishes, the others decode on
    past the buffer's end, and before the step that would find no room the shared padding
    moves out of their way (the buffer is not grown; each step's mask, made before it
    writes, fits its keys); every sequence stays mlx-lm's."""
    ref, c = pool_of((100, 20, 30), longest=100)
    ref.filter([1, 2])
    c.filter([1, 2])  # shared padding 70: kept (below SHIFT_COLUMNS)
    mx.eval(c.keys, c.values)
    shape = c.keys.shape
    assert shape[2] == 100 + pool_kv.ROOM_SLACK
    moved = []
    for _ in range(80):
        k, v = mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D))
        ref.update_and_fetch(k, v)
        before = c._idx
        pool_kv.make_room(pool(c))
        moved += [c._idx != before]
        mask = c.make_mask(1, return_array=True)
        keys, values = c.update_and_fetch(k, v)
        assert mask.shape[-1] == keys.shape[2]
        mx.eval(keys, values)
        same(ref, c)
    assert moved.count(True) == 1 and moved.index(True) == 64  # once, at the step that found no room
    assert c.keys.shape == shape and c.left_padding.tolist() == [10, 0]
    assert not c.make_room(1)  # room now: nothing moves
