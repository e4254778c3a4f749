"""The still-camera oracles (benchmarks/static_oracles.py) change exactly the part they name."""

import torch

from benchmarks.coherence_study import HeadCoder
from benchmarks.static_oracles import OracleCoder
from calibrate.quant.predictive import PredictiveParams


def params(D=4):
    bits = torch.tensor([2, 1, 0, 0])  # components 2 and 3 uncoded
    return PredictiveParams(torch.zeros(D), torch.eye(D), torch.full((D,), 0.5), bits, torch.ones(D, dtype=torch.long),
                            torch.ones(D, dtype=torch.long), torch.where(bits > 0, 6, 0))


def coder(mode):
    return OracleCoder(HeadCoder(params(), "nearest", 0, torch.Generator().manual_seed(0)), mode)


def frames(n=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 3, 4, generator=g) for _ in range(n)]


def test_exact_stores_the_input_and_refresh_1_only_fixes_the_uncoded_components():
    exact, every, plain = coder("exact"), coder(1), HeadCoder(params(), "nearest", 0, torch.Generator().manual_seed(0))
    for x in frames():
        assert torch.equal(exact.code(x), x)
        got, shipped = every.code(x), plain.code(x)
        assert torch.equal(got[..., 2:], x[..., 2:])  # identity rotation: uncoded components are exact
        assert torch.equal(got[..., :2], shipped[..., :2])  # coded ones as shipped
        assert not torch.equal(shipped[..., 2:], x[..., 2:])  # shipped holds them at the mean


def test_a_refresh_period_holds_each_uncoded_component_between_its_staggered_refreshes():
    held, xs = coder(3), frames(7)
    out = [held.code(x) for x in xs]
    for f, y in enumerate(out):
        for i in (2, 3):
            last = max(g for g in range(f + 1) if g == 0 or (i + g) % 3 == 0)  # frame 0 fills every component
            assert torch.equal(y[..., i], xs[last][..., i]), (f, i)
