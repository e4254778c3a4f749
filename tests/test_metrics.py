"""Evaluation metrics: hand-computed values, stated properties, a scipy SSIM reference, JSON safety."""

import json
import math

import pytest
import torch
from scipy import ndimage

from calibrate.evaluate.metrics import (
    DEFAULT_MAX_DB,
    DEFAULT_WINDOWS,
    JSON_CAP,
    SSIM_C1,
    SSIM_C2,
    attention_kl,
    blind_spot,
    drift_slope,
    error_series,
    first_below,
    flicker,
    flicker_series,
    flicker_static,
    frame_change,
    json_safe,
    psnr,
    rel_err,
    revisit_consistency,
    sorted_windows,
    ssim,
    summarize,
    top_agreement,
    window_index,
    window_label,
    window_means,
)


def _frames(n: int = 6, h: int = 16, w: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g, dtype=torch.float64) * 0.8 + 0.1


# --- PSNR / SSIM ------------------------------------------------------------------------------


def test_psnr_identical_frames_give_the_cap_not_inf():
    x = _frames()
    assert torch.equal(psnr(x, x), torch.full((6,), DEFAULT_MAX_DB, dtype=torch.float64))
    assert torch.equal(psnr(x, x, max_db=60.0), torch.full((6,), 60.0, dtype=torch.float64))


@pytest.mark.parametrize("d", [0.1, 0.25, 1e-3])
def test_psnr_of_uniform_offset(d):
    x = _frames()
    expected = -10 * math.log10(d * d)
    torch.testing.assert_close(psnr(x + d, x), torch.full((6,), expected, dtype=torch.float64))


def test_psnr_is_per_frame_and_accepts_a_batch():
    x = _frames(n=4)
    offsets = torch.tensor([0.1, 0.2, 0.05, 0.01], dtype=torch.float64).view(4, 1, 1, 1)
    torch.testing.assert_close(psnr(x + offsets, x), -20 * torch.log10(offsets.flatten()))
    batch = torch.stack([x, x + 0.1])
    out = psnr(batch + 0.1, batch)
    assert out.shape == (2, 4)
    with pytest.raises(ValueError, match="shape"):
        psnr(x, x[:2])


def test_ssim_of_identical_frames_is_one():
    x = _frames(h=32, w=32)
    torch.testing.assert_close(ssim(x, x), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("c1,c2", [(0.2, 0.7), (0.0, 1.0), (0.5, 0.5)])
def test_ssim_of_constant_images_is_the_luminance_term(c1, c2):
    a = torch.full((2, 3, 12, 12), c1, dtype=torch.float64)
    b = torch.full((2, 3, 12, 12), c2, dtype=torch.float64)
    expected = (2 * c1 * c2 + SSIM_C1) / (c1**2 + c2**2 + SSIM_C1)
    torch.testing.assert_close(ssim(a, b), torch.full((2,), expected, dtype=torch.float64), rtol=0, atol=1e-12)


def _ssim_scipy(a: torch.Tensor, b: torch.Tensor) -> float:
    """skimage's recipe (gaussian_weights, sigma 1.5, truncate 3.5, population covariance):
    filter with reflection, crop the 5-pixel border, average over the map and channels."""
    vals = []
    for x, y in zip(a.numpy(), b.numpy()):

        def f(z):
            return ndimage.gaussian_filter(z, sigma=1.5, truncate=3.5)[5:-5, 5:-5]

        mx, my = f(x), f(y)
        vx, vy, cxy = f(x * x) - mx * mx, f(y * y) - my * my, f(x * y) - mx * my
        s = ((2 * mx * my + SSIM_C1) * (2 * cxy + SSIM_C2)) / ((mx**2 + my**2 + SSIM_C1) * (vx + vy + SSIM_C2))
        vals.append(s.mean())
    return sum(vals) / len(vals)


def test_ssim_matches_a_scipy_reference():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(3, 3, 32, 32, generator=g, dtype=torch.float64)
    b = (a + 0.15 * torch.randn(3, 3, 32, 32, generator=g, dtype=torch.float64)).clamp(0, 1)
    got = ssim(a, b)
    expected = torch.tensor([_ssim_scipy(a[i], b[i]) for i in range(3)], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert (got < 1).all()
    torch.testing.assert_close(ssim(b, a), got)
    assert ssim(torch.stack([a, b]), torch.stack([b, a])).shape == (2, 3)


def test_ssim_rejects_frames_smaller_than_the_window():
    x = torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="11x11"):
        ssim(x, x)


# --- windows ----------------------------------------------------------------------------------


def test_window_labels_and_means():
    assert window_label(0, 16) == "0-16" and window_label(256, None) == "256+"
    per_frame = torch.arange(300, dtype=torch.float64)
    assert window_means(per_frame) == {
        "0-16": 7.5,
        "16-64": 39.5,
        "64-128": 95.5,
        "128-256": 191.5,
        "256+": 277.5,
    }


def test_window_means_skip_windows_past_the_rollout_and_keep_nominal_labels():
    per_frame = torch.arange(20, dtype=torch.float64)
    assert window_means(per_frame) == {"0-16": 7.5, "16-64": 17.5}
    batch = torch.stack([per_frame, per_frame + 2])
    assert window_means(batch, [(0, 10)]) == {"0-10": 5.5}


# --- flicker / drift --------------------------------------------------------------------------


def test_constant_error_does_not_flicker():
    r = _frames(n=8)
    q = r + 0.2
    torch.testing.assert_close(flicker_series(q, r), torch.zeros(7, dtype=torch.float64))
    assert float(flicker(q, r)) == pytest.approx(0.0, abs=1e-15)


def test_alternating_error_flickers_by_twice_its_size():
    r = _frames(n=9)
    e = 0.05
    sign = torch.tensor([1.0 if t % 2 == 0 else -1.0 for t in range(9)], dtype=torch.float64).view(9, 1, 1, 1)
    q = r + e * sign
    torch.testing.assert_close(flicker_series(q, r), torch.full((8,), 2 * e, dtype=torch.float64))
    assert float(flicker(q, r)) == pytest.approx(2 * e)
    assert flicker(torch.stack([q, r]), torch.stack([r, r])).tolist() == pytest.approx([2 * e, 0.0])
    with pytest.raises(ValueError):
        flicker(q[:1], r[:1])


def test_drift_slope_recovers_linear_error_growth():
    r = torch.full((100, 3, 4, 4), 0.2, dtype=torch.float64)
    slope = 0.002
    q = r + 0.01 + slope * torch.arange(100, dtype=torch.float64).view(100, 1, 1, 1)
    err = error_series(q, r)
    assert float(drift_slope(err)) == pytest.approx(slope, rel=1e-9)
    batch = torch.stack([err, 2 * err])
    assert drift_slope(batch).tolist() == pytest.approx([slope, 2 * slope])
    assert float(drift_slope(torch.full((5,), 3.0))) == 0.0


def test_first_below():
    series = torch.tensor([40.0, 35.0, 29.0, 31.0, 20.0])
    assert first_below(series, 30.0) == 2
    assert first_below(series, 10.0) is None
    assert first_below(series, 50.0) == 0


def test_flicker_static():
    still = torch.full((5, 3, 4, 4), 0.3)
    assert float(flicker_static(still)) == pytest.approx(1.0)
    d = 0.1
    blinking = torch.stack([torch.full((3, 4, 4), 0.3 + d * (t % 2)) for t in range(5)])
    assert float(flicker_static(blinking)) == pytest.approx(1.0 - d)


def test_frame_change_is_the_mean_squared_step_between_frames():
    x = torch.stack([torch.full((3, 4, 4), v) for v in (0.2, 0.5, 0.5, 0.1)])
    assert torch.allclose(frame_change(x), torch.tensor([0.09, 0.0, 0.16], dtype=torch.float64))
    batch = torch.stack([x, x.flip(0)])  # leading axes kept; reversing time reverses the series
    assert torch.allclose(frame_change(batch)[1], frame_change(x).flip(0))
    with pytest.raises(ValueError):
        frame_change(x[:1])


def test_window_labels_sort_in_frame_order():
    assert sorted_windows(["128-256", "0-16", "256+", "16-64"]) == ["0-16", "16-64", "128-256", "256+"]


def test_revisit_consistency():
    frames = _frames(n=6)
    frames[4] = frames[1]
    frames[5] = frames[0] + 0.1
    mean, per_pair = revisit_consistency(frames, [(4, 1), (5, 0)])
    torch.testing.assert_close(per_pair, torch.tensor([DEFAULT_MAX_DB, 20.0], dtype=torch.float64))
    assert mean == pytest.approx((DEFAULT_MAX_DB + 20.0) / 2)
    with pytest.raises(ValueError):
        revisit_consistency(frames, [])


# --- attention --------------------------------------------------------------------------------


def test_attention_kl_hand_computed_and_degenerate():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    q = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    expected = (0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)) / 2
    assert attention_kl(p, q) == pytest.approx(expected, rel=1e-6)
    assert attention_kl(p, p) == 0.0
    zero_q = torch.tensor([[0.0, 1.0]])
    kl = attention_kl(torch.tensor([[1.0, 0.0]]), zero_q)
    assert math.isfinite(kl) and kl > 10


def test_top_agreement_sums_mass_per_frame():
    frame_ids = torch.tensor([0, 0, 1, 1])
    p_ref = torch.tensor([[0.3, 0.3, 0.4, 0.0], [0.1, 0.1, 0.4, 0.4]])
    p_q = torch.tensor([[0.1, 0.1, 0.5, 0.3], [0.2, 0.0, 0.5, 0.3]])
    assert top_agreement(p_ref, p_q, frame_ids) == 0.5
    assert top_agreement(p_ref, p_ref, frame_ids) == 1.0
    assert top_agreement(p_ref.view(2, 1, 4), p_q.view(2, 1, 4), frame_ids) == 0.5


def test_rel_err():
    o = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    assert rel_err(o, 1.1 * o) == pytest.approx(0.1, rel=1e-6)
    assert rel_err(o, o) == 0.0
    assert math.isfinite(rel_err(torch.zeros(3), torch.ones(3)))


# --- reporting --------------------------------------------------------------------------------


def test_summarize_takes_the_tail_toward_the_bad_side():
    values = torch.arange(101, dtype=torch.float64)
    assert summarize(values, higher_is_better=True) == {"mean": 50.0, "p95": 5.0, "worst": 0.0}
    assert summarize(values.tolist(), higher_is_better=False) == {"mean": 50.0, "p95": 95.0, "worst": 100.0}
    with pytest.raises(ValueError):
        summarize([], higher_is_better=True)


def test_summaries_are_json_safe():
    out = summarize([1.0, float("nan"), float("inf")], higher_is_better=True)
    assert out["worst"] == -JSON_CAP
    json.dumps(out, allow_nan=False)
    out = summarize([float("nan")], higher_is_better=False)
    assert out["worst"] == JSON_CAP
    assert json_safe(float("-inf")) == -JSON_CAP


def test_identical_rollouts_report_capped_json_safe_numbers():
    r = _frames(n=20)
    per_frame = psnr(r, r)
    report = {
        "psnr_ref": window_means(per_frame),
        "summary": summarize(per_frame, higher_is_better=True),
        "blind_spot": blind_spot(per_frame),
        "ssim": summarize(ssim(r, r), higher_is_better=True),
        "flicker": summarize(flicker_series(r, r), higher_is_better=False),
    }
    text = json.dumps(report, allow_nan=False)
    assert report["psnr_ref"] == {"0-16": DEFAULT_MAX_DB, "16-64": DEFAULT_MAX_DB}
    assert "Infinity" not in text and "NaN" not in text


def test_blind_spot():
    series = torch.tensor([40.0] * 16 + [20.0] * 16)
    assert blind_spot(series) == {"first_16": 40.0, "all": 30.0, "after_16": 20.0, "gap": 10.0}
    assert blind_spot(series[:10]) == {"first_16": 40.0, "all": 40.0, "gap": 0.0}
    assert blind_spot(series, short=8)["after_8"] == pytest.approx((8 * 40.0 + 16 * 20.0) / 24)


def test_window_index_is_the_half_open_window_of_a_frame():
    got = [window_index(i) for i in (0, 15, 16, 63, 64, 127, 128, 255, 256, 10_000)]
    assert got == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert window_index(300, DEFAULT_WINDOWS[:4]) == 3  # past the last window: the last
    assert window_index(5, ((0, 4), (4, 8))) == 1
