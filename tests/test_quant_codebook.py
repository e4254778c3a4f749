"""Non-uniform codebooks: nearest level with ties to the lower index, Lloyd-Max fitting."""

import pytest
import torch

from calibrate.quant import codebook as C

U8 = torch.uint8


def reference_nearest(x, levels):
    """Slow, obvious path: compare against every level; argmin returns the first minimum."""
    return (x.unsqueeze(-1) - levels).abs().argmin(dim=-1).to(U8)


def test_ties_go_to_lower_index():
    levels = torch.tensor([-1.0, -0.5, 0.5, 1.0])
    # midpoints -0.75, 0, 0.75 are exact in binary floating point
    x = torch.tensor([-0.75, 0.0, 0.75, -5.0, 5.0, -0.74, 0.01, 0.76])
    assert torch.equal(C.nearest_level(x, levels), torch.tensor([0, 1, 2, 0, 3, 1, 2, 3], dtype=U8))


def test_repeated_levels_pick_first():
    levels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    x = torch.tensor([0.5, 0.9, 0.0, -5.0, 5.0, 0.1])
    assert torch.equal(C.nearest_level(x, levels), torch.tensor([0, 2, 0, 0, 2, 0], dtype=U8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nearest_level_matches_reference(bits):
    gen = torch.Generator().manual_seed(bits)
    levels = torch.randn(2**bits, generator=gen).sort().values
    x = torch.randn(4, 1000, generator=gen) * 1.5
    # add exact ties: every midpoint that is exactly representable
    mids = (levels[1:] + levels[:-1]) / 2
    x = torch.cat([x.reshape(-1), mids, levels])
    assert torch.equal(C.nearest_level(x, levels), reference_nearest(x, levels))


def test_decode_and_shapes():
    levels = torch.tensor([-1.0, -0.25, 0.25, 1.0])
    x = torch.tensor([[0.9, -0.3], [0.2, -2.0]])
    codes = C.nearest_level(x, levels)
    assert codes.dtype == U8 and codes.shape == x.shape
    assert torch.equal(C.decode(codes, levels), torch.tensor([[1.0, -0.25], [0.25, -1.0]]))


def test_invalid_levels_and_codes():
    with pytest.raises(ValueError):
        C.nearest_level(torch.zeros(3), torch.tensor([1.0, 0.0]))  # not sorted
    with pytest.raises(ValueError):
        C.nearest_level(torch.zeros(3), torch.zeros(2, 2))  # not 1-D
    with pytest.raises(ValueError):
        C.nearest_level(torch.zeros(3), torch.tensor([0, 1]))  # integer levels
    with pytest.raises(ValueError):
        C.decode(torch.zeros(3, dtype=torch.int64), torch.tensor([0.0, 1.0]))
    for bits in (1, 5, True):
        with pytest.raises(ValueError):
            C.fit_levels(torch.randn(100), bits)
    with pytest.raises(ValueError):
        C.fit_levels(torch.empty(0), 2)
    with pytest.raises(ValueError):
        C.fit_levels(torch.tensor([0.0, float("nan")]), 2)
    with pytest.raises(ValueError):
        C.fit_levels(torch.randn(10), 2, weights=torch.ones(9))
    with pytest.raises(ValueError):
        C.fit_levels(torch.randn(10), 2, weights=-torch.ones(10))


def mse(x, levels, weights=None):
    err = (C.decode(C.nearest_level(x, levels), levels) - x).pow(2)
    return (err if weights is None else err * weights).mean().item()


def test_fit_levels_beats_uniform_on_gaussian_2bit():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    x_scaled = x / x.abs().max()  # normalized by absmax into [-1, 1], as KVQuant does per channel
    fitted = C.fit_levels(x_scaled, 2)
    assert fitted.shape == (4,) and torch.all(fitted[1:] > fitted[:-1])
    assert fitted.abs().max() <= 1
    assert mse(x_scaled, fitted) < 0.5 * mse(x_scaled, C.uniform_levels(2))


def test_fit_levels_reaches_lloyd_max_gaussian():
    # the 2-bit Lloyd-Max quantizer of N(0, 1): levels ±0.4528, ±1.5104, MSE 0.1175
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    fitted = C.fit_levels(x, 2)
    expect = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
    assert torch.allclose(fitted, expect, atol=0.03)
    assert mse(x, fitted) == pytest.approx(0.1175, abs=0.003)


def test_fit_levels_deterministic():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2)).pow(3)
    w = torch.rand(5000, generator=torch.Generator().manual_seed(3))
    for bits in (2, 3, 4):
        assert torch.equal(C.fit_levels(x, bits), C.fit_levels(x.clone(), bits))
        assert torch.equal(C.fit_levels(x, bits, weights=w), C.fit_levels(x, bits, weights=w))


def test_weighted_fit_no_worse_on_its_own_objective():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8000, generator=gen)
    w = torch.where(x > 0.5, 10.0, 0.1)  # the weighted objective cares about the right tail
    weighted = C.fit_levels(x, 2, weights=w)
    plain = C.fit_levels(x, 2)
    assert mse(x, weighted, w) < mse(x, plain, w)
    assert mse(x, plain) < mse(x, weighted)


def test_fit_levels_degenerate_input():
    levels = C.fit_levels(torch.full((50,), 0.25), 2)
    assert torch.isfinite(levels).all() and torch.equal(levels, torch.full((4,), 0.25))
    codes = C.nearest_level(torch.full((5,), 0.25), levels)
    assert torch.equal(codes, torch.zeros(5, dtype=U8))
    two = C.fit_levels(torch.tensor([-1.0, 1.0, -1.0, 1.0]), 3)
    assert torch.isfinite(two).all() and torch.all(two[1:] >= two[:-1])
    assert set(two.tolist()) == {-1.0, 1.0}


def reference_fit(x, bits, weights=None, max_iters=100, tol=1e-7):
    """Lloyd's loop as written: code every sample, bincount each cell's weight and weighted sum."""
    x = x.reshape(-1).double()
    w = torch.ones_like(x) if weights is None else weights.reshape(-1).double()
    L = 2**bits
    order = x.argsort(stable=True)
    cum_w = w[order].cumsum(0)
    at = torch.searchsorted(cum_w, (torch.arange(L, dtype=torch.float64) + 0.5) / L * cum_w[-1]).clamp(max=x.numel() - 1)
    levels = x[order[at]]
    for _ in range(max_iters):
        codes = reference_nearest(x, levels).long()
        mass = torch.bincount(codes, weights=w, minlength=L)
        new = torch.where(mass > 0, torch.bincount(codes, weights=w * x, minlength=L) / mass.clamp_min(1e-300), levels)
        new = new.sort().values
        moved = (new - levels).abs().max().item()
        levels = new
        if moved <= tol:
            break
    return levels.float()


@pytest.mark.parametrize("repeats", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_fit_levels_equals_the_plain_lloyd_loop(repeats, weighted):
    """fit_levels codes cells as runs of the sorted samples (bisection + prefix sums): the levels
    equal those of the loop that codes every sample, ties and repeated samples included."""
    gen = torch.Generator().manual_seed(5)
    for n in (1, 7, 300, 4000):
        x = torch.randn(n, generator=gen) * 2
        if repeats:
            x = (x * 4).round() / 4  # many samples exactly on cell boundaries
        w = torch.rand(n, generator=gen) if weighted else None
        for bits in (2, 3, 4):
            assert torch.equal(C.fit_levels(x, bits, weights=w), reference_fit(x, bits, w)), (n, bits)
