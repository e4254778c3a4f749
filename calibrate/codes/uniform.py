"""Kind "uniform": affine codes, dynamic per token and group, dynamic per channel over a frame's
tokens, or static per channel from the recipe's `scale` and `zero_point`; dynamic parameters are
rounded to float16 before the codes are computed, so stored parameters and codes agree exactly."""

from __future__ import annotations

from torch import Tensor

from calibrate.codes.base import FP, FP_EPS, Kind, packed_nbytes
from calibrate.quant import affine


def quantize(y: Tensor, spec, p, steps=None) -> tuple[Tensor, dict[str, Tensor]]:
    D = y.shape[-1]
    if spec.axis == "channel" and spec.static:
        return affine.quantize(y, p.scale_D, p.zero_D, p.bits, spec.symmetric), {}
    if spec.axis == "channel":
        return channel_quantize(y, spec, p, affine.range_stats(y, symmetric=spec.symmetric, reduce_dims=(-2,)))
    g = affine.group_view(y, spec.group_size or D)
    scale, zero = affine.compute_params(g, p.bits, symmetric=spec.symmetric, reduce_dims=(-1,), clip_ratio=p.clip,
                                        eps=FP_EPS)
    scale, zero = scale.to(FP).float(), zero.to(FP).float()
    dyn = {"scale": scale.to(FP)} if spec.symmetric else {"scale": scale.to(FP), "zero": zero.to(FP)}
    return affine.ungroup(affine.quantize(g, scale, zero, p.bits, spec.symmetric)), dyn


def channel_quantize(y: Tensor, spec, p, stats: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """A dynamic channel axis: the frame's per-channel ranges `stats` (affine.range_stats over its
    tokens, which a runtime may gather a token block at a time) -> codes of y and the float16
    scale (and minimum)."""
    scale, zero = affine.params_from_stats(stats, p.bits, symmetric=spec.symmetric, clip_ratio=p.clip, eps=FP_EPS)
    scale, zero = scale.to(FP).float(), zero.to(FP).float()
    dyn = {"scale": scale.to(FP)} if spec.symmetric else {"scale": scale.to(FP), "zero": zero.to(FP)}
    return affine.quantize(y, scale, zero, p.bits, spec.symmetric), dyn


def dequantize(codes: Tensor, dyn: dict[str, Tensor], spec, p, steps=None) -> Tensor:
    D = codes.shape[-1]
    if spec.axis == "channel" and spec.static:
        return affine.dequantize(codes, p.scale_D, p.zero_D, p.bits, spec.symmetric)
    zero = dyn["zero"].float() if "zero" in dyn else None
    if spec.axis == "channel":
        return affine.dequantize(codes, dyn["scale"].float(), zero, p.bits, spec.symmetric)
    g = affine.group_view(codes, spec.group_size or D)
    return affine.ungroup(affine.dequantize(g, dyn["scale"].float(), zero, p.bits, spec.symmetric))


KIND = Kind("uniform", quantize, dequantize, uniform_step=True,  # scale, and a zero point unless symmetric
            code_nbytes=lambda spec, b, B, T, D: packed_nbytes(spec, b, B, T, D, 1 if spec.symmetric else 2))
