"""Fit one head's predictive transform code (quant/predictive.py) from second-moment statistics.

Inputs per head: the mean and covariance of the cached vectors, and the covariance of their
frame-to-frame change (x_t - x_{t-1} of the same trajectory), all mergeable sums that the
recording cache streams (stats.py). Then:

1. **Basis**: R = eigenvectors of the covariance, strongest first (PCA). In that basis component i
   has variance sigma_i^2 (an eigenvalue) and frame-to-frame change variance d_i^2 = (R^T C_d R)_ii.
2. **Bits**: widths b_i from a greedy reverse water-filling on the Gaussian distortion model
   D_i(b) = w_i g(b): each next bit goes to the component whose distortion it lowers most. Inter
   mode (most tokens) sees d_i^2, intra mode sigma_i^2; w_i = d_i^2 + intra_weight * sigma_i^2.
   An uncoded component (b = 0) is 0 in both modes, so its real distortion is its whole variance
   sigma_i^2, and leaving out one that barely changes makes the same error in every frame (the
   noise twin's coherent error, evaluate/twin.py). `allocation="waterfill_variance"` (the
   config's default) prices D_i(0) = sigma_i^2 accordingly; "waterfill" prices it at w_i. Level
   before the sink code, it earns +0.9 dB late on TinyWorld with it and is level on WanWorld
   (artifacts/benchmarks/anchor_reach_sink.md, docs/results.md).
3. **Steps**: the MSE-optimal uniform step of a Gaussian at b bits (`GAUSSIAN_STEP`, times
   sigma_i for intra and d_i for inter), scaled by the fitted multipliers.
4. **Integer grid**: unit_i = min(intra step, inter step) / (2 * resolution), so both steps are
   whole multiples of the unit within 1/resolution; anchors hold |v| up to clip_sd * sigma_i,
   and up to `peak_mult` times the largest |u_i| the calibration trace showed (`peak_D`) where
   that is further, which sets their width a_i (at most 16 bits: beyond that the unit grows
   instead). A state past the reach is clamped to it in every frame it stays there: on a still
   camera that is the same error again and again, and heavy-tailed components pass 6 sd far more
   often than a Gaussian would. The config's default, twice the trace's peak (`fit.anchor_sd=6`,
   `fit.anchor_peak_mult=2`), widens only the components that need it: a fixed reach of 8 sd
   cost WanWorld 2.3 dB; the peak rule gains on TinyWorld (+0.3 dB late, p95 +2.3, still camera
   +3.3) and on WanWorld's first 64 frames and tails (frames 128-256 -0.2 dB;
   artifacts/benchmarks/anchor_peak.md, docs/results.md).

5. **Sink code** (`sink_bits` > 0, quant/predictive.py): the sink frame on one step Delta for every
   component (equal distortion everywhere: the reverse water-filling optimum at a high rate), each
   component as wide as its reach of `sink_sd` deviations needs at that step (at most 16 bits:
   Delta is never finer than the widest reach allows), none where that reach is under half a
   step; Delta is the finest whose widths average at most `sink_bits`. The deviations are the
   sink frames' own (their second moment about the mean, `sink_cov_DD`): the first frame of a
   rollout need not look like the rest (on WanWorld it is the given, clean frame, its weak
   components far beyond the other frames' spread).

`gaussian_uniform_step` recomputes the table by minimizing the Gaussian MSE (a test holds the
constants to it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calibrate.quant.predictive import MAX_ANCHOR_BITS, MAX_BITS, PredictiveParams

# MSE-optimal step and its MSE of a uniform mid-rise quantizer with 2^b levels for a unit Gaussian
# (computed by `gaussian_uniform_step`; cf. Max, 1960); index b = 1..8. b = 0: the component is not coded (distortion 1).
GAUSSIAN_STEP = (0.0, 1.5958, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)
GAUSSIAN_MSE = (1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.003495, 0.00104, 0.0003043, 0.00008769)


def gaussian_uniform_mse(step: float, bits: int) -> float:
    """MSE of the mid-rise uniform quantizer with 2^bits levels and this step on N(0, 1)."""
    n = 2**bits
    levels = [(k - (n - 1) / 2) * step for k in range(n)]
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    mse = 0.0
    for lvl, a, b in zip(levels, edges, edges[1:]):
        # E[(x - l)^2; a < x < b] = (1 + l^2)(P) - 2l(pdf(a) - pdf(b)) + (a pdf(a) - b pdf(b))
        p = cdf(b) - cdf(a)
        m1 = pdf(a) - pdf(b)
        m2 = p + ((a * pdf(a)) if math.isfinite(a) else 0.0) - ((b * pdf(b)) if math.isfinite(b) else 0.0)
        mse += m2 - 2 * lvl * m1 + lvl * lvl * p
    return mse


def gaussian_uniform_step(bits: int) -> float:
    """The step minimizing `gaussian_uniform_mse` (golden-section search)."""
    from scipy.optimize import minimize_scalar

    return float(minimize_scalar(lambda s: gaussian_uniform_mse(s, bits), bounds=(1e-3, 3.0), method="bounded",
                                 options={"xatol": 1e-7}).x)


def allocate_bits(weight_D: Tensor, total_bits: int, max_bits: int = MAX_BITS, uncoded_D: Tensor | None = None) -> Tensor:
    """Integer widths [D] summing to `total_bits`: each bit where it lowers the distortion most,
    w_i * mse(b) for b >= 1 and `uncoded_D` (default w_i) for b = 0.

    Ties go to the lower index (the stronger principal component).
    """
    D = weight_D.numel()
    if not 0 <= total_bits <= max_bits * D:
        raise ValueError(f"cannot spend {total_bits} bits on {D} components of at most {max_bits} bits")
    mse = torch.tensor(GAUSSIAN_MSE + (0.0,), dtype=torch.float64)
    w = weight_D.double().clamp_min(0)
    first = None if uncoded_D is None else uncoded_D.double().clamp_min(0) - w * mse[1]  # gain of a first bit
    bits = torch.zeros(D, dtype=torch.int64)
    for _ in range(total_bits):
        gain = w * (mse[bits] - mse[(bits + 1).clamp_max(max_bits + 1)])
        if first is not None:
            gain = torch.where(bits == 0, first, gain)
        gain[bits >= max_bits] = -1.0
        bits[int(torch.argmax(gain))] += 1  # argmax returns the first maximum
    return bits


def pca(cov_DD: Tensor) -> tuple[Tensor, Tensor]:
    """(eigenvalues, eigenvectors as columns), strongest first; float64 in, float32 out."""
    evals, evecs = torch.linalg.eigh(cov_DD.double())
    return evals.flip(0).clamp_min(0).float(), evecs.flip(-1).float().contiguous()


def head_basis(cov_DD: Tensor, basis: str = "pca", delta_cov_DD: Tensor | None = None) -> Tensor:
    """A head's basis [D, D] float32, columns the components: its principal axes (`pca`); those of
    its covariance plus the covariance of its frame-to-frame change (`change`: the directions that
    hold what changes as well as what stays, for a code that mostly codes the change); or the
    model's channels themselves (`identity`)."""
    if basis == "identity":
        return torch.eye(cov_DD.shape[-1])
    if basis == "change":
        return pca(cov_DD.double() + delta_cov_DD.double())[1]
    return pca(cov_DD)[1]


def sink_widths(sigma_D: Tensor, step: float, sink_sd: float) -> Tensor:
    """Widths [D] of the sink code at `step`: reach ceil(sink_sd sigma / step) levels each side
    (at most 16 bits), 0 where sink_sd sigma < step / 2."""
    reach = torch.ceil(sink_sd * sigma_D.double() / step)
    bits = torch.ceil(torch.log2(2 * reach + 1)).clamp(0, MAX_ANCHOR_BITS)
    return torch.where(sink_sd * sigma_D.double() >= step / 2, bits, 0.0).to(torch.int64)


def fit_sink(sigma_D: Tensor, avg_bits: float, sink_sd: float) -> tuple[Tensor, Tensor]:
    """(sink_unit [D] float32, sink_bits [D] int64): one step for every component, the finest whose
    widths (`sink_widths`) average at most `avg_bits` (a bisection on the step, in float64) and
    that reaches sink_sd sigma within 16 bits."""
    D = sigma_D.numel()
    hi = float(sink_sd * sigma_D.double().max()) * 2 + 1e-30  # one component coded, at 2 bits
    floor = float(sink_sd * sigma_D.double().max()) / (2 ** (MAX_ANCHOR_BITS - 1) - 1)
    lo = max(hi * 2.0**-40, floor, 1e-30)
    if float(sink_widths(sigma_D, lo, sink_sd).sum()) <= avg_bits * D:
        return torch.full((D,), lo, dtype=torch.float32), sink_widths(sigma_D, lo, sink_sd)
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if float(sink_widths(sigma_D, mid, sink_sd).sum()) > avg_bits * D:
            lo = mid
        else:
            hi = mid
    return torch.full((D,), hi, dtype=torch.float32), sink_widths(sigma_D, hi, sink_sd)


def fit_head(mean_D: Tensor, cov_DD: Tensor, delta_cov_DD: Tensor, avg_bits: float, *, intra_weight: float = 0.1,
             intra_mult: float = 1.3, inter_mult: float = 0.7, resolution: int = 2, clip_sd: float = 4.0,
             rotation_DD: Tensor | None = None, temporal: bool = True, allocation: str = "waterfill",
             sink_bits: float = 0.0, sink_sd: float = 8.0, sink_cov_DD: Tensor | None = None,
             peak_D: Tensor | None = None, peak_mult: float = 0.0) -> PredictiveParams:
    """A head's predictive code spending `avg_bits` per component on average (see module docstring).

    `allocation="waterfill_variance"` prices an uncoded component at its variance (module docstring).
    `temporal=False` sizes an intra-only code (widths by sigma^2 alone, the grid by the intra step);
    `allocation="uniform"` gives every component the same width (the ablation without water-filling).
    `sink_bits` > 0 adds the sink code (module docstring), sized by `sink_cov_DD` (the sink frames'
    second moment about the mean; None: the covariance). `peak_D` (the largest |u_i| seen, in this
    head's basis: `rotation_DD`, or the PCA of `cov_DD`) with `peak_mult` > 0 widens the reach of
    the anchors to peak_mult * peak_D where that is past clip_sd * sigma_i.
    """
    D = mean_D.numel()
    if rotation_DD is None:
        rotation_DD = head_basis(cov_DD)
    R = rotation_DD.float()
    sigma = torch.diagonal(R.double().T @ cov_DD.double() @ R.double()).clamp_min(0).sqrt().float().clamp_min(1e-8)
    delta = torch.diagonal(R.double().T @ delta_cov_DD.double() @ R.double()).clamp_min(0).sqrt().float()
    delta = torch.maximum(delta, sigma * 1e-3)  # a component that never changed still gets a finite step
    total = int(round(avg_bits * D))
    if allocation == "uniform":
        bits = torch.full((D,), total // D, dtype=torch.int64)
        bits[: total - int(bits.sum())] += 1
    else:
        w = delta.pow(2) + intra_weight * sigma.pow(2) if temporal else sigma.pow(2)
        bits = allocate_bits(w, total, uncoded_D=sigma.pow(2) if allocation == "waterfill_variance" else None)
    g = torch.tensor(GAUSSIAN_STEP)[bits]
    s_intra, s_inter = g * sigma * intra_mult, g * delta * inter_mult
    if not temporal:
        s_inter = s_intra
    n = (1 << bits) - 1
    max_v = 2 ** (MAX_ANCHOR_BITS - 1) - 1
    # the reach of an anchor: clip_sd standard deviations (or peak_mult calibration peaks, if further),
    # and at least the outermost intra level
    far = clip_sd * sigma
    if peak_D is not None and peak_mult > 0:
        far = torch.maximum(far, peak_mult * peak_D.float())
    span = torch.maximum(far, n * s_intra / 2)
    unit = torch.maximum(torch.minimum(s_intra, s_inter) / (2 * resolution), span / max_v)  # anchors <= 16 bits
    coded = bits > 0
    unit = torch.where(coded, unit, torch.ones_like(unit))
    intra_step = torch.round(s_intra / (2 * unit)).to(torch.int64).clamp_min(1)
    intra_step = torch.minimum(intra_step, (max_v // n.clamp_min(1)).clamp_min(1))
    inter_step = torch.round(s_inter / (2 * unit)).to(torch.int64).clamp(1, max_v)
    reach = torch.maximum(torch.ceil(far / unit).to(torch.int64), intra_step * n).clamp(1, max_v)
    anchor = torch.ceil(torch.log2(2 * reach.double() + 1)).to(torch.int64).clamp(2, MAX_ANCHOR_BITS)
    anchor = torch.where(coded, anchor, torch.zeros_like(anchor))
    intra_step = torch.where(coded, intra_step, torch.ones_like(intra_step))
    inter_step = torch.where(coded, inter_step, torch.ones_like(inter_step))
    sink = (None, None)
    if sink_bits > 0:
        sink_sigma = sigma if sink_cov_DD is None else \
            torch.diagonal(R.double().T @ sink_cov_DD.double() @ R.double()).clamp_min(0).sqrt().float()
        sink = fit_sink(sink_sigma, sink_bits, sink_sd)
    return PredictiveParams(mean_D.float().contiguous(), R, unit.contiguous(), bits, intra_step, inter_step, anchor, *sink)
