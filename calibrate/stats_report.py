"""Derived views of `KVStats`: moments, percentiles, outliers, anchors, drift, the report.

Pure functions of a `KVStats` (calibrate/stats.py); they never return NaN, also for empty,
zero or constant input. `report` is the JSON summary of task=stats and `plot_report` its
figure (K/V channel ranges per layer, attention mass by frame age).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from calibrate.io import write_atomic
from calibrate.stats import _EPS, KINDS, KVStats


def _num_tokens(stats: KVStats, kind: str) -> Tensor:
    """Tokens per layer as float64 [L, 1, 1], at least 1 so empty layers divide to 0."""
    return stats[f"{kind}.count"].clamp(min=1).double().view(-1, 1, 1)


def mean(stats: KVStats, kind: str) -> Tensor:
    """Per-channel mean [L, H, D]."""
    return stats[f"{kind}.sum"] / _num_tokens(stats, kind)


def var(stats: KVStats, kind: str) -> Tensor:
    """Per-channel population variance (ddof 0) [L, H, D]."""
    return (stats[f"{kind}.sumsq"] / _num_tokens(stats, kind) - mean(stats, kind) ** 2).clamp(min=0)


def std(stats: KVStats, kind: str) -> Tensor:
    return var(stats, kind).sqrt()


def kurtosis(stats: KVStats, kind: str) -> Tensor:
    """Per-channel kurtosis E[(x-m)^4] / var^2 [L, H, D]: 3 for a Gaussian, more for heavy tails.

    From raw moments (float64): m4 = E4 - 4 m E3 + 6 m^2 E2 - 3 m^4. Channels whose variance
    is zero or lost in rounding (var <= 1e-12 E[x^2]) get 0, not NaN.
    """
    n = _num_tokens(stats, kind)
    m = mean(stats, kind)
    e2, e3, e4 = (stats[f"{kind}.{s}"] / n for s in ("sumsq", "sum3", "sum4"))
    m2 = (e2 - m * m).clamp(min=0)
    m4 = (e4 - 4 * m * e3 + 6 * m * m * e2 - 3 * m**4).clamp(min=0)
    ok = (m2 > _EPS * e2) & (m2 > 0)
    return torch.where(ok, m4 / torch.where(ok, m2 * m2, 1.0), 0.0)


def percentile(stats: KVStats, kind: str, q: float) -> Tensor:
    """Per-channel q-quantile (q in [0, 1]) from the histogram [L, H, D].

    Same definition as torch.quantile (linear between order statistics, position q (n-1)):
    the bin holding order statistic floor(q (n-1)) is found from the cumulative counts and its
    values are taken as evenly spread in the bin; the result is clamped to the channel's
    [min, max], so q = 0 and q = 1 are exact. Within one bin width of the exact quantile when
    the data is in range and neighbouring order statistics share a bin (dense data). The edge
    bins are taken to reach to the channel's min / max, so out-of-range tails are spread
    over [min, lo + width] and [hi - width, max]: coarser, but not clipped to the range.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile q must be in [0, 1], got {q}")
    cfg = stats.config
    hist = stats[f"{kind}.hist"]
    n = stats[f"{kind}.count"].double().view(-1, 1, 1)
    rank = q * (n - 1).clamp(min=0)
    cum = hist.cumsum(-1)
    r0 = rank.floor().long().expand(hist.shape[:-1]).unsqueeze(-1).contiguous()
    j = torch.searchsorted(cum, r0, right=True).clamp(max=cfg.num_bins - 1)
    before = (cum.gather(-1, j) - hist.gather(-1, j)).squeeze(-1).double()
    in_bin = hist.gather(-1, j).squeeze(-1).double().clamp(min=1)
    frac = ((rank - before + 0.5) / in_bin).clamp(0, 1)
    j = j.squeeze(-1)
    lo_min, hi_max = stats[f"{kind}.min"], stats[f"{kind}.max"]
    # the edge bins are open-ended: they reach to the channel's min / max
    lower = cfg.hist_range[0] + j.double() * cfg.bin_width
    lower = torch.where(j == 0, torch.minimum(lower, lo_min), lower)
    upper = cfg.hist_range[0] + (j + 1).double() * cfg.bin_width
    upper = torch.where(j == cfg.num_bins - 1, torch.maximum(upper, hi_max), upper)
    value = torch.minimum(torch.maximum(lower + frac * (upper - lower), lo_min), hi_max)
    value = torch.where(rank <= 0, lo_min, torch.where(rank >= n - 1, hi_max, value))
    return torch.where(n > 0, value, 0.0)


def outlier_ratio(stats: KVStats, kind: str) -> Tensor:
    """Channel absmax over the median channel absmax of the same layer and head [L, H, D]."""
    absmax = stats[f"{kind}.absmax"]
    median = absmax.median(dim=-1, keepdim=True).values
    return absmax / median.clamp(min=_EPS)


def outlier_channels(stats: KVStats, kind: str, top_k: int = 8) -> list[list[dict[str, float]]]:
    """Per layer, the top_k channels by `outlier_ratio`: [{head, channel, ratio, absmax}, ...]."""
    ratio_LHD, absmax_LHD = outlier_ratio(stats, kind), stats[f"{kind}.absmax"]
    D = stats.config.head_dim
    out = []
    for layer in range(stats.config.num_layers):
        top = ratio_LHD[layer].flatten().topk(min(top_k, ratio_LHD[layer].numel()))
        out.append([
            {"head": int(i) // D, "channel": int(i) % D, "ratio": float(r),
             "absmax": float(absmax_LHD[layer].flatten()[i])}
            for r, i in zip(top.values, top.indices)
        ])
    return out


def age_profile(stats: KVStats) -> Tensor:
    """Mean share of a query row's attention on frames of each age [L, Q, A] (sums to 1 over A)."""
    return stats["attn.age_mass"] / stats["attn.rows"].clamp(min=1).double().view(-1, 1, 1)


def age_ratio(stats: KVStats) -> Tensor:
    """Mass on frames of each age over what uniform attention gives them [L, Q, A] (1 = uniform)."""
    uniform = stats["attn.age_uniform"].unsqueeze(1)
    return torch.where(uniform > 0, stats["attn.age_mass"] / uniform.clamp(min=_EPS), 0.0)


def anchor_ratio(stats: KVStats) -> Tensor:
    """Mass on absolute frames s < S over the uniform share, while they were cached [L, Q, S]."""
    uniform = stats["attn.anchor_uniform"].unsqueeze(1)
    return torch.where(uniform > 0, stats["attn.anchor_mass"] / uniform.clamp(min=_EPS), 0.0)


def anchor_frames(stats: KVStats, threshold: float = 3.0) -> list[list[int]]:
    """Per layer, the frames s < S some head attends with >= threshold x the uniform share.

    The ratio (`anchor_ratio`) is pooled over every row in which the frame was cached; early
    rows, with few frames cached, cannot exceed F x uniform, so a real sink's ratio grows
    with the rollout. The baseline is uniform attention, not the age profile: a frame s < S
    is only ever recent in the first frames, which the pooling outweighs.
    """
    hot_LS = anchor_ratio(stats).amax(dim=1) >= threshold
    return [torch.nonzero(hot_S).flatten().tolist() for hot_S in hot_LS]


def bucket_mean_absmax(stats: KVStats, kind: str) -> Tensor:
    """Mean over tokens of the token's absmax, per frame bucket [L, H, U] (0 for empty buckets)."""
    count = stats[f"{kind}.bucket_count"].unsqueeze(1)
    return stats[f"{kind}.bucket_absmax_sum"] / count.clamp(min=1).double()


def range_drift(stats: KVStats, kind: str) -> Tensor:
    """`bucket_mean_absmax` over its value in each layer's first non-empty bucket [L, H, U].

    1 everywhere means the ranges a calibration sees early hold for the whole rollout.
    Empty buckets (and layers without data) are 0.
    """
    m_LHU = bucket_mean_absmax(stats, kind)
    has_LU = stats[f"{kind}.bucket_count"] > 0
    first_L = has_LU.int().argmax(dim=1)
    ref_LH1 = m_LHU.gather(2, first_L.view(-1, 1, 1).expand(-1, m_LHU.shape[1], 1))
    drift = m_LHU / ref_LH1.clamp(min=_EPS)
    return torch.where(has_LU.unsqueeze(1) & (ref_LH1 > 0), drift, 0.0)


def _r(x: float) -> float:
    return round(float(x), 6)


def report(stats: KVStats, top_k: int = 8, anchor_threshold: float = 3.0) -> dict[str, Any]:
    """A JSON-able summary a person can read: outliers, kurtosis, anchors, range drift."""
    cfg = stats.config
    out: dict[str, Any] = {"config": json.loads(cfg.to_json())}
    for kind in KINDS:
        kurt = kurtosis(stats, kind)
        has_U = stats[f"{kind}.bucket_count"].sum(0) > 0
        buckets = torch.nonzero(has_U).flatten().tolist()
        drift_LU = range_drift(stats, kind).mean(dim=1)
        out[kind] = {
            "num_tokens": stats[f"{kind}.count"].tolist(),
            "outlier_channels": [
                [{k: (_r(v) if isinstance(v, float) else v) for k, v in c.items()} for c in layer]
                for layer in outlier_channels(stats, kind, top_k)
            ],
            "kurtosis": {
                "median": _r(kurt.median()),
                "max": _r(kurt.max()),
                "per_layer_max": [_r(x) for x in kurt.flatten(1).amax(1)],
            },
            "range_drift": {
                "bucket_frames": [[u * cfg.bucket_size, (u + 1) * cfg.bucket_size] for u in buckets],
                "mean_absmax_ratio": [[_r(drift_LU[layer, u]) for u in buckets]
                                      for layer in range(cfg.num_layers)],
            },
        }
    ages = torch.nonzero(stats["attn.age_pairs"].sum(0) > 0).flatten().tolist()
    profile_A, ratio_A = age_profile(stats).mean(dim=(0, 1)), age_ratio(stats).mean(dim=(0, 1))
    out["attention"] = {
        "num_rows": stats["attn.rows"].tolist(),
        "anchor_threshold": anchor_threshold,
        "anchor_frames": anchor_frames(stats, anchor_threshold),
        "anchor_ratio": [[_r(x) for x in layer] for layer in anchor_ratio(stats).amax(dim=1)],
        "age_profile": {
            "ages": ages,
            "mass_share": [_r(profile_A[a]) for a in ages],
            "vs_uniform": [_r(ratio_A[a]) for a in ages],
        },
    }
    return out


def plot_report(stats: KVStats, path: str | os.PathLike) -> None:
    """PNG: K and V channel absmax per layer (rows) x channel (cols, head-major), log colour;
    and, per layer, the attention a frame of each age gets relative to uniform attention."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    # Figure + Agg canvas directly: no pyplot, so no global backend is chosen or changed
    fig = Figure(figsize=(12, 9), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1)
    cfg = stats.config
    for ax, kind in zip(axes[:2], KINDS):
        absmax = stats[f"{kind}.absmax"].flatten(1).float()
        positive = absmax[absmax > 0]
        floor = float(positive.min()) if positive.numel() else 1e-3
        top = max(float(absmax.max()), floor * 2)
        image = ax.imshow(absmax.clamp(min=floor).numpy(), aspect="auto", interpolation="nearest",
                          norm=LogNorm(vmin=floor, vmax=top), cmap="magma")
        for h in range(1, cfg.num_heads):
            ax.axvline(h * cfg.head_dim - 0.5, color="white", linewidth=0.5)
        ax.set_title(f"{kind.upper()} channel absmax (head boundaries as lines)")
        ax.set_xlabel("channel (head x head_dim + d)")
        ax.set_ylabel("layer")
        ax.set_yticks(range(cfg.num_layers))
        fig.colorbar(image, ax=ax, label="absmax")
    ax = axes[2]
    ratio_LA = age_ratio(stats).mean(dim=1)
    ages = torch.nonzero(stats["attn.age_pairs"].sum(0) > 0).flatten()
    if ages.numel():
        for layer in range(cfg.num_layers):
            ratio_A = ratio_LA[layer, ages].clamp(min=1e-6)
            ax.plot(ages.numpy(), ratio_A.numpy(), marker=".", label=f"layer {layer}")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.legend(fontsize="small", ncol=max(1, cfg.num_layers // 8))
        if int(ages.max()) > 32:
            ax.set_xscale("symlog", linthresh=8)
            ax.xaxis.set_major_formatter(ScalarFormatter())
    else:
        ax.text(0.5, 0.5, "no attention recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"attention on frames of each age vs uniform attention (age {cfg.max_age}: all older)")
    ax.set_xlabel("age (newest frame index - attended frame index)")
    ax.set_ylabel("mass / uniform share (mean over heads)")
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
