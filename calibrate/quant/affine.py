"""Uniform affine quantization with an explicit granularity.

A b-bit uniform quantizer maps a real x to an integer q on a grid of step ``scale``
anchored at ``zero_point``::

    q      = clamp(round_half_even((x - zero_point) / scale), qmin, qmax)
    x_hat  = q * scale + zero_point

Two grids are supported, selected by ``symmetric``:

* **asymmetric** (the KIVI convention): ``q in [0, 2^b - 1]``, ``scale = (max - min) / (2^b - 1)``
  and ``zero_point = min``. The zero point is a *float* (the range minimum), not an integer
  offset, so ``x_hat = q * scale + min``; zero need not be exactly representable.
* **symmetric**: ``q in [-2^(b-1), 2^(b-1) - 1]``, ``scale = absmax / 2^(b-1)`` and
  ``zero_point = 0``. This is the rule of the seed brief's 2-bit example (``scale = absmax/2``,
  ``q = clamp(round(x/scale), -2, 1)``), which the ``naive2`` baseline replicates. Note that
  ``+absmax`` itself maps to ``2^(b-1)`` and is clamped to ``2^(b-1) - 1``: the grid is
  lopsided by one step, exactly as in that brief.

Stored codes are always unsigned (``uint8``, ready for :mod:`calibrate.quant.packing`):
``stored = q - qmin``, i.e. ``q`` itself for asymmetric and ``q + 2^(b-1)`` for symmetric.
:func:`quantize` returns stored codes and :func:`dequantize` takes them, so the offset lives in
exactly one place.

Rounding is round-half-to-even (``torch.round``, numpy's ``round``, C's ``nearbyint`` in the
default rounding mode): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2. The division is done in floating point
(float32 unless the input is float64); a foreign runtime must divide, not multiply by a
reciprocal, to reproduce codes bit-exactly.

Clipping. ``clip_ratio = r in (0, 1]`` shrinks the quantization range before the scale is
computed, trading clipping error on the few largest values for a finer step on all others:

* symmetric: ``absmax -> r * absmax`` (the range ``[-absmax, absmax]`` scaled about 0);
* asymmetric: ``[min, max]`` is scaled by ``r`` about its midpoint, i.e. both ends move inward
  by ``(1 - r) * (max - min) / 2``, evaluated left to right in the parameters' dtype (``r`` is
  rounded to it first: ``1 - r`` in float64 differs by an ulp and flips codes). Scaling about the midpoint (rather than scaling min and max
  toward 0) keeps the clipped range inside the data range and is invariant to shifting the
  data, which matters for key channels with a large mean offset.

``r`` may be a float or a tensor broadcastable to the parameter shape (per-channel ratios),
and may require grad: the parameters are differentiable in it.

Granularity is explicit: statistics are reduced over ``reduce_dims`` (kept as size-1 axes so
the parameters broadcast back onto ``x``). For keys/values laid out ``[..., T, D]`` (tokens,
channels):

* per-channel (static K): reduce over tokens, ``reduce_dims=PER_CHANNEL == (-2,)``;
* per-token (dynamic V): reduce over channels, ``reduce_dims=PER_TOKEN == (-1,)``;
* per-group of G channels: ``xg = group_view(x, G)`` (``[..., D] -> [..., D/G, G]``), then
  reduce over ``(-1,)`` and ``ungroup`` the result. ``group_view(x, G, dim=-2)`` groups tokens
  instead (KIVI's per-channel keys over blocks of G tokens).

:func:`fake_quant` is ``dequantize(quantize(x))`` with a straight-through estimator so fitters
can use autograd; see its docstring for the gradient.
"""

from __future__ import annotations

import math

import torch

ALLOWED_BITS = (2, 3, 4, 8)
DEFAULT_EPS = 1e-8

# reduce_dims for [..., T, D] tensors (tokens, channels)
PER_CHANNEL = (-2,)
PER_TOKEN = (-1,)


def check_bits(bits: int) -> int:
    """Return ``bits`` if it is a supported width, else raise ValueError."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ALLOWED_BITS:
        raise ValueError(f"bits must be one of {ALLOWED_BITS}, got {bits!r}")
    return bits


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Signed integer range ``(qmin, qmax)`` of ``q`` (before the unsigned storage offset)."""
    check_bits(bits)
    if symmetric:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _param_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_clip_ratio(clip_ratio: float | torch.Tensor) -> None:
    if isinstance(clip_ratio, torch.Tensor):
        ok = bool(torch.all((clip_ratio > 0) & (clip_ratio <= 1)))
    else:
        ok = 0 < clip_ratio <= 1
    if not ok:
        raise ValueError(f"clip_ratio must lie in (0, 1], got {clip_ratio!r}")


def compute_params(
    x: torch.Tensor,
    bits: int,
    *,
    symmetric: bool,
    reduce_dims: tuple[int, ...] | int,
    clip_ratio: float | torch.Tensor = 1.0,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max (or absmax) quantization parameters of ``x`` reduced over ``reduce_dims``.

    Returns ``(scale, zero_point)``, both with ``reduce_dims`` kept as size-1 axes, in float32
    (float64 for float64 input). ``scale >= eps`` always, so zero or constant inputs never give
    NaN or inf: a constant asymmetric slice quantizes to code 0 and dequantizes exactly.
    ``zero_point`` is the (clipped) minimum for asymmetric, zeros for symmetric.
    """
    check_bits(bits)
    _check_clip_ratio(clip_ratio)
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    dims = (reduce_dims,) if isinstance(reduce_dims, int) else tuple(reduce_dims)
    if not dims:
        raise ValueError("reduce_dims must name at least one axis")
    x = x.to(_param_dtype(x))
    return params_from_stats(range_stats(x, symmetric=symmetric, reduce_dims=dims), bits, symmetric=symmetric,
                             clip_ratio=clip_ratio, eps=eps)


def range_stats(x: torch.Tensor, *, symmetric: bool, reduce_dims: tuple[int, ...]) -> torch.Tensor:
    """What `compute_params` needs of x, kept dims size 1: [-min, max] stacked on a new first axis
    (absmax alone if symmetric). Stats of parts of x merge into those of x by `torch.maximum`,
    exactly (a frame's channel ranges gathered a token block at a time)."""
    if symmetric:
        return x.abs().amax(dim=reduce_dims, keepdim=True).unsqueeze(0)
    return torch.stack([-x.amin(dim=reduce_dims, keepdim=True), x.amax(dim=reduce_dims, keepdim=True)])


def params_from_stats(stats: torch.Tensor, bits: int, *, symmetric: bool, clip_ratio: float | torch.Tensor = 1.0,
                      eps: float = DEFAULT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_params` from `range_stats` (scale, zero_point)."""
    # the ratio is a value of the parameters' dtype (a JSON clip becomes float32 first): 1 - r
    # formed in Python's float64 and rounded afterwards differs by an ulp, which flips codes
    if not isinstance(clip_ratio, torch.Tensor):
        clip_ratio = torch.tensor(clip_ratio, dtype=stats.dtype, device=stats.device)
    if symmetric:
        scale = (clip_ratio * stats[0] / 2 ** (bits - 1)).clamp_min(eps)
        return scale, torch.zeros_like(scale)
    lo, hi = -stats[0], stats[1]
    # shrink [lo, hi] about its midpoint; written so that clip_ratio == 1 gives lo, hi exactly
    shrink = (1 - clip_ratio) * (hi - lo) / 2
    lo, hi = lo + shrink, hi - shrink
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(eps)
    return scale, lo


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    symmetric: bool,
) -> torch.Tensor:
    """Stored ``uint8`` codes ``clamp(round((x - zero_point) / scale), qmin, qmax) - qmin``.

    ``scale`` and ``zero_point`` broadcast against ``x``; ``zero_point=None`` means 0.
    """
    qmin, qmax = code_range(bits, symmetric)
    v = x.to(_param_dtype(x))
    if zero_point is not None:
        v = v - zero_point
    q = torch.round(v / scale).clamp(qmin, qmax)
    return (q - qmin).to(torch.uint8)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    symmetric: bool,
) -> torch.Tensor:
    """Reconstruction ``(codes + qmin) * scale + zero_point`` in ``scale``'s dtype."""
    qmin, _ = code_range(bits, symmetric)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    x_hat = (codes.to(scale.dtype) + qmin) * scale
    if zero_point is not None:
        x_hat = x_hat + zero_point
    return x_hat


def _round_ste(v: torch.Tensor) -> torch.Tensor:
    # forward: round half to even; backward: identity
    return v + (torch.round(v) - v).detach()


def fake_quant(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    symmetric: bool,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in value, differentiable by a straight-through estimator.

    Forward equals ``dequantize(quantize(x, ...), ...)`` (same rounding and clamping).
    Backward treats rounding as the identity:

    * d out / d x = 1 inside the clip range ``zero_point + [qmin, qmax] * scale`` (ends
      included) and 0 outside it, where the output is saturated;
    * gradients also reach ``scale`` and ``zero_point`` (the LSQ-style estimator:
      ``d out / d scale = q - (x - zero_point)/scale`` inside, ``q`` outside), so clip ratios
      or scales can be fitted by gradient descent.
    """
    qmin, qmax = code_range(bits, symmetric)
    v = x.to(_param_dtype(x))
    if zero_point is not None:
        v = v - zero_point
    # clamp before rounding (same value as after, since the bounds are integers) so that the
    # gradient is cut exactly outside [qmin, qmax], not half a step beyond it
    q = _round_ste((v / scale).clamp(qmin, qmax))
    out = q * scale
    if zero_point is not None:
        out = out + zero_point
    return out


def group_view(x: torch.Tensor, group_size: int, dim: int = -1) -> torch.Tensor:
    """Split axis ``dim`` of size D into ``(D // group_size, group_size)``.

    With the default ``dim=-1``: ``[..., D] -> [..., D/G, G]``; reduce over ``-1`` for
    per-group parameters. Raises ValueError unless ``group_size`` is a positive divisor of D.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    d = x.shape[dim]
    if d % group_size:
        raise ValueError(f"group_size {group_size} does not divide axis {dim} of size {d}")
    return x.unflatten(dim, (d // group_size, group_size))


def ungroup(x_grouped: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`group_view` with the same ``dim`` (an axis of the ungrouped tensor)."""
    if dim < 0:
        return x_grouped.flatten(dim - 1, dim)
    return x_grouped.flatten(dim, dim + 1)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(sum x^2 / sum (x - x_hat)^2)`` in dB.

    ``inf`` for an exact reconstruction.
    """
    x = x.double()
    noise = (x - x_hat.double()).pow(2).sum().item()
    signal = x.pow(2).sum().item()
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)
