"""Quant VideoGen's PRQ (quant/qvg.py and codec kind "prq"): hand-computed vectors and a slow
transcription of the package's formulas that the codes must equal exactly."""

import math

import pytest
import torch

from calibrate.codec import (HeadParams, decode, encode, fake_quant, fit_span_state, frame_nbytes, span_of,
                             span_state_nbytes, stored_nbytes, with_span_state)
from calibrate.quant import qvg
from calibrate.quant.packing import pack, unpack
from calibrate.recipe import TensorSpec


def test_fp8_scale_rounding_and_clamps():
    # E4M3 keeps 3 mantissa bits: 0.3 = 1.2 * 2^-2 -> 1.25 * 2^-2 = 0.3125; the clamp keeps a zero
    # block's scale positive (2^-9, E4M3's smallest subnormal) and saturates at 448
    got = qvg.fp8_e4m3(torch.tensor([0.3, 0.0, 1e-10, 500.0, 1.0])).float().tolist()
    assert got == [0.3125, 2.0**-9, 2.0**-9, 448.0, 1.0]
    assert qvg.fp8_e4m3(torch.tensor([0.3])).dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("r,scale,stored,deq", [
    # T1: absmax 0.3 -> s = fp8(0.3) = 0.3125; r/s = [0.96, -0.48, 0.16, 0] -> q = [1, 0, 0, 0]
    ([0.3, -0.15, 0.05, 0.0], 0.3125, [2, 1, 1, 1], [0.3125, 0.0, 0.0, 0.0]),
    # T2: s = 1; 0.5 rounds away from zero to 1 (torch.round would give 0), -0.25 and 0.25 to 0
    ([0.5, -0.25, 0.25, -1.0], 1.0, [2, 1, 1, 0], [1.0, 0.0, 0.0, -1.0]),
    # T3: a zero block: s = 2^-9, q = 0, exact
    ([0.0, 0.0, 0.0, 0.0], 2.0**-9, [1, 1, 1, 1], [0.0, 0.0, 0.0, 0.0]),
])
def test_int2_residual_by_hand(r, scale, stored, deq):
    g = torch.tensor([r])
    s = qvg.residual_scale(g, 2)
    codes = qvg.residual_codes(g, s, 2)
    assert s.float().item() == scale and codes.tolist() == [stored]
    assert qvg.residual_values(codes, s, 2).tolist() == [deq]
    # project bit order (FORMAT.md): code i at bits 2i of the byte; T1 -> 2 | 1<<2 | 1<<4 | 1<<6
    if r[0] == 0.3:
        assert pack(codes, 2).tolist() == [[0x56, 0x00]]  # rows pad to 8 codes


def test_wider_residual_grid():
    # b = 4: q_max = 7, levels -7..7, stored code q + 7
    g = torch.tensor([[7.0, -3.5, 1.0, 0.0]])
    s = qvg.residual_scale(g, 4)
    assert s.float().item() == 1.0
    assert qvg.residual_codes(g, s, 4).tolist() == [[14, 3, 8, 7]]  # -3.5 -> -4 (away from zero)


# T4 of the research spec: C = 2, init indices [0, 1]
X_T4 = torch.tensor([[[0.0, 0.5, 0, 0], [1.0, -0.5, 0, 0], [4.0, 0.25, 0, 0], [6.0, -0.25, 0, 0]]])


def test_kmeans_one_iteration_returns_the_means_of_the_first_assignment():
    ids, c = qvg.kmeans(X_T4, 2, max_iters=1, init_idx_C=torch.tensor([0, 1]))
    assert ids.tolist() == [[0, 1, 1, 1]]
    torch.testing.assert_close(c, torch.tensor([[[0.0, 0.5, 0, 0], [11 / 3, -1 / 6, 0, 0]]]))


@pytest.mark.parametrize("iters", [2, 3])
def test_kmeans_return_semantics(iters):
    # iteration 1 assigns to the init [x0, x1] -> ids [0, 1, 1, 1]; iteration 2 assigns to their
    # means -> ids [0, 0, 1, 1], and returns the means under those ids (max_iters = 2) or, at 3,
    # converges (same ids) and returns the centroids the ids were assigned to: the same
    ids, c = qvg.kmeans(X_T4, 2, max_iters=iters, init_idx_C=torch.tensor([0, 1]))
    assert ids.tolist() == [[0, 0, 1, 1]]
    assert c.tolist() == [[[0.5, 0, 0, 0], [5.0, 0, 0, 0]]]
    # residuals and the INT2 reconstruction of T4: x0, x1 exact, x2 -> [4, 0, 0, 0], x3 -> [6, 0, 0, 0]
    r, a = qvg.smooth(X_T4, c.unsqueeze(1).to(torch.float16))
    assert a[..., 0].tolist() == [[0, 0, 1, 1]]
    assert r.tolist() == [[[-0.5, 0.5, 0, 0], [0.5, -0.5, 0, 0], [-1.0, 0.25, 0, 0], [1.0, -0.25, 0, 0]]]
    s = qvg.residual_scale(r, 2)
    assert s.float().flatten().tolist() == [0.5, 0.5, 1.0, 1.0]
    codes = qvg.residual_codes(r, s, 2)
    assert (codes.long() - 1).tolist() == [[[-1, 1, 0, 0], [1, -1, 0, 0], [-1, 0, 0, 0], [1, 0, 0, 0]]]
    rec = qvg.unsmooth(qvg.residual_values(codes, s, 2), c.unsqueeze(1).to(torch.float16), a)
    assert rec.tolist() == [[[0.0, 0.5, 0, 0], [1.0, -0.5, 0, 0], [4.0, 0, 0, 0], [6.0, 0, 0, 0]]]


def test_empty_cluster_keeps_its_centroid():
    # init indices with replacement can pick one token twice: the second copy never wins a tie,
    # so after one iteration its cluster is empty and keeps the init
    ids, c = qvg.kmeans(X_T4, 2, max_iters=1, init_idx_C=torch.tensor([2, 2]))
    assert ids.tolist() == [[0, 0, 0, 0]]
    assert c[0, 1].tolist() == [4.0, 0.25, 0, 0]  # never assigned: still the init
    torch.testing.assert_close(c[0, 0], X_T4[0].mean(0))


def test_two_progressive_stages_by_hand():
    # stage 1 centroids [4, 0], [-4, 0]; stage 2 [1, 1], [0, 2]
    #   x0 = [5, 1]:  stage 1 -> [4, 0] (d 2 vs 82), r [1, 1]; stage 2 -> [1, 1] (d 0), r [0, 0]
    #   x1 = [-3, 2]: stage 1 -> [-4, 0] (d 5 vs 53), r [1, 2]; stage 2: d([1,1]) = 1 = d([0,2]): tie -> 0, r [0, 1]
    # residual (one block of 2): x0 zero -> codes [1, 1]; x1 [0, 1] -> s = 1, codes [1, 2]; both exact
    x = torch.tensor([[[5.0, 1.0], [-3.0, 2.0]]])
    cents = torch.tensor([[[[4.0, 0.0], [-4.0, 0.0]], [[1.0, 1.0], [0.0, 2.0]]]], dtype=torch.float16)
    r, ids = qvg.smooth(x, cents)
    assert ids.tolist() == [[[0, 0], [1, 0]]] and r.tolist() == [[[0.0, 0.0], [0.0, 1.0]]]
    s = qvg.residual_scale(r, 2)
    codes = qvg.residual_codes(r, s, 2)
    assert codes.tolist() == [[[1, 1], [1, 2]]]
    assert torch.equal(qvg.unsmooth(qvg.residual_values(codes, s, 2), cents, ids), x)


def test_one_centroid_is_the_span_mean():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, generator=g) + 3.0
    c = qvg.fit_centroids(x, stages=1, num_centroids=1, max_iters=2)
    assert c.shape == (2, 1, 1, 8) and c.dtype == torch.float16
    torch.testing.assert_close(c[:, 0, 0].float(), x.mean(1).half().float())


# ---- the codec kind against a slow transcription of the package's formulas ----------------------
def _package_reference(x_TD, centroids_SCD, bits, block):
    """Per token, per stage, per block, in Python floats: nearest centroid by
    max(0, |r|^2 + |c|^2 - 2 r.c) (first minimum), r -= c; s = fp8(clamp(absmax / q_max));
    q = clamp(roundf(r / s)); x^ = sum c + q s. Returns (ids, stored codes, scales, x^)."""
    qm = 2 ** (bits - 1) - 1
    T, D = x_TD.shape
    ids, codes, scales, rec = [], [], [], []
    for t in range(T):
        r = [float(v) for v in x_TD[t]]
        acc = [0.0] * D
        tok_ids = []
        for stage in centroids_SCD:
            cs = [[float(v) for v in c] for c in stage]
            d = [max(0.0, sum(v * v for v in r) + sum(v * v for v in c) - 2 * sum(a * b for a, b in zip(r, c))) for c in cs]
            k = d.index(min(d))
            tok_ids.append(k)
            r = [a - b for a, b in zip(r, cs[k])]
            acc = [a + b for a, b in zip(acc, cs[k])]
        tok_codes, tok_scales = [], []
        for j in range(0, D, block):
            blk = r[j:j + block]
            s = float(torch.tensor(min(max(max(abs(v) for v in blk) / qm, 2.0**-9), 448.0)).to(torch.float8_e4m3fn).float())
            q = [max(-qm, min(qm, math.copysign(math.floor(abs(v / s) + 0.5), v))) for v in blk]
            tok_codes += [int(v + qm) for v in q]
            tok_scales.append(s)
            acc[j:j + block] = [a + v * s for a, v in zip(acc[j:j + block], q)]
        ids.append(tok_ids), codes.append(tok_codes), scales.append(tok_scales), rec.append(acc)
    return ids, codes, scales, rec


@pytest.mark.parametrize("bits,block,stages,C", [(2, 8, 1, 2), (2, 16, 2, 3), (4, 4, 1, 1), (3, 16, 0, 0)])
def test_codec_codes_equal_the_package_formulas(bits, block, stages, C):
    g = torch.Generator().manual_seed(bits + block + stages)
    x = torch.randn(1, 6, 16, generator=g) * torch.linspace(0.2, 3.0, 16) + torch.randn(16, generator=g)
    spec = TensorSpec(bits=bits, kind="prq", group_size=block, prq_stages=stages, prq_centroids=C)
    p = HeadParams(bits=bits)
    if stages:
        p = with_span_state(p, fit_span_state(x, spec, p))
    stored = encode(x, spec, p)
    cents = p.span_centroids_BSCD[0].float() if stages else torch.zeros(0, 1, 16)
    ids, codes, scales, rec = _package_reference(x[0], cents, bits, block)
    assert unpack(stored["codes"], bits, 16)[0].tolist() == codes
    assert stored["p_scale"].float()[0, ..., 0].tolist() == scales
    if stages and C > 1:
        assert qvg.unpack_ids(stored["p_assign"], C, 6)[0].T.tolist() == ids
    else:
        assert "p_assign" not in stored  # one centroid: every index is 0
    torch.testing.assert_close(decode(stored, spec, p, 16)[0], torch.tensor(rec), atol=1e-5, rtol=1e-6)
    assert stored_nbytes(stored) == frame_nbytes(spec, bits, 1, 6, 16)
    torch.testing.assert_close(fake_quant(x, spec, p)[0], decode(stored, spec, p, 16), atol=0, rtol=0)


def test_span_state_bytes_and_spans():
    spec = TensorSpec(bits=2, kind="prq", prq_stages=2, prq_centroids=3, prq_span_frames=4)
    assert [span_of(spec, f) for f in (0, 3, 4, 9)] == [0, 0, 1, 2]
    assert span_state_nbytes(spec, 2, 16) == 2 * 2 * 3 * 16 * 2
    assert span_of(TensorSpec(bits=2, kind="prq"), 5) is None  # no stages: no span state


def test_encode_without_span_state_is_refused_and_fake_quant_fits_its_own():
    spec = TensorSpec(bits=2, kind="prq", prq_stages=1, prq_centroids=2)
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="span"):
        encode(x, spec, HeadParams(bits=2))
    p = with_span_state(HeadParams(bits=2), fit_span_state(x, spec, HeadParams(bits=2)))
    torch.testing.assert_close(fake_quant(x, spec, HeadParams(bits=2))[0], fake_quant(x, spec, p)[0], atol=0, rtol=0)


@pytest.mark.parametrize("C,width", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (16, 4), (17, 8), (256, 8)])
def test_index_widths_and_packing(C, width):
    assert qvg.index_bits(C) == width
    if C == 1:
        return
    ids = torch.randint(0, C, (2, 3, 13), generator=torch.Generator().manual_seed(C), dtype=torch.uint8)
    packed = qvg.pack_ids(ids, C)
    assert packed.shape == (2, 3, qvg.ids_nbytes(13, C)) == (2, 3, 2 * width)
    assert torch.equal(qvg.unpack_ids(packed, C, 13), ids)


def test_one_bit_index_layout():
    # element i at bit i % 8 of byte i // 8 (FORMAT.md's bit stream at width 1); rows pad with zeros
    assert qvg.pack_ids(torch.tensor([[1, 0, 0, 1, 1, 1, 0, 0, 1]], dtype=torch.uint8), 2).tolist() == [[0x39, 0x01]]
