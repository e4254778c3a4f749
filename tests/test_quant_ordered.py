"""quant/ordered.py: float32 sums in FORMAT.md's halving-tree order, against a slow scalar reference."""

import numpy as np
import pytest
import torch

from calibrate.quant import ordered


def slow_tree(terms: list[np.float32]) -> np.float32:
    """FORMAT.md's definition, one float32 addition at a time."""
    t = [np.float32(v) for v in terms]
    n = len(t)
    while n > 1:
        m = (n + 1) // 2
        for i in range(n - m):
            t[i] = np.float32(t[i] + t[i + m])
        n = m
    return t[0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 64])
def test_tree_sum_is_the_documented_order(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(6, n, generator=g) * torch.logspace(-6, 6, n)  # magnitudes that make order matter
    got = ordered.tree_sum(t)
    for row, value in zip(t.numpy(), got.numpy()):
        assert np.float32(value).tobytes() == slow_tree(list(row)).tobytes()


@pytest.mark.parametrize("chunk", [ordered.CHUNK_ELEMENTS, 40])
def test_matmul_distances_and_norms_are_tree_sums_of_float32_products(monkeypatch, chunk):
    monkeypatch.setattr(ordered, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(1)
    x, m, c = torch.randn(2, 5, 11, generator=g), torch.randn(11, 6, generator=g), torch.randn(4, 11, generator=g)
    assert torch.equal(ordered.matmul(x, m), ordered.tree_sum(x[..., None, :] * m.T))
    assert torch.equal(ordered.sq_distances(x, c), ordered.tree_sum((x[..., None, :] - c) ** 2))
    assert torch.equal(ordered.sum_squares(x)[..., 0], ordered.tree_sum(x * x))
    cb = torch.randn(2, 3, 11, generator=g)
    assert torch.equal(ordered.batched_dot(x, cb), ordered.tree_sum(x[:, :, None, :] * cb[:, None]))
    np.testing.assert_allclose(ordered.matmul(x, m), x @ m, rtol=1e-5, atol=1e-5)  # the same product, another order


def test_matmul_is_independent_of_the_batch():
    """A row's result does not depend on which rows share its call (BLAS blocking can)."""
    g = torch.Generator().manual_seed(2)
    x, m = torch.randn(300, 64, generator=g), torch.randn(64, 64, generator=g)
    whole = ordered.matmul(x, m)
    assert all(torch.equal(whole[i], ordered.matmul(x[i : i + 1], m)[0]) for i in range(0, 300, 37))
