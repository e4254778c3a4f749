"""TurboQuant (quant/turbo.py, codec kinds "turbo"/"turbo_prod"): Lloyd-Max levels of the Beta
coordinate law, the hand vectors of the research spec, and the QJL estimator's unbiasedness."""

import math

import pytest
import torch
from scipy import integrate, special

from calibrate.codec import HeadParams, decode, encode, fake_quant, frame_nbytes, stored_nbytes
from calibrate.quant import turbo
from calibrate.quant.packing import unpack
from calibrate.recipe import TensorSpec

PI_4 = torch.tensor([[1.0, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2  # symmetric, orthogonal
S_4 = torch.tensor([[1.0, 0, -1, 2], [0, 1, 1, -1], [2, -1, 0, 1], [-1, 1, 1, 0]])


@pytest.mark.parametrize("d,bits,positive", [
    (4, 1, [4 / (3 * math.pi)]),  # the semicircle law: E|t| = 4/(3 pi)
    (4, 2, [0.219446, 0.674417]),
    (64, 1, [0.100126]),
    (64, 2, [0.056515, 0.187497]),
    (64, 3, [0.030469, 0.093832, 0.166168, 0.263914]),
    (16, 3, [0.059922, 0.183679, 0.321742, 0.499199]),
])
def test_lloyd_max_levels(d, bits, positive):
    levels = turbo.beta_lloyd_max(d, bits)
    assert levels.shape == (2**bits,) and torch.all(levels[1:] > levels[:-1])
    torch.testing.assert_close(levels, -levels.flip(0))  # symmetric
    torch.testing.assert_close(levels[2 ** (bits - 1):].double(), torch.tensor(positive, dtype=torch.float64), atol=2e-6, rtol=0)


def test_lloyd_max_levels_are_cell_means_by_quadrature():
    # the optimality condition checked with a different integrator (scipy quad on the density)
    d, bits = 64, 2
    levels = turbo.beta_lloyd_max(d, bits).double().tolist()
    k = math.exp(special.gammaln(d / 2) - 0.5 * math.log(math.pi) - special.gammaln((d - 1) / 2))
    f = lambda t: k * (1 - t * t) ** ((d - 3) / 2)
    edges = [-1.0] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [1.0]
    for i, c in enumerate(levels):
        mass = integrate.quad(f, edges[i], edges[i + 1])[0]
        mean = integrate.quad(lambda t: t * f(t), edges[i], edges[i + 1])[0] / mass
        assert abs(mean - c) < 1e-7


def test_tq_mse_one_bit_by_hand():
    # TQ1: x = [3, 4, 0, 0], n = 5, y = Pi u = [0.7, -0.1, 0.7, -0.1] -> codes [1, 0, 1, 0];
    # x^ = n Pi^T (0.424413 [1, -1, 1, -1]) = [0, 4.244132, 0, 0]
    x = torch.tensor([3.0, 4.0, 0, 0])
    levels = turbo.beta_lloyd_max(4, 1)
    y = (x / 5) @ PI_4.T
    torch.testing.assert_close(y, torch.tensor([0.7, -0.1, 0.7, -0.1]))
    codes = turbo.mse_codes(y, levels)
    assert codes.tolist() == [1, 0, 1, 0]
    torch.testing.assert_close(5 * levels[codes.long()] @ PI_4, torch.tensor([0.0, 4.244132, 0, 0]), atol=1e-5, rtol=0)


def test_qjl_term_by_hand():
    # TQ3: r = [0.1, -0.2, 0.05, 0]: S r = [0.05, -0.15, 0.40, -0.25] -> z = [+, -, +, -];
    # gamma = |r| = 0.228929; sqrt(pi/2)/4 gamma S^T z = [0.28717, -0.215378, -0.215378, 0.28717]
    r = torch.tensor([0.1, -0.2, 0.05, 0.0])
    z = turbo.qjl_signs(r, S_4)
    assert z.tolist() == [1, 0, 1, 0]
    got = turbo.qjl_values(z, r.norm(), S_4)
    torch.testing.assert_close(got, torch.tensor([0.28717, -0.215378, -0.215378, 0.28717]), atol=1e-5, rtol=0)
    # one draw of the estimator <y, x_qjl> for y = [1, 2, -1, 0.5]: 0.215378 (the truth is -0.35)
    assert abs(float(got @ torch.tensor([1.0, 2.0, -1.0, 0.5])) - 0.215378) < 1e-5
    assert turbo.qjl_signs(torch.zeros(4), S_4).tolist() == [1, 1, 1, 1]  # sign(0) = +1


def test_codec_tq_mse_two_bits_by_hand():
    # TQ2: same x at b = 2: codes [3, 1, 3, 1] -> x^ = [2.274855, 4.469314, 0, 0]; the norm 5 is
    # exact in float16, the rotation R = Pi^T (rows: y = x @ R) is applied by the codec
    spec = TensorSpec(bits=2, kind="turbo", rotation="random")
    p = HeadParams(bits=2, rotation_DD=PI_4.T.contiguous(), lloyd_max_L=turbo.beta_lloyd_max(4, 2))
    x = torch.tensor([[[3.0, 4.0, 0, 0]]])
    stored = encode(x, spec, p)
    assert unpack(stored["codes"], 2, 4).tolist() == [[[3, 1, 3, 1]]] and stored["p_norm"].item() == 5.0
    torch.testing.assert_close(decode(stored, spec, p, 4), torch.tensor([[[2.274855, 4.469314, 0, 0]]]), atol=1e-5, rtol=0)
    assert stored_nbytes(stored) == frame_nbytes(spec, 2, 1, 1, 4) == 2 + 2


def test_codec_tq_prod_by_hand():
    # TQ4 (b = 2: 1-bit MSE + QJL): r = u - x~ = [0.6, -0.048826, 0, 0], gamma = 0.601983,
    # z = [+, -, +, -], x^ = [3.772372, 1.414853, -2.829279, 3.772372]. The codec sketches the
    # residual in the rotated basis, so the role holding the paper's S is S @ R.
    R = PI_4.T.contiguous()
    spec = TensorSpec(bits=2, kind="turbo_prod", rotation="random")
    p = HeadParams(bits=2, rotation_DD=R, lloyd_max_L=turbo.beta_lloyd_max(4, 1), qjl_MD=S_4 @ R)
    x = torch.tensor([[[3.0, 4.0, 0, 0]]])
    stored = encode(x, spec, p)
    # code = mse index + 2 * sign bit: MSE codes [1, 0, 1, 0], signs [1, 0, 1, 0]
    assert unpack(stored["codes"], 2, 4).tolist() == [[[3, 0, 3, 0]]]
    assert abs(stored["p_gamma"].float().item() - 0.601983) < 5e-4  # float16
    got = decode(stored, spec, p, 4)
    torch.testing.assert_close(got, torch.tensor([[[3.772372, 1.414853, -2.829279, 3.772372]]]), atol=3e-3, rtol=0)
    assert abs(float(got[0, 0] @ torch.tensor([1.0, 2.0, -1.0, 0.5])) - 11.3175) < 3e-3
    assert stored_nbytes(stored) == frame_nbytes(spec, 2, 1, 1, 4) == 2 + 4
    torch.testing.assert_close(fake_quant(x, spec, p)[0], got, atol=0, rtol=0)


def test_zero_vector_is_finite():
    for kind, bits_mse in (("turbo", 2), ("turbo_prod", 1)):
        spec = TensorSpec(bits=2, kind=kind)
        p = HeadParams(bits=2, lloyd_max_L=turbo.beta_lloyd_max(8, bits_mse), qjl_MD=turbo.qjl_matrix(8, 8, 0))
        out = decode(encode(torch.zeros(1, 2, 8), spec, p), spec, p, 8)
        assert torch.isfinite(out).all() and out.abs().max() < 1e-5


def _prod_estimates(x, y, draws, seed):
    """<y, x^> of TQ_prod (b = 2) for `draws` independent (Pi, S), vectorized over draws, and the MSE-only part."""
    d = x.numel()
    g = torch.Generator().manual_seed(seed)
    q, r_ = torch.linalg.qr(torch.randn(draws, d, d, generator=g, dtype=torch.float64))
    R = (q * torch.sign(torch.diagonal(r_, dim1=-2, dim2=-1)).unsqueeze(-2)).float()  # Haar
    S = torch.randn(draws, d, d, generator=g)
    levels = turbo.beta_lloyd_max(d, 1)
    n = x.norm()
    yr = (x / n) @ R  # [draws, d]
    mse = levels[turbo.mse_codes(yr, levels).long()]
    resid = yr - mse
    signs = (torch.einsum("nd,nmd->nm", resid, S) >= 0).float()
    qjl = turbo.QJL_SCALE / d * resid.norm(dim=-1, keepdim=True) * torch.einsum("nm,nmd->nd", 2 * signs - 1, S)
    x_hat = n * torch.einsum("nd,ned->ne", mse + qjl, R)  # back to the model's basis: @ R^T
    x_mse = n * torch.einsum("nd,ned->ne", mse, R)
    return x_hat @ y, x_mse @ y


def test_qjl_inner_product_is_unbiased():
    # TQ5: over independent rotations and sketches, mean <y, x^> = <y, x> within 4 standard errors,
    # while the 1-bit MSE part alone is biased low (~2/pi)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(64, generator=g), torch.randn(64, generator=g)
    est, est_mse = _prod_estimates(x, y, 3000, seed=5)
    truth = float(x @ y)
    se = float(est.std() / math.sqrt(est.numel()))
    assert abs(float(est.mean()) - truth) < 4 * se, (float(est.mean()), truth, se)
    assert abs(float(est_mse.mean()) / truth - 2 / math.pi) < 0.05
