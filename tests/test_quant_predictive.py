"""Predictive transform coding (quant/predictive.py) and mixed-width fields (quant/fields.py)."""

import pytest
import torch

from calibrate.quant import predictive as P
from calibrate.quant.fields import fields_nbytes, pack_fields, unpack_fields
from calibrate.quant.packing import pack

I64 = torch.int64


# ---- fields -------------------------------------------------------------------------------------
def reference_pack_fields(values, widths):
    """Slow, obvious path: write every field bit by bit into the LSB-first stream."""
    out = bytearray(fields_nbytes(widths))
    j = 0
    for v, w in zip(values, widths):
        for k in range(w):
            out[j // 8] |= ((v >> k) & 1) << (j % 8)
            j += 1
    return bytes(out)


def test_fields_hand_computed_vector():
    # 5 = 101 (3 bits) | 17 = 10001 (5 bits) | 1 (1 bit) | 200 (8 bits) | 3 (2 bits), a 0-width field
    values = torch.tensor([[5, 0, 17, 1, 200, 3]])
    packed = pack_fields(values, [3, 0, 5, 1, 8, 2])
    assert bytes(packed[0].tolist()) == bytes.fromhex("8d9107")
    assert torch.equal(unpack_fields(packed, [3, 0, 5, 1, 8, 2]), values)


def test_fields_match_slow_reference_and_round_trip():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        widths = torch.randint(0, 17, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        values = torch.stack([torch.randint(0, 1 << w, (5,), generator=g) if w else torch.zeros(5, dtype=I64)
                              for w in widths], dim=-1)
        packed = pack_fields(values, widths)
        assert packed.shape == (5, fields_nbytes(widths))
        for row in range(5):
            assert bytes(packed[row].tolist()) == reference_pack_fields(values[row].tolist(), widths)
        assert torch.equal(unpack_fields(packed, widths), values)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_uniform_fields_equal_the_block_packing_for_whole_blocks(bits):
    codes = torch.randint(0, 2**bits, (4, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(pack_fields(codes, [bits] * 24), pack(codes, bits))


def test_fields_reject_bad_input():
    with pytest.raises(ValueError, match="does not fit"):
        pack_fields(torch.tensor([4]), [2])
    with pytest.raises(ValueError, match="fields"):
        pack_fields(torch.tensor([1, 2]), [2])
    with pytest.raises(ValueError, match="widths"):
        pack_fields(torch.tensor([1]), [17])
    with pytest.raises(ValueError, match="bytes"):
        unpack_fields(torch.zeros(3, dtype=torch.uint8), [8, 8])


# ---- predictive code ----------------------------------------------------------------------------
def params(D=4, bits=(2, 2, 1, 0), intra=(3, 2, 4, 1), inter=(1, 1, 2, 1), anchor=(5, 5, 4, 0), unit=(0.5, 0.25, 1.0, 1.0)):
    return P.PredictiveParams(
        mean_D=torch.zeros(D), rotation_DD=torch.eye(D), unit_D=torch.tensor(unit),
        bits_D=torch.tensor(bits), intra_step_D=torch.tensor(intra), inter_step_D=torch.tensor(inter),
        anchor_bits_D=torch.tensor(anchor))


def test_intra_levels_hand_computed():
    p = params()
    # component 0: unit 0.5, 2 bits, step 3 -> levels v in {-9, -3, 3, 9}, values {-4.5, -1.5, 1.5, 4.5}
    # component 2: unit 1, 1 bit, step 4 -> v in {-4, 4}; component 3: 0 bits -> v = 0
    x = torch.tensor([[[1.4, 0.1, -0.2, 7.0]]])
    c, v = P.intra(P.to_units(x, p), p)
    assert c.tolist() == [[[2, 2, 0, 0]]]
    assert v.tolist() == [[[3, 2, -4, 0]]]  # comp 1: unit .25, step 2: levels {-6,-2,2,6} -> tau .4 -> v=2
    assert torch.allclose(P.values(v, p), torch.tensor([[[1.5, 0.5, -4.0, 0.0]]]))


def test_inter_steps_from_the_previous_state_and_stay_in_the_anchor_range():
    p = params()
    v_prev = torch.tensor([[[14, 0, 4, 0]]])  # component 0 at its limit 2^4 - 1 = 15 minus 1
    tau = torch.tensor([[[40.0, 1.2, 9.0, 3.0]]])
    c, v = P.inter(tau, v_prev, p)
    # comp 0: steps {-3,-1,1,3}: wants +3 but 14 + 3 > 15, +1 is the largest allowed
    assert v[0, 0, 0] == 15 and c[0, 0, 0] == 2
    assert v[0, 0, 1] == 1  # tau 1.2 from 0 with steps {-3,-1,1,3}: +1
    assert v[0, 0, 2] == 6  # 1 bit, steps {-2, +2}: wants +2 (4 -> 6 <= limit 7)
    assert v[0, 0, 3] == 0  # 0-bit component keeps its state
    assert bool((v.abs() <= p.limit_D).all())


def test_inter_range_never_empty_at_the_limits():
    p = params()
    for edge in (p.limit_D, -p.limit_D):
        lo, hi = P.inter_range(edge.view(1, 1, -1), p)
        assert bool((lo <= hi).all())


def test_encode_picks_the_mode_with_the_smaller_error_and_decoder_agrees():
    torch.manual_seed(0)
    D = 8
    R = torch.linalg.qr(torch.randn(D, D))[0]
    p = P.PredictiveParams(torch.randn(D) * 0.1, R, torch.full((D,), 0.05), torch.tensor([4, 3, 3, 2, 2, 1, 1, 0]),
                           torch.tensor([4, 6, 6, 10, 10, 16, 16, 1]), torch.tensor([1, 1, 1, 2, 2, 3, 3, 1]),
                           torch.tensor([8, 8, 8, 8, 8, 8, 8, 0]))
    x0 = torch.randn(2, 16, D) * 0.3
    m0, c0, v0 = P.encode(x0, p, None)
    assert not m0.any()
    assert torch.equal(P.apply_codes(m0, c0, None, p), v0)
    x1 = x0 + 0.01 * torch.randn_like(x0)  # barely moved: inter wins
    m1, c1, v1 = P.encode(x1, p, v0)
    assert m1.float().mean() > 0.9
    assert torch.equal(P.apply_codes(m1, c1, v0, p), v1)
    tau = P.to_units(x1, p)
    w = p.unit_D**2
    _, vi = P.intra(tau, p)
    _, vp = P.inter(tau, v0, p)
    best = torch.minimum(((tau - vi) ** 2 * w).sum(-1), ((tau - vp) ** 2 * w).sum(-1))
    assert torch.allclose(((tau - v1) ** 2 * w).sum(-1), best)


def test_anchor_fields_round_trip_and_fit_their_widths():
    p = params()
    v = torch.tensor([[[-15, 15, -7, 0], [3, -2, 7, 0]]])
    f = P.anchor_fields(v, p)
    assert bool((f >= 0).all()) and bool((f < (1 << p.anchor_bits_D)).all())
    assert torch.equal(P.from_anchor_fields(f, p), v)
    assert torch.equal(unpack_fields(pack_fields(f, p.anchor_bits_D), p.anchor_bits_D), f)


def test_closed_loop_does_not_drift_on_a_static_input_over_1024_frames():
    torch.manual_seed(1)
    D = 8
    p = P.PredictiveParams(torch.zeros(D), torch.eye(D), torch.full((D,), 0.01), torch.full((D,), 2),
                           torch.full((D,), 20), torch.full((D,), 1), torch.full((D,), 12))
    x = torch.randn(1, 4, D).clamp(-1, 1)
    frames = P.fake_quant_sequence(x.unsqueeze(1).expand(1, 1024, 4, D).contiguous(), p)
    err = (frames - x.unsqueeze(1)).abs().amax(dim=(0, 2, 3))
    # the first (intra) frame is coarse; inter steps of 1 unit converge and then hold within a unit
    assert float(err[-1]) <= 0.01 + 1e-6
    assert float(err[100:].max()) <= 0.01 + 1e-6


def test_intra_only_ablation_is_frame_independent():
    torch.manual_seed(2)
    p = params()
    x = torch.randn(1, 5, 3, 4)
    seq = P.fake_quant_sequence(x, p, intra_only=True)
    for f in range(5):
        _, v = P.intra(P.to_units(x[:, f], p), p)
        assert torch.equal(seq[:, f], P.values(v, p))


def test_the_sink_hold_never_codes_a_token_worse_and_a_still_camera_keeps_the_sinks_uncoded_part():
    """The hold is set exactly where the sink's uncoded components are nearer the token's than the
    mean (so it never adds error, in a random rotation too), and a token equal to the sink's takes
    its uncoded components exactly."""
    torch.manual_seed(3)
    D = 6
    R = torch.linalg.qr(torch.randn(D, D))[0]
    p = P.PredictiveParams(torch.randn(D), R, torch.full((D,), 0.1), torch.tensor([2, 2, 1, 0, 0, 0]),
                           torch.full((D,), 3), torch.full((D,), 1), torch.tensor([6, 6, 5, 0, 0, 0]),
                           torch.full((D,), 0.01), torch.full((D,), 12))
    sink_x = torch.randn(2, 50, D)
    w = P.sink_code(sink_x, p)
    x = sink_x + torch.randn(2, 50, D) * torch.linspace(0.01, 2.0, 50)[:, None]  # near the sink, then far
    _, _, v = P.encode(x, p, None)
    plain = P.values(v, p)
    hold = P.sink_hold(x, w, p)
    held = P.held_values(plain, hold, P.sink_hold_part(w, p))
    err_plain, err_held = (plain - x).pow(2).sum(-1), (held - x).pow(2).sum(-1)
    assert (err_held <= err_plain + 1e-5).all()
    assert hold[:, :5].all() and not hold[:, -5:].all()  # near the sink: held; far: not always
    uncoded = P.to_units(x, p)[..., 3:] * 0.1  # u of the uncoded components
    better = ((uncoded - 0.01 * w[..., 3:].float()).pow(2).sum(-1) < uncoded.pow(2).sum(-1))
    assert torch.equal(hold, better)
    _, _, v0 = P.encode(sink_x, p, None)  # a still camera: the frame is the sink itself
    same = P.held_values(P.values(v0, p), P.sink_hold(sink_x, w, p), P.sink_hold_part(w, p))
    u_same = (same - p.mean_D) @ R
    torch.testing.assert_close(u_same[..., 3:], 0.01 * w[..., 3:].float(), atol=1e-5, rtol=0)


# ---- fitting (fit/predictive.py) ----------------------------------------------------------------
from calibrate.fit import predictive as FP  # noqa: E402


@pytest.mark.parametrize("bits", range(1, 9))
def test_gaussian_step_table_is_the_mse_optimum(bits):
    step = FP.gaussian_uniform_step(bits)
    assert step == pytest.approx(FP.GAUSSIAN_STEP[bits], abs=2e-4)
    assert FP.gaussian_uniform_mse(step, bits) == pytest.approx(FP.GAUSSIAN_MSE[bits], rel=2e-3)


def test_gaussian_mse_hand_computed_one_bit():
    # levels +-s/2 on N(0,1): E[(|x| - s/2)^2] = 1 - s*sqrt(2/pi) + s^2/4
    s = 1.2
    assert FP.gaussian_uniform_mse(s, 1) == pytest.approx(1 - s * (2 / torch.pi) ** 0.5 + s * s / 4, rel=1e-9)


def test_allocation_spends_the_budget_strongest_first():
    w = torch.tensor([16.0, 4.0, 1.0, 0.25, 0.0])
    bits = FP.allocate_bits(w, 10)
    assert int(bits.sum()) == 10
    assert bits.tolist() == sorted(bits.tolist(), reverse=True)
    assert bits[-1] == 0  # zero variance never gets a bit
    # reverse water-filling: about half a bit per factor of 2 in standard deviation
    assert bits.tolist() == [4, 3, 2, 1, 0]


def test_an_uncoded_component_costs_its_whole_variance():
    """w = [4, 1], uncoded = [4, 50]: the first bit lowers component 1 from 50 to 1 * mse(1) (gain
    49.64), more than component 0 from 4 to 4 * mse(1) (2.55); priced by w (the old allocation)
    component 0 wins."""
    w, uncoded = torch.tensor([4.0, 1.0]), torch.tensor([4.0, 50.0])
    assert FP.allocate_bits(w, 1, uncoded_D=uncoded).tolist() == [0, 1]
    assert FP.allocate_bits(w, 1).tolist() == [1, 0]
    # then: component 0's first bit (gain 4 - 1.4536 = 2.55) beats component 1's second (1 * (0.3634 - 0.1188))
    assert FP.allocate_bits(w, 2, uncoded_D=uncoded).tolist() == [1, 1]
    torch.manual_seed(0)
    w = torch.rand(16) * 10
    assert torch.equal(FP.allocate_bits(w, 20, uncoded_D=w), FP.allocate_bits(w, 20))  # uncoded = w: the old rule


def test_a_still_component_far_from_the_mean_is_coded():
    """Variance 0.3 but no frame-to-frame change (a still camera's content): uncoded it makes the
    same error of variance 0.3 in every frame, so `waterfill_variance` codes it; priced by its
    change (w = 0.1 * 0.3, the default) it is left out."""
    D = 8
    cov = torch.diag(torch.tensor([0.3, 1.0, 0.8, 0.6, 0.5, 0.4, 0.2, 1e-6]))
    delta = torch.diag(torch.tensor([1e-8, 0.3, 0.3, 0.3, 0.2, 0.2, 0.1, 1e-8]))
    still = FP.fit_head(torch.zeros(D), cov, delta, 1.0, allocation="waterfill_variance")
    old = FP.fit_head(torch.zeros(D), cov, delta, 1.0, allocation="waterfill")
    first = lambda p: int(p.bits_D[torch.argmax(p.rotation_DD[0].abs())])  # the width of the still component
    assert first(still) >= 1 and first(old) == 0


def test_fitted_head_is_consistent():
    torch.manual_seed(3)
    D = 16
    A = torch.randn(D, D) * torch.logspace(0, -2, D)
    cov = A @ A.T
    p = FP.fit_head(torch.randn(D), cov, cov * 0.01, 2.0)
    assert int(p.bits_D.sum()) == 32
    assert torch.allclose(p.rotation_DD.T @ p.rotation_DD, torch.eye(D), atol=1e-5)
    coded = p.bits_D > 0
    assert bool((p.anchor_bits_D[coded] >= 2).all()) and bool((p.anchor_bits_D[~coded] == 0).all())
    assert bool((p.intra_step_D * p.levels_D <= p.limit_D).all())
    assert bool((p.anchor_bits_D <= 16).all()) and bool((p.unit_D > 0).all())


def test_twice_the_anchor_reach_costs_at_most_one_bit_and_holds_twice_the_deviations():
    torch.manual_seed(3)
    D = 16
    A = torch.randn(D, D) * torch.logspace(0, -2, D)
    cov = A @ A.T
    near, far = (FP.fit_head(torch.zeros(D), cov, cov * 0.01, 2.0, clip_sd=sd) for sd in (4.0, 8.0))
    assert torch.equal(near.unit_D, far.unit_D) and torch.equal(near.bits_D, far.bits_D)  # the same grid
    sigma = torch.diagonal(near.rotation_DD.T @ cov @ near.rotation_DD).sqrt()
    coded = near.bits_D > 0
    assert bool((far.limit_D[coded] * far.unit_D[coded] >= 8.0 * sigma[coded] * (1 - 1e-6)).all())
    assert bool(((far.anchor_bits_D - near.anchor_bits_D)[coded] <= 1).all()) and bool((far.anchor_bits_D >= near.anchor_bits_D).all())


def test_anchors_reach_the_calibration_peak_where_it_is_past_the_fixed_reach():
    """A component whose traced peak is past clip_sd sigma / peak_mult gets an anchor holding
    peak_mult * peak; the others, and the grid, are those of the fixed reach."""
    torch.manual_seed(3)
    D = 16
    A = torch.randn(D, D) * torch.logspace(0, -2, D)
    cov = A @ A.T
    fixed = FP.fit_head(torch.zeros(D), cov, cov * 0.01, 2.0, clip_sd=4.0)
    sigma = torch.diagonal(fixed.rotation_DD.T @ cov @ fixed.rotation_DD).sqrt()
    peak = 1.5 * sigma  # 2 x 1.5 sigma: inside 4 sigma
    peak[0], peak[3] = 9.0 * sigma[0], 5.0 * sigma[3]  # 18 and 10 sigma: past it
    got = FP.fit_head(torch.zeros(D), cov, cov * 0.01, 2.0, clip_sd=4.0, peak_D=peak, peak_mult=2.0)
    assert torch.equal(got.unit_D, fixed.unit_D) and torch.equal(got.bits_D, fixed.bits_D)
    assert torch.equal(got.inter_step_D, fixed.inter_step_D) and torch.equal(got.intra_step_D, fixed.intra_step_D)
    for i in (0, 3):
        assert float(got.limit_D[i] * got.unit_D[i]) >= 2.0 * float(peak[i]) * (1 - 1e-6)
        assert int(got.anchor_bits_D[i]) > int(fixed.anchor_bits_D[i])
    rest = torch.ones(D, dtype=torch.bool)
    rest[[0, 3]] = False
    assert torch.equal(got.anchor_bits_D[rest], fixed.anchor_bits_D[rest])
    off = FP.fit_head(torch.zeros(D), cov, cov * 0.01, 2.0, clip_sd=4.0, peak_D=peak, peak_mult=0.0)
    assert torch.equal(off.anchor_bits_D, fixed.anchor_bits_D)


def test_trace_peaks_are_the_largest_deviations_past_the_sink_in_the_fitted_basis():
    from calibrate.fit.predictive_codes import trace_peaks

    g = torch.Generator().manual_seed(5)
    B, H, F, T, D = 2, 2, 5, 3, 4
    x = torch.randn(B, H, F, T, D, generator=g)
    x[:, :, 0] = 100.0  # the sink frame: its own code, not counted
    mean = torch.randn(H, D, generator=g)
    A = torch.randn(H, D, D, generator=g)
    cov = (A @ A.transpose(1, 2)).double()
    delta = cov * 0.5 + torch.eye(D, dtype=torch.float64)
    got = trace_peaks(x, mean, cov, delta, "pca", sink_frames=1)
    change = trace_peaks(x, mean, cov, delta, "change", sink_frames=1)
    for h in range(H):
        for peaks, R in ((got, FP.pca(cov[h])[1]), (change, FP.pca(cov[h] + delta[h])[1])):
            u = (x[:, h, 1:].reshape(-1, D) - mean[h]) @ R
            assert torch.equal(peaks[h], u.abs().amax(0))
    plain = trace_peaks(x, mean, cov, delta, "identity", sink_frames=1)
    assert torch.equal(plain, (x[:, :, 1:] - mean[None, :, None, None]).abs().amax(dim=(0, 2, 3)))


def field_golden_vectors():
    """Rows `| widths | values | packed hex |` of FORMAT.md's field golden vectors."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "recipes" / "FORMAT.md").read_text(encoding="utf-8")
    section = text.split("#### Field golden vectors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*([\d ]+?)\s*\|\s*([\d ]+?)\s*\|\s*([0-9a-f]+)\s*\|\s*$", section, re.MULTILINE)
    return [([int(w) for w in ws.split()], [int(v) for v in vs.split()], bytes.fromhex(h)) for ws, vs, h in rows]


def test_field_golden_vectors_of_the_format():
    rows = field_golden_vectors()
    assert len(rows) >= 5
    for widths, values, packed in rows:
        got = pack_fields(torch.tensor([values]), widths)
        assert bytes(got[0].tolist()) == packed, widths
        assert unpack_fields(got, widths)[0].tolist() == values
        assert bytes(got[0].tolist()) == reference_pack_fields(values, widths)


# ---- the sink code (format 1.3) ---------------------------------------------------------------
def _sink_params(D=8, seed=0, sink_bits=6.0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(D, D, generator=g) * torch.logspace(0, -2, D)
    cov = A @ A.T
    return FP.fit_head(torch.zeros(D), cov, cov * 0.01, 2.0, sink_bits=sink_bits), cov


def test_sink_fit_spends_at_most_its_bits_on_one_step_and_reaches_its_deviations():
    sigma = torch.tensor([4.0, 1.0, 0.25, 0.01])
    for avg in (2.0, 4.0, 6.0, 8.0):
        unit, bits = FP.fit_sink(sigma, avg, 8.0)
        assert float(bits.float().mean()) <= avg and torch.all(unit == unit[0])  # one step: equal distortion
        reach = torch.where(bits > 0, (1 << (bits - 1).clamp_min(0)) - 1, 0) * unit
        coded = bits > 0  # exactly the components whose reach is at least half a step (at the bisection's float64 step)
        assert bool((8.0 * sigma[~coded] <= unit[~coded] / 2 * (1 + 1e-6)).all())
        assert bool((reach[coded] >= 8.0 * sigma[coded] - unit[coded]).all())
    finer = [float(FP.fit_sink(sigma, avg, 8.0)[0][0]) for avg in (2.0, 4.0, 6.0)]
    assert finer[0] > finer[1] > finer[2]  # more bits, a finer step


def test_sink_code_is_within_half_a_step_in_range_and_the_chain_continues_from_it():
    p, cov = _sink_params()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g) @ torch.linalg.cholesky(cov).T  # [B, T, D] like the fitted data
    w = P.sink_code(x, p)
    u = (x - p.mean_D) @ p.rotation_DD
    inside = w.abs() < P.sink_limit(p)
    err = (u - p.sink_unit_D * w.float()).abs()
    assert bool((err[inside] <= p.sink_unit_D.expand_as(err)[inside] / 2 + 1e-6).all())
    assert torch.equal(P.from_sink_fields(P.sink_fields(w, p), p), w)
    assert bool((P.sink_fields(w, p) < (1 << p.sink_bits_D)).all()) and bool((P.sink_fields(w, p) >= 0).all())
    v = P.sink_states(w, p)
    assert bool((v.abs() <= p.limit_D).all()) and bool((v[..., p.bits_D == 0] == 0).all())
    x_seq = torch.stack([x, x + 0.01], dim=1)  # [B, F, T, D]: the sink, then a frame coded against its states
    out = P.fake_quant_sequence(x_seq, p, sink_frames=1)
    assert torch.equal(out[:, 0], P.sink_values(w, p))
    _, _, v1 = P.encode(x_seq[:, 1], p, v)
    assert torch.equal(out[:, 1], P.values(v1, p))
    sink_err = (out[:, 0] - x).pow(2).mean()
    intra_err = (P.fake_quant_sequence(x_seq, p)[:, 0] - x).pow(2).mean()
    assert sink_err < intra_err / 10  # 6 bits per component against the chain's 2-bit intra frame


def test_a_code_without_sink_roles_ignores_the_sink_frames():
    p, cov = _sink_params(sink_bits=0.0)
    assert not p.has_sink
    x = torch.randn(1, 3, 2, 8)
    assert torch.equal(P.fake_quant_sequence(x, p, sink_frames=2), P.fake_quant_sequence(x, p))


def test_a_sink_code_never_clips_a_component_to_fit_16_bits():
    """A low-rank head (WanWorld's first layer: most components ~0) must not buy a step so fine that
    its strong components hit the 16-bit cap: the step stops where the widest reach fits."""
    sigma = torch.cat([torch.tensor([5.0, 3.0, 1.0]), torch.full((61,), 1e-9)])
    unit, bits = FP.fit_sink(sigma, 6.0, 8.0)
    reach = ((1 << (bits - 1).clamp_min(0)) - 1) * unit
    assert int(bits.max()) <= 16 and bool((reach[:3] >= 8.0 * sigma[:3] - unit[:3]).all())
    assert float(bits.float().mean()) <= 6.0


def test_the_change_basis_leads_with_what_changes_between_frames():
    """A channel that barely varies but carries all the frame-to-frame change is the PCA's last
    component and the `change` basis's first (fit.basis=change: the covariance plus the change's)."""
    cov = torch.diag(torch.tensor([100.0, 4.0, 1.0, 0.5], dtype=torch.float64))
    delta = torch.diag(torch.tensor([0.01, 0.01, 0.01, 200.0], dtype=torch.float64))
    first = lambda R: int(R[:, 0].abs().argmax())
    assert first(FP.head_basis(cov, "pca", delta)) == 0 and first(FP.head_basis(cov, "change", delta)) == 3
    assert torch.equal(FP.head_basis(cov, "identity", delta), torch.eye(4))
