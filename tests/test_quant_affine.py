"""Uniform affine quantization: exact codes on hand vectors, degenerate inputs, SQNR floors, STE."""

import math

import pytest
import torch

from calibrate.quant import affine as A

U8 = torch.uint8


def codes_of(x, bits, symmetric, clip_ratio=1.0):
    x = torch.tensor(x, dtype=torch.float32)
    scale, zp = A.compute_params(
        x, bits, symmetric=symmetric, reduce_dims=(-1,), clip_ratio=clip_ratio
    )
    return A.quantize(x, scale, zp, bits, symmetric), scale, zp


# --- exact codes (KIVI asymmetric formulas, round half to even) -------------------------


def test_asymmetric_kivi_codes_round_half_even():
    # min 0, max 3 -> scale 1, zero_point 0; 0.5 -> 0, 1.5 -> 2, 2.5 -> 2 (half to even)
    codes, scale, zp = codes_of([0.0, 0.5, 1.5, 2.5, 3.0], 2, False)
    assert scale.item() == 1.0 and zp.item() == 0.0
    assert torch.equal(codes, torch.tensor([0, 0, 2, 2, 3], dtype=U8))


def test_asymmetric_zero_point_is_min():
    # min -1, max 2 -> scale 1; (x + 1) = [0, .5, 1.5, 3] -> [0, 0, 2, 3]
    codes, scale, zp = codes_of([-1.0, -0.5, 0.5, 2.0], 2, False)
    assert zp.item() == -1.0 and scale.item() == 1.0
    assert torch.equal(codes, torch.tensor([0, 0, 2, 3], dtype=U8))
    x_hat = A.dequantize(codes, scale, zp, 2, False)
    assert torch.equal(x_hat, torch.tensor([-1.0, -1.0, 1.0, 2.0]))


def test_asymmetric_4bit_codes():
    # min -2, max 13 -> scale 15/15 = 1; x + 2 = [0, 15, 2.5, 6.5, 7]
    codes, _, _ = codes_of([-2.0, 13.0, 0.5, 4.5, 5.0], 4, False)
    assert torch.equal(codes, torch.tensor([0, 15, 2, 6, 7], dtype=U8))


def test_symmetric_2bit_seed_rule():
    # absmax 4 -> scale = absmax / 2 = 2; x/scale = [-2,-1.5,-.5,0,.5,1,1.5,2]
    # round -> [-2,-2,0,0,0,1,2,2], clamp to [-2,1], stored = q + 2
    codes, scale, zp = codes_of([-4.0, -3.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0], 2, True)
    assert scale.item() == 2.0 and zp.item() == 0.0
    assert torch.equal(codes, torch.tensor([0, 0, 2, 2, 2, 3, 3, 3], dtype=U8))
    x_hat = A.dequantize(codes, scale, zp, 2, True)
    assert torch.equal(x_hat, torch.tensor([-4.0, -4.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0]))


def test_symmetric_4bit_offset():
    # absmax 8 -> scale 1; q in [-8, 7]; stored = q + 8
    codes, _, _ = codes_of([-8.0, -7.5, 7.5, 8.0, 0.5], 4, True)
    assert torch.equal(codes, torch.tensor([0, 0, 15, 15, 8], dtype=U8))


def test_code_range():
    assert A.code_range(2, symmetric=True) == (-2, 1)
    assert A.code_range(3, symmetric=False) == (0, 7)
    assert A.code_range(8, symmetric=True) == (-128, 127)


# --- granularity ------------------------------------------------------------------------


def test_per_channel_and_per_token_params():
    x_TD = torch.tensor([[0.0, 1.0, -3.0], [3.0, 5.0, 3.0]])
    scale_c, zp_c = A.compute_params(x_TD, 2, symmetric=False, reduce_dims=A.PER_CHANNEL)
    assert scale_c.shape == (1, 3)
    assert torch.equal(zp_c, torch.tensor([[0.0, 1.0, -3.0]]))
    assert torch.equal(scale_c, torch.tensor([[1.0, 4.0 / 3.0, 2.0]]))
    scale_t, zp_t = A.compute_params(x_TD, 2, symmetric=False, reduce_dims=A.PER_TOKEN)
    assert scale_t.shape == (2, 1)
    assert torch.equal(zp_t, torch.tensor([[-3.0], [3.0]]))
    assert torch.equal(scale_t, torch.tensor([[4.0 / 3.0], [2.0 / 3.0]]))


def test_group_view_round_trip_and_per_group_params():
    x = torch.randn(2, 5, 64)
    xg = A.group_view(x, 16)
    assert xg.shape == (2, 5, 4, 16)
    assert torch.equal(A.ungroup(xg), x)
    scale, zp = A.compute_params(xg, 4, symmetric=False, reduce_dims=(-1,))
    assert scale.shape == (2, 5, 4, 1)
    assert torch.equal(zp[..., 0], xg.amin(-1))
    # grouping tokens instead of channels (KIVI keys: per-channel within blocks of tokens)
    xt = A.group_view(x, 5, dim=-2)
    assert xt.shape == (2, 1, 5, 64)
    assert torch.equal(A.ungroup(xt, dim=-2), x)
    assert torch.equal(A.ungroup(A.group_view(x, 32, dim=2), dim=2), x)


@pytest.mark.parametrize("group_size", [0, -4, 3, 48, 2.0, True])
def test_bad_group_size(group_size):
    with pytest.raises(ValueError):
        A.group_view(torch.zeros(2, 64), group_size)


@pytest.mark.parametrize("bits", [0, 1, 5, 16, True, 2.0, "2"])
def test_bad_bits(bits):
    x = torch.zeros(4)
    with pytest.raises(ValueError):
        A.compute_params(x, bits, symmetric=False, reduce_dims=(-1,))
    with pytest.raises(ValueError):
        A.quantize(x, torch.ones(1), None, bits, False)


def test_bad_arguments():
    x = torch.zeros(4)
    for ratio in (0.0, -0.5, 1.5, torch.tensor([0.5, 1.2])):
        with pytest.raises(ValueError):
            A.compute_params(x, 2, symmetric=False, reduce_dims=(-1,), clip_ratio=ratio)
    with pytest.raises(ValueError):
        A.compute_params(x, 2, symmetric=False, reduce_dims=())
    with pytest.raises(ValueError):
        A.dequantize(torch.zeros(4, dtype=torch.int64), torch.ones(1), None, 2, False)


# --- clipping ---------------------------------------------------------------------------


def test_clip_ratio_asymmetric_shrinks_about_midpoint():
    x = torch.tensor([0.0, 1.0, 4.0])
    scale, zp = A.compute_params(x, 2, symmetric=False, reduce_dims=(-1,), clip_ratio=0.5)
    # [0, 4] scaled by 0.5 about its midpoint 2 -> [1, 3]
    assert zp.item() == 1.0
    assert scale.item() == pytest.approx(2.0 / 3.0)
    codes = A.quantize(x, scale, zp, 2, False)
    assert torch.equal(codes, torch.tensor([0, 0, 3], dtype=U8))  # both ends saturate


def test_clip_ratio_symmetric_scales_absmax():
    x = torch.tensor([-4.0, 1.0, 3.0])
    scale, zp = A.compute_params(x, 2, symmetric=True, reduce_dims=(-1,), clip_ratio=0.5)
    assert scale.item() == 1.0 and zp.item() == 0.0


def test_clip_ratio_tensor_is_differentiable():
    x = torch.randn(8, 64)
    ratio = torch.full((1, 64), 0.9, requires_grad=True)
    scale, zp = A.compute_params(x, 2, symmetric=False, reduce_dims=(0,), clip_ratio=ratio)
    loss = (A.fake_quant(x, scale, zp, 2, False) - x).pow(2).sum()
    loss.backward()
    assert ratio.grad is not None and torch.isfinite(ratio.grad).all()
    assert ratio.grad.abs().sum() > 0


def test_clip_improves_2bit_gaussian():
    # a moderate clip beats min/max at 2 bits on Gaussian groups (the premise of fitted clips)
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(0))
    xg = A.group_view(x, 32)

    def sqnr(r):
        s, z = A.compute_params(xg, 2, symmetric=False, reduce_dims=(-1,), clip_ratio=r)
        return A.sqnr_db(xg, A.dequantize(A.quantize(xg, s, z, 2, False), s, z, 2, False))

    assert sqnr(0.85) > sqnr(1.0) + 0.3


# --- degenerate inputs ------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_zero_and_constant_inputs_no_nan(bits, symmetric):
    for value in (0.0, 3.7, -1e-12):
        x = torch.full((3, 16), value)
        x[1] = 0.0  # a zero row next to constant rows
        scale, zp = A.compute_params(x, bits, symmetric=symmetric, reduce_dims=(-1,))
        assert torch.isfinite(scale).all() and (scale > 0).all() and torch.isfinite(zp).all()
        x_hat = A.dequantize(A.quantize(x, scale, zp, bits, symmetric), scale, zp, bits, symmetric)
        assert torch.isfinite(x_hat).all()
        assert torch.equal(x_hat[1], torch.zeros(16))
        if not symmetric:  # a constant slice is its own minimum: exact
            assert torch.equal(x_hat, x)


def test_half_precision_input_gives_float32_params():
    x = torch.randn(4, 32).half()
    scale, zp = A.compute_params(x, 4, symmetric=False, reduce_dims=(-1,))
    assert scale.dtype == torch.float32 and zp.dtype == torch.float32


# --- accuracy ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_error_at_most_half_step(bits):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    scale, zp = A.compute_params(x, bits, symmetric=False, reduce_dims=(-1,))
    x_hat = A.dequantize(A.quantize(x, scale, zp, bits, False), scale, zp, bits, False)
    assert ((x - x_hat).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all()
    # symmetric: within the representable range [qmin*scale, qmax*scale]
    scale, zp = A.compute_params(x, bits, symmetric=True, reduce_dims=(-1,))
    qmin, qmax = A.code_range(bits, True)
    inside = (x >= qmin * scale) & (x <= qmax * scale)
    x_hat = A.dequantize(A.quantize(x, scale, zp, bits, True), scale, zp, bits, True)
    err = (x - x_hat).abs()
    assert inside.float().mean() > 0.5  # 2-bit: only [-absmax, absmax/2] is representable
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-6)[inside].all()


# measured on N(0,1), per-token groups of 32, asymmetric min/max: 46.7, 22.1, 15.5, 8.1 dB
SQNR_FLOORS_DB = {8: 46.0, 4: 21.5, 3: 15.0, 2: 7.5}


@pytest.mark.parametrize("bits", sorted(SQNR_FLOORS_DB))
def test_sqnr_floor_gaussian_groups_of_32(bits):
    x = torch.randn(16, 64, 128, generator=torch.Generator().manual_seed(1234))
    xg = A.group_view(x, 32)
    scale, zp = A.compute_params(xg, bits, symmetric=False, reduce_dims=(-1,))
    x_hat = A.ungroup(A.dequantize(A.quantize(xg, scale, zp, bits, False), scale, zp, bits, False))
    assert A.sqnr_db(x, x_hat) >= SQNR_FLOORS_DB[bits]


def test_sqnr_db_edges():
    x = torch.tensor([1.0, -2.0])
    assert A.sqnr_db(x, x) == math.inf
    assert A.sqnr_db(x, torch.zeros(2)) == pytest.approx(0.0)


# --- fake quant / straight-through estimator --------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quant_forward_equals_dequantize_quantize(symmetric):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    xg = A.group_view(x, 32)
    scale, zp = A.compute_params(xg, 2, symmetric=symmetric, reduce_dims=(-1,), clip_ratio=0.8)
    ref = A.dequantize(A.quantize(xg, scale, zp, 2, symmetric), scale, zp, 2, symmetric)
    assert torch.equal(A.fake_quant(xg, scale, zp, 2, symmetric), ref)


def test_fake_quant_ste_gradient():
    # asymmetric 2-bit with scale 1, zero_point -1: clip range is [-1, 2]
    x = torch.tensor([-3.0, -1.2, -0.9, 0.3, 0.5, 1.7, 2.2, 5.0], requires_grad=True)
    scale = torch.tensor(1.0, requires_grad=True)
    zp = torch.tensor(-1.0, requires_grad=True)
    out = A.fake_quant(x, scale, zp, 2, False)
    out.sum().backward()
    inside = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert torch.equal(x.grad, inside)
    # range ends are inside (gradient 1 at exactly qmin/qmax)
    x_edge = torch.tensor([-1.0, 2.0], requires_grad=True)
    A.fake_quant(x_edge, torch.tensor(1.0), torch.tensor(-1.0), 2, False).sum().backward()
    assert torch.equal(x_edge.grad, torch.ones(2))
    # LSQ-style gradients reach the parameters: d/d zp = 1 only where saturated
    assert zp.grad.item() == pytest.approx(4.0)
    # d/d scale: q - (x - zp)/scale inside, q outside
    v = (x.detach() + 1.0)
    q = torch.round(v).clamp(0, 3)
    expect = torch.where(inside.bool(), q - v, q).sum()
    assert scale.grad.item() == pytest.approx(expect.item(), abs=1e-5)
