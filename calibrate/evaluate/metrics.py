"""Metrics of long rollouts: what a viewer sees that per-frame, short-clip benchmarks miss.

Pure functions of frame tensors; no I/O, no state. Frames are float in [0, 1] with shape
``[N, C, H, W]`` for one rollout of N frames, or ``[B, N, C, H, W]`` for B rollouts; every
per-frame function also accepts any extra leading axes. Notation (DESIGN.md section 7):
``r`` the full-precision rollout, ``q`` the quantized rollout, ``g`` the ground truth,
``e_t = q_t - r_t`` the error that quantization adds to frame t.

Per-frame fidelity (``[..., N]`` series, float64):

* :func:`psnr` - ``10 log10(1 / MSE)`` over C, H, W: how far a frame is from its reference.
  Identical frames give ``max_db`` (100 dB by default) instead of infinity, so every number
  stays finite and JSON-safe. A uniform offset ``d`` gives exactly ``-10 log10(d^2)``.
* :func:`ssim` - structural similarity (Wang et al. 2004): local agreement of mean, contrast
  and structure, so blur (lost high frequencies, the typical V-quantization damage) costs more
  than in PSNR. See the function for the exact recipe and the padding convention.
* :func:`error_series` - ``mean|e_t|``: the raw size of the quantization error per frame.

Temporal behaviour (reductions over time keep the leading batch axes; 0-d for one rollout):

* :func:`flicker` - ``mean_{t>=1} mean|e_t - e_{t-1}|``: how much the *error* jumps from frame
  to frame. The eye forgives a steady error (a slightly wrong but stable image) far more than
  one that changes every frame: that is flicker. A constant error gives 0; an error that
  alternates ``+e, -e`` gives ``2e``. :func:`flicker_series` is the per-step series ``[..., N-1]``.
* :func:`drift_slope` - least-squares slope of ``mean|e_t|`` against t (error per frame): the
  slow snowballing of error through the cache, which short clips never show.
  :func:`first_below` - the first frame where PSNR against the reference drops below a
  threshold (how long a rollout stays watchable).
* :func:`flicker_static` - VBench-style temporal-flickering score ``1 - mean_t mean|q_t - q_{t+1}|``
  of a rollout whose camera does not move: any frame-to-frame change is visible as flicker.
  1 is perfectly steady. Report it next to the fp rollout's own score.
* :func:`frame_change` - ``mean (x_t - x_{t-1})^2`` for t = 1..N-1: how much a rollout moves.
  The fp rollout's next to the ground truth's says whether the reference every ``PSNR_ref``
  compares against still follows the camera; a model that has frozen shows the cache the same
  frame again and again, which flatters any cache (report.reference_motion).
* :func:`revisit_consistency` - mean PSNR between a frame where the camera returns to an
  earlier view and that earlier frame of the same rollout: whether the model's memory (the
  cache) still holds the place. Quantization that damages old K/V lowers it.

Attention (inputs are probabilities over the last axis, one row per query):

* :func:`attention_kl` - mean over rows of ``KL(p_ref || p_q)``: how much quantized keys move
  attention mass. :func:`top_agreement` - share of rows whose most-attended *frame* (summing
  the row over that frame's tokens) is unchanged; a changed anchor frame is a misalignment the
  eye sees as a jump. :func:`rel_err` - ``||o_q - o_ref|| / ||o_ref||`` of attention outputs.

Reporting (Python floats, always finite):

* :func:`window_means` - mean of a per-frame series in each half-open frame window
  (:data:`DEFAULT_WINDOWS`: ``0-16, 16-64, 64-128, 128-256, 256+``).
* :func:`summarize` - ``{"mean", "p95", "worst"}`` with the tail taken toward the bad side.
* :func:`blind_spot` - first-16-frames mean next to the whole-rollout mean: the gap is what a
  short-clip benchmark fails to see.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

DEFAULT_MAX_DB = 100.0
"""PSNR reported for identical frames (and the upper cap of every PSNR)."""

DEFAULT_WINDOWS: tuple[tuple[int, int | None], ...] = ((0, 16), (16, 64), (64, 128), (128, 256), (256, None))
"""Half-open frame-index windows ``[start, stop)``; ``None`` means "to the end of the rollout"."""

JSON_CAP = 1e30
"""Magnitude that replaces infinities in reported numbers (see :func:`json_safe`)."""

# SSIM constants of Wang et al. 2004 for data_range = 1.
SSIM_WIN = 11
SSIM_SIGMA = 1.5
SSIM_C1 = 0.01**2
SSIM_C2 = 0.03**2


def _check_pair(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"frame tensors differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dim() < 4:
        raise ValueError(f"expected frames [..., N, C, H, W], got shape {tuple(a.shape)}")


# ---------------------------------------------------------------------------------------------
# Per-frame fidelity


def psnr(a: Tensor, b: Tensor, max_db: float = DEFAULT_MAX_DB) -> Tensor:
    """PSNR in dB per frame, ``[..., N, C, H, W] -> [..., N]`` (float64, data range 1).

    MSE is taken over C, H, W. Values are capped at ``max_db``; identical frames give exactly
    ``max_db`` (never inf or NaN).
    """
    _check_pair(a, b)
    mse = (a.double() - b.double()).square().mean(dim=(-3, -2, -1))
    cap = torch.full_like(mse, max_db)
    return torch.where(mse > 0, -10.0 * torch.log10(mse), cap).clamp(max=max_db)


def _gaussian_window(size: int, sigma: float) -> Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    w = torch.exp(-(x**2) / (2 * sigma**2))
    return w / w.sum()


def _blur_valid(x_MCHW: Tensor, w: Tensor) -> Tensor:
    """Separable Gaussian filter, 'valid' (no padding): output [M, C, H-10, W-10]."""
    c = x_MCHW.shape[1]
    kh = w.view(1, 1, -1, 1).expand(c, 1, -1, 1)
    kw = w.view(1, 1, 1, -1).expand(c, 1, 1, -1)
    x = torch.nn.functional.conv2d(x_MCHW, kh, groups=c)
    return torch.nn.functional.conv2d(x, kw, groups=c)


def ssim(a: Tensor, b: Tensor) -> Tensor:
    """Mean SSIM per frame, ``[..., N, C, H, W] -> [..., N]`` (float64, data range 1).

    The reference recipe of Wang et al. 2004: Gaussian window 11x11 with sigma 1.5,
    ``C1 = 0.01^2``, ``C2 = 0.03^2``, population (not sample) variances, SSIM map averaged over
    each channel and then over channels.

    Padding is **'valid'**: the map is computed only where the whole window fits, so a 32x32
    frame gives a 22x22 map and no border values are invented. This equals scikit-image's
    ``structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
    data_range=1, channel_axis=0)``, which filters with reflection and then crops the border of
    width 5 (= 'valid'). Frames must be at least 11x11 (``ValueError`` otherwise).

    Two constant images ``c1``, ``c2`` give exactly ``(2 c1 c2 + C1) / (c1^2 + c2^2 + C1)``.
    """
    _check_pair(a, b)
    *lead, c, h, w = a.shape
    if h < SSIM_WIN or w < SSIM_WIN:
        raise ValueError(f"ssim needs frames of at least {SSIM_WIN}x{SSIM_WIN}, got {h}x{w}")
    x = a.double().reshape(-1, c, h, w)
    y = b.double().reshape(-1, c, h, w)
    win = _gaussian_window(SSIM_WIN, SSIM_SIGMA)
    mu_x, mu_y = _blur_valid(x, win), _blur_valid(y, win)
    var_x = _blur_valid(x * x, win) - mu_x.square()
    var_y = _blur_valid(y * y, win) - mu_y.square()
    cov = _blur_valid(x * y, win) - mu_x * mu_y
    num = (2 * mu_x * mu_y + SSIM_C1) * (2 * cov + SSIM_C2)
    den = (mu_x.square() + mu_y.square() + SSIM_C1) * (var_x + var_y + SSIM_C2)
    return (num / den).mean(dim=(-3, -2, -1)).reshape(lead)


def error_series(q: Tensor, r: Tensor) -> Tensor:
    """``mean|q_t - r_t|`` per frame over C, H, W: ``[..., N, C, H, W] -> [..., N]`` (float64)."""
    _check_pair(q, r)
    return (q.double() - r.double()).abs().mean(dim=(-3, -2, -1))


# ---------------------------------------------------------------------------------------------
# Temporal behaviour


def flicker_series(q: Tensor, r: Tensor) -> Tensor:
    """``mean|e_t - e_{t-1}|`` for t = 1..N-1 with ``e = q - r``: ``[..., N, C, H, W] -> [..., N-1]``."""
    _check_pair(q, r)
    e = q.double() - r.double()
    return (e[..., 1:, :, :, :] - e[..., :-1, :, :, :]).abs().mean(dim=(-3, -2, -1))


def frame_change(x: Tensor) -> Tensor:
    """``mean (x_t - x_{t-1})^2`` over C, H, W for t = 1..N-1: ``[..., N, C, H, W] -> [..., N-1]``."""
    if x.dim() < 4 or x.shape[-4] < 2:
        raise ValueError(f"frame_change needs frames [..., N>=2, C, H, W], got {tuple(x.shape)}")
    x = x.double()
    return (x[..., 1:, :, :, :] - x[..., :-1, :, :, :]).square().mean(dim=(-3, -2, -1))


def flicker(q: Tensor, r: Tensor) -> Tensor:
    """Mean of :func:`flicker_series` over time: ``[..., N, C, H, W] -> [...]``. Needs N >= 2."""
    if q.dim() >= 4 and q.shape[-4] < 2:
        raise ValueError("flicker needs at least 2 frames")
    return flicker_series(q, r).mean(dim=-1)


def drift_slope(err_per_frame: Tensor) -> Tensor:
    """Least-squares slope of a per-frame series against the frame index: ``[..., N] -> [...]``.

    Fed :func:`error_series`, it is the error growth per frame (drift). Needs N >= 2.
    """
    y = torch.as_tensor(err_per_frame, dtype=torch.float64)
    n = y.shape[-1]
    if n < 2:
        raise ValueError("drift_slope needs at least 2 frames")
    t = torch.arange(n, dtype=torch.float64)
    tc = t - t.mean()
    return ((y - y.mean(dim=-1, keepdim=True)) * tc).sum(dim=-1) / tc.square().sum()


def first_below(psnr_per_frame: Tensor, threshold_db: float) -> int | None:
    """First frame index whose PSNR is below ``threshold_db`` (one rollout, ``[N]``), or None."""
    p = torch.as_tensor(psnr_per_frame)
    if p.dim() != 1:
        raise ValueError(f"first_below takes one rollout's series [N], got shape {tuple(p.shape)}")
    hits = torch.nonzero(p < threshold_db)
    return int(hits[0, 0]) if hits.numel() else None


def flicker_static(q: Tensor) -> Tensor:
    """VBench-style temporal-flickering score ``1 - mean_t mean|q_t - q_{t+1}|``: ``[..., N, C, H, W] -> [...]``.

    Meant for rollouts with a static camera; 1 means perfectly steady. Needs N >= 2.
    """
    if q.dim() < 4 or q.shape[-4] < 2:
        raise ValueError(f"flicker_static needs frames [..., N>=2, C, H, W], got {tuple(q.shape)}")
    x = q.double()
    return 1.0 - (x[..., 1:, :, :, :] - x[..., :-1, :, :, :]).abs().mean(dim=(-4, -3, -2, -1))


def revisit_consistency(
    frames: Tensor, pairs: Sequence[tuple[int, int]], max_db: float = DEFAULT_MAX_DB
) -> tuple[float, Tensor]:
    """PSNR between ``frames[i]`` and ``frames[j]`` for each (return i, earlier j) pair.

    ``frames`` is ``[..., N, C, H, W]``; returns ``(mean over everything, per_pair [..., P])``.
    The caller finds the pairs (same pose, one visit apart).
    """
    if len(pairs) == 0:
        raise ValueError("revisit_consistency needs at least one (i, j) pair")
    idx = torch.as_tensor(pairs, dtype=torch.long)
    if idx.dim() != 2 or idx.shape[1] != 2:
        raise ValueError(f"pairs must be (i, j) tuples, got {pairs!r}")
    per_pair = psnr(frames.index_select(-4, idx[:, 0]), frames.index_select(-4, idx[:, 1]), max_db)
    return float(per_pair.mean()), per_pair


# ---------------------------------------------------------------------------------------------
# Attention


def attention_kl(p_ref: Tensor, p_q: Tensor, eps: float = 1e-10) -> float:
    """Mean over rows of ``KL(p_ref || p_q)`` (nats); rows are the last axis of ``[..., N]``.

    ``eps`` is added inside both logs so zero probabilities stay finite; per-row values are
    clamped at 0 (eps can push an identical pair a hair below).
    """
    if p_ref.shape != p_q.shape:
        raise ValueError(f"attention shapes differ: {tuple(p_ref.shape)} vs {tuple(p_q.shape)}")
    p, q = p_ref.double(), p_q.double()
    kl = (p * (torch.log(p + eps) - torch.log(q + eps))).sum(dim=-1).clamp_min(0.0)
    return float(kl.mean())


def top_agreement(p_ref: Tensor, p_q: Tensor, frame_ids: Tensor) -> float:
    """Share of rows whose most-attended frame is the same under ``p_ref`` and ``p_q``.

    ``frame_ids [N]`` (integers) names the frame of each key; a row's mass per frame is the sum
    over that frame's keys. Ties go to the lowest frame id.
    """
    if p_ref.shape != p_q.shape:
        raise ValueError(f"attention shapes differ: {tuple(p_ref.shape)} vs {tuple(p_q.shape)}")
    ids = torch.as_tensor(frame_ids, dtype=torch.long)
    if ids.shape != p_ref.shape[-1:]:
        raise ValueError(f"frame_ids must be [{p_ref.shape[-1]}], got {tuple(ids.shape)}")
    _, inverse = torch.unique(ids, return_inverse=True)
    num_frames = int(inverse.max()) + 1

    def top(p: Tensor) -> Tensor:
        rows = p.double().reshape(-1, p.shape[-1])
        mass = rows.new_zeros(rows.shape[0], num_frames).index_add_(1, inverse, rows)
        return mass.argmax(dim=-1)

    return float((top(p_ref) == top(p_q)).double().mean())


def rel_err(o_ref: Tensor, o_q: Tensor, eps: float = 1e-12) -> float:
    """``||o_q - o_ref|| / max(||o_ref||, eps)`` (Frobenius norms over the whole tensor)."""
    if o_ref.shape != o_q.shape:
        raise ValueError(f"output shapes differ: {tuple(o_ref.shape)} vs {tuple(o_q.shape)}")
    ref = o_ref.double()
    return float((o_q.double() - ref).norm() / ref.norm().clamp_min(eps))


# ---------------------------------------------------------------------------------------------
# Reporting


def json_safe(x: float, higher_is_better: bool = True) -> float:
    """A finite float: ``+-inf -> +-JSON_CAP``, NaN -> the worst value (``-JSON_CAP`` if higher is
    better, else ``+JSON_CAP``), so a broken metric fails any threshold instead of vanishing."""
    x = float(x)
    if math.isnan(x):
        return -JSON_CAP if higher_is_better else JSON_CAP
    return max(-JSON_CAP, min(JSON_CAP, x))


def optional_mean(values: Iterable[float | None]) -> float | None:
    """The json_safe mean of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return json_safe(sum(values) / len(values)) if values else None


def window_index(index: int, windows: Iterable[tuple[int, int | None]] = DEFAULT_WINDOWS) -> int:
    """Which of `windows` frame `index` lies in (the last one past their end)."""
    windows = list(windows)
    return next((i for i, (a, b) in enumerate(windows) if a <= index and (b is None or index < b)), len(windows) - 1)


def window_label(start: int, stop: int | None) -> str:
    """``(0, 16) -> "0-16"``, ``(256, None) -> "256+"``."""
    return f"{start}+" if stop is None else f"{start}-{stop}"


def window_means(
    per_frame: Tensor, windows: Iterable[tuple[int, int | None]] = DEFAULT_WINDOWS
) -> dict[str, float]:
    """Mean of a per-frame series ``[..., N]`` in each window (over all leading axes too).

    Windows starting at or beyond N are skipped; a window cut short by the rollout keeps its
    nominal label (``"128-256"`` on a 200-frame rollout averages frames 128..199), so labels line
    up across rollouts of different lengths. Values are JSON-safe floats.
    """
    x = torch.as_tensor(per_frame, dtype=torch.float64)
    n = x.shape[-1]
    out: dict[str, float] = {}
    for start, stop in windows:
        if start >= n:
            continue
        out[window_label(start, stop)] = json_safe(x[..., start:stop].mean())
    return out


def sorted_windows(labels) -> list[str]:
    """Window labels in frame order (``"0-16"`` before ``"128-256"`` before ``"256+"``; JSON may
    hold them sorted as text)."""
    return sorted(labels, key=lambda w: int(w.split("-")[0].rstrip("+")))


def summarize(values: Tensor | Sequence[float], higher_is_better: bool) -> dict[str, float]:
    """``{"mean", "p95", "worst"}`` of a set of values (windows, trajectories, frames...).

    The tail is taken toward the *bad* side: for a higher-is-better metric (PSNR, SSIM)
    ``p95`` is the 5th percentile and ``worst`` the minimum; for a lower-is-better metric
    (flicker, KL, error) ``p95`` is the 95th percentile and ``worst`` the maximum. Percentiles
    interpolate linearly (numpy's default). NaN inputs count as the worst possible value and
    infinities are capped (:func:`json_safe`), so the result always survives
    ``json.dumps(..., allow_nan=False)``.
    """
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    if x.numel() == 0:
        raise ValueError("summarize needs at least one value")
    bad = -JSON_CAP if higher_is_better else JSON_CAP
    x = torch.nan_to_num(x, nan=bad, posinf=JSON_CAP, neginf=-JSON_CAP)
    if higher_is_better:
        p95, worst = torch.quantile(x, 0.05), x.min()
    else:
        p95, worst = torch.quantile(x, 0.95), x.max()
    return {k: json_safe(v, higher_is_better) for k, v in (("mean", x.mean()), ("p95", p95), ("worst", worst))}


def blind_spot(per_frame_psnr: Tensor, short: int = 16) -> dict[str, float]:
    """The benchmark blind spot: mean of a per-frame series ``[..., N]`` over the first ``short``
    frames next to the whole rollout and the frames after.

    Keys: ``"first_{short}"``, ``"all"``, ``"after_{short}"`` (absent when N <= short) and
    ``"gap"`` = first - all: for PSNR, how many dB a short-clip benchmark flatters the scheme.
    """
    x = torch.as_tensor(per_frame_psnr, dtype=torch.float64)
    if x.shape[-1] == 0:
        raise ValueError("blind_spot needs at least one frame")
    first, whole = x[..., :short].mean(), x.mean()
    out = {f"first_{short}": json_safe(first), "all": json_safe(whole)}
    if x.shape[-1] > short:
        out[f"after_{short}"] = json_safe(x[..., short:].mean())
    out["gap"] = json_safe(first - whole)
    return out
