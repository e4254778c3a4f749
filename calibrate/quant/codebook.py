"""Non-uniform codebook quantization (KVQuant-style "nuq" levels).

A b-bit codebook is a sorted vector of ``L = 2^b`` real levels ``l_0 <= l_1 <= ... <= l_{L-1}``
in a *normalized* domain: the caller divides x by a scale first (e.g. per-channel absmax, so
values lie in [-1, 1]) and multiplies the decoded levels back by it. Encoding picks the
nearest level::

    code(x) = argmin_i |x - l_i|        ties (x exactly halfway) go to the LOWER index
    decode(code) = l_code

The tie rule is part of the contract: it is what ``torch.argmin`` does (first minimum), and a
foreign runtime must reproduce it to get identical codes. Since the levels are sorted, the
nearest level is one of the two levels bracketing x; :func:`nearest_level` finds them with a
binary search instead of comparing against all L levels.

Uniform levels (:func:`uniform_levels`) are the grid an affine quantizer would use. Levels
fitted to data (:func:`fit_levels`) minimise the mean squared error of that data: this is
1-D k-means, i.e. the Lloyd-Max quantizer. Each Lloyd iteration assigns every sample to its
nearest level, then moves each level to the (weighted) mean of its samples; the MSE never
increases. For Gaussian data at 2 bits the optimum is about ``{±0.45, ±1.51} * sigma`` with MSE
0.1175 sigma^2 (the best uniform step gives 0.1188), while a uniform grid stretched over the
absmax of a few thousand samples (levels ``±absmax, ±absmax/3``) is several times worse.
"""

from __future__ import annotations

import torch

from calibrate.quant.affine import check_bits

SMALL_CODEBOOK = 16  # up to this many levels the bracket is found by comparisons, beyond by binary search


def _check_levels(levels: torch.Tensor) -> None:
    if levels.dim() != 1 or not 1 <= levels.numel() <= 256:
        raise ValueError(
            f"levels must be a 1-D tensor of 1..256 values, got shape {tuple(levels.shape)}"
        )
    if not levels.is_floating_point():
        raise ValueError(f"levels must be floating point, got {levels.dtype}")
    if levels.numel() > 1 and bool(torch.any(levels[1:] < levels[:-1])):
        raise ValueError("levels must be sorted ascending")


def uniform_levels(bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``2^bits`` evenly spaced levels spanning [-1, 1] (the affine grid), correctly rounded.

    Level i is ``(2i - (n - 1)) / (n - 1)`` with n = 2^bits: one division of two integers that
    the dtype holds exactly, so IEEE division rounds the exact quotient once. This is the
    definition of recipes/FORMAT.md (a codec uses these levels for a frame stored at more bits
    than its codebook row holds); ``torch.linspace`` is not, since it accumulates a rounded step
    and is 1 ulp off in 10 of 16 levels at 4 bits and 190 of 256 at 8.
    """
    check_bits(bits)
    n = 2**bits
    return (2 * torch.arange(n, dtype=dtype) - (n - 1)) / torch.tensor(n - 1, dtype=dtype)


def nearest_level(x_scaled: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``uint8`` index of the level nearest to each element; ties go to the lower index.

    ``levels`` is 1-D and sorted ascending (repeated values allowed: the first is chosen).
    """
    _check_levels(levels)
    x = x_scaled.to(levels.dtype)
    return nearest_rows(x.reshape(1, -1), levels[None]).reshape(x.shape)


def nearest_rows(x_RN: torch.Tensor, levels_RL: torch.Tensor) -> torch.Tensor:
    """`nearest_level` of each row of x against its own row of sorted levels (no checks: the
    Lloyd loop and the per-head codec call it on levels they keep sorted)."""
    num_levels = levels_RL.shape[-1]
    # first index with levels[idx] >= x (the upper bracket, itself the first of any repeats): the
    # number of levels below x, counted as L - #(x <= level) so that NaN lands past the end as in
    # searchsorted; a few comparisons beat a binary search per element for small codebooks
    if num_levels <= SMALL_CODEBOOK:
        idx = num_levels - (x_RN.unsqueeze(-1) <= levels_RL.unsqueeze(-2)).sum(-1)
    else:
        idx = torch.searchsorted(levels_RL, x_RN.contiguous())
    hi = idx.clamp(max=num_levels - 1)
    # the lower bracket, moved to the first of its repeats so that ties between equal levels pick the lowest
    first_of = torch.searchsorted(levels_RL, levels_RL)
    lo = first_of.gather(-1, (idx - 1).clamp(min=0))
    take_hi = (levels_RL.gather(-1, hi) - x_RN).abs() < (x_RN - levels_RL.gather(-1, lo)).abs()
    return torch.where(take_hi, hi, lo).to(torch.uint8)


def _cell_ends(xs: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """For sorted samples xs, the number of samples whose nearest level is <= i, for i < L - 1.

    Each end is bracketed by the samples within a hair of the midpoint between levels i and i + 1,
    checked with `nearest_rows` itself at both sides of the bracket (a repeated level can put the
    end elsewhere: then the bracket is all samples); a bisection inside the brackets, every probe
    coded by `nearest_rows`, finds the ends exactly (ties and repeats follow its rule)."""
    n, L = xs.numel(), levels.numel()
    cell = torch.arange(L - 1)
    above = lambda at: nearest_rows(xs[at.clamp(0, n - 1)][None], levels[None])[0].long() > cell
    mid = (levels[:-1] + levels[1:]) / 2
    hair = 1e-9 * (mid.abs() + 1)
    lo, hi = torch.searchsorted(xs, mid - hair), torch.searchsorted(xs, mid + hair, right=True)
    brackets = ((lo == 0) | ~above(lo - 1)) & ((hi == n) | above(hi))
    lo, hi = torch.where(brackets, lo, 0), torch.where(brackets, hi, n)
    for _ in range(int((hi - lo).max()).bit_length()):
        mid_at = (lo + hi) // 2
        up = above(mid_at)
        open_ = lo < hi
        hi = torch.where(open_ & up, mid_at, hi)
        lo = torch.where(open_ & ~up, mid_at + 1, lo)
    return lo


def decode(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Levels at ``codes`` (normalized values; multiply by the scale to get x back)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    _check_levels(levels)
    return levels[codes.long()]


def fit_levels(
    samples: torch.Tensor,
    bits: int,
    *,
    weights: torch.Tensor | None = None,
    max_iters: int = 100,
    tol: float = 1e-7,
) -> torch.Tensor:
    """Fit ``2^bits`` levels to ``samples`` by weighted 1-D Lloyd-Max (k-means).

    Deterministic (no random initialisation): levels start at the weighted sample quantiles
    ``(i + 0.5) / L`` and Lloyd iterations run until no level moves by more than ``tol`` or
    ``max_iters`` is reached. ``weights`` (same number of elements, non-negative) weight each
    sample's squared error, e.g. KVQuant's Fisher-information sensitivity. A level whose cell
    receives no sample keeps its previous value. Returns float32 levels sorted ascending;
    they repeat only when the samples have fewer distinct values than levels.
    """
    check_bits(bits)
    x = samples.detach().reshape(-1).double()
    if x.numel() == 0:
        raise ValueError("fit_levels needs at least one sample")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("fit_levels samples must be finite")
    if weights is None:
        w = torch.ones_like(x)
    else:
        w = weights.detach().reshape(-1).double()
        if w.numel() != x.numel():
            raise ValueError(f"weights has {w.numel()} elements, samples has {x.numel()}")
        if bool(torch.any(w < 0)) or not bool(torch.isfinite(w).all()) or w.sum() <= 0:
            raise ValueError("weights must be finite, non-negative and not all zero")
    num_levels = 2**bits
    # initial levels: weighted quantiles (i + 0.5) / L, the first sorted sample whose
    # cumulative weight reaches that fraction (torch.quantile is unweighted and size-limited)
    order = x.argsort(stable=True)
    xs, ws = x[order], w[order]
    cum_w = ws.cumsum(0)
    probs = (torch.arange(num_levels, dtype=torch.float64) + 0.5) / num_levels
    at = torch.searchsorted(cum_w, probs * cum_w[-1]).clamp(max=x.numel() - 1)
    levels = xs[at]
    # every cell is a run of the sorted samples (the nearest level never decreases as x grows), so
    # a Lloyd step needs only each cell's end, found by bisection, and prefix sums of w and w x
    prefix_w = torch.cat([ws.new_zeros(1), cum_w])
    prefix_wx = torch.cat([ws.new_zeros(1), (ws * xs).cumsum(0)])
    for _ in range(max_iters):
        ends = torch.cat([_cell_ends(xs, levels), torch.tensor([xs.numel()])])
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        mass = prefix_w[ends] - prefix_w[starts]
        total = prefix_wx[ends] - prefix_wx[starts]
        new = torch.where(mass > 0, total / mass.clamp_min(1e-300), levels)
        # cells are intervals of the sorted line, so their means stay sorted; sort guards rounding
        new = new.sort().values
        moved = (new - levels).abs().max().item()
        levels = new
        if moved <= tol:
            break
    return levels.float()
