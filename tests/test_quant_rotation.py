"""Rotations: orthogonality, q.k invariance, inverse, determinism, outlier spreading."""

import math

import pytest
import torch

from calibrate.quant import rotation as R


def test_hadamard_small():
    h = R.hadamard(4)
    expect = torch.tensor(
        [[1.0, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    )
    assert torch.equal(h, expect)
    assert torch.equal(R.hadamard(1), torch.ones(1, 1))


@pytest.mark.parametrize("n", [0, 3, 6, 96, 100, -4, 2.0, True])
def test_non_power_of_two_rejected(n):
    with pytest.raises(ValueError):
        R.hadamard(n)
    with pytest.raises(ValueError):
        R.random_hadamard(n, seed=0)


@pytest.mark.parametrize("n", [64, 128])
def test_orthogonal_to_1e5(n):
    for q in (R.random_hadamard(n, seed=1), R.random_orthogonal(n, seed=1)):
        assert q.shape == (n, n) and q.dtype == torch.float32
        assert R.orthogonality_error(q) <= 1e-5
        assert R.is_orthogonal(q)
    q = R.random_hadamard(n, seed=3)
    assert torch.allclose(q.abs(), torch.full((n, n), 1 / math.sqrt(n)))


def test_random_hadamard_is_normalized_hadamard_times_signs():
    n = 16
    q64 = R.random_hadamard(n, seed=5, dtype=torch.float64)
    signs = R.random_signs(n, seed=5)
    assert torch.equal(q64, R.hadamard(n, torch.float64) / 4.0 @ torch.diag(signs))


def test_is_orthogonal_rejects():
    assert not R.is_orthogonal(torch.ones(4, 4))
    assert not R.is_orthogonal(torch.eye(4)[:3])
    assert not R.is_orthogonal(torch.full((2, 2), float("nan")))
    q = R.random_orthogonal(8, seed=0)
    assert not R.is_orthogonal(q * 1.001)
    with pytest.raises(ValueError):
        R.orthogonality_error(torch.ones(3, 4))


@pytest.mark.parametrize("make", [R.random_hadamard, R.random_orthogonal])
def test_qk_invariance_and_inverse(make):
    gen = torch.Generator().manual_seed(0)
    q_TD = torch.randn(10, 128, generator=gen)
    k_SD = torch.randn(20, 128, generator=gen)
    rot = make(128, seed=11)
    logits = q_TD @ k_SD.T
    rotated = R.rotate(q_TD, rot) @ R.rotate(k_SD, rot).T
    assert torch.allclose(rotated, logits, atol=1e-4)
    # values: attention output computed in the rotated basis, rotated back
    v_SD = torch.randn(20, 128, generator=gen)
    p_TS = torch.softmax(logits / math.sqrt(128), dim=-1)
    out = R.unrotate(p_TS @ R.rotate(v_SD, rot), rot)
    assert torch.allclose(out, p_TS @ v_SD, atol=1e-5)


@pytest.mark.parametrize("make", [R.random_hadamard, R.random_orthogonal])
def test_deterministic_by_seed(make):
    assert torch.equal(make(64, seed=7), make(64, seed=7))
    assert not torch.equal(make(64, seed=7), make(64, seed=8))


def test_does_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    R.random_hadamard(64, seed=1)
    R.random_orthogonal(64, seed=1)
    assert torch.equal(torch.rand(1), before)


def test_hadamard_spreads_an_outlier_channel():
    x_TD = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    x_TD[:, 5] = 50.0  # one outlier channel (an attention anchor) dominates every token's absmax
    ratio = lambda t: (t.abs().amax(-1) / t.pow(2).mean(-1).sqrt()).mean().item()  # noqa: E731
    y_TD = R.rotate(x_TD, R.random_hadamard(128, seed=0))
    assert ratio(x_TD) > 10 and ratio(y_TD) < 2.5
