"""LRU evicts the least recently used expert that is not protected."""

import pytest

from mlx_tier.policy import LRUPolicy, make_policy


def test_lru_order_and_protection():
    p = LRUPolicy()
    for e in (3, 1, 7):
        p.insert(e)
    p.access(3)  # order now 1, 7, 3
    assert p.evict() == 1
    assert p.evict(protected={7}) == 3
    assert len(p) == 1
    with pytest.raises(RuntimeError):
        p.evict(protected={7})


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo")
