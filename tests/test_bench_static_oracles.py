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


def test_round_robin_refreshes_m_uncoded_components_a_frame_in_turn():
    from benchmarks.static_oracles import round_robin_due

    uncoded = torch.tensor([False, True, False, True, True, False, True, True])  # U = [1, 3, 4, 6, 7]
    # period 2: m = ceil(5 / 2) = 3 per frame: U[0..2], U[3, 4, 0], U[1..3], ...
    want = [[1, 3, 4], [6, 7, 1], [3, 4, 6], [7, 1, 3]]
    for f, comps in enumerate(want):
        assert round_robin_due(uncoded, 2, f).nonzero().flatten().tolist() == sorted(comps), f
    assert not round_robin_due(torch.zeros(8, dtype=torch.bool), 2, 0).any()


def test_round_robin_holds_coded_refreshes_and_starts_at_the_mean():
    sigma = torch.ones(4)
    rr, xs = OracleCoder(HeadCoder(params(), "nearest", 0, torch.Generator().manual_seed(0)), ("rr", 2, 8), sigma), frames(5)
    out = [rr.code(x) for x in xs]
    # U = [2, 3], period 2: m = 1; frame f refreshes component U[f % 2]; unit 0.5, 8 bits over +-3 sigma
    assert torch.equal(out[0][..., 3], torch.zeros(1, 3))  # not refreshed yet: the mean
    for f, y in enumerate(out):
        i = (2, 3)[f % 2]
        assert torch.allclose(y[..., i], xs[f][..., i].clamp(-1.5, 1.5), atol=0.5 * 6 / 256)  # this frame's, r bits
        if f:
            j = (2, 3)[(f - 1) % 2]
            assert torch.equal(y[..., j], out[f - 1][..., j])  # held from the frame before


def test_bad_arguments_get_one_line_and_exit_2(capsys, tmp_path):
    from benchmarks.static_oracles import main

    assert main(["--oracle", "no such oracle", "--out", str(tmp_path)]) == 2
    assert main(["--model", "nosuch", "--out", str(tmp_path)]) == 2
    assert main(["--recipe", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("static_oracles: ") for line in err)
    assert not list(tmp_path.iterdir())
