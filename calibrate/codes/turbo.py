"""Kinds "turbo" (TurboQuant MSE: the float16 L2 norm per token, then each coordinate of the unit
vector at its nearest Lloyd-Max level, role `lloyd_max`) and "turbo_prod" (TurboQuant inner
product: b-1 bits of "turbo" and the 1-bit QJL sketch of the residual, role `qjl`, with the
residual's norm), quant/turbo.py."""

from __future__ import annotations

from torch import Tensor

from calibrate.codes.base import FP, FP_EPS, Kind
from calibrate.quant import ordered, packing, turbo


def _fp16_norm(y: Tensor) -> Tensor:
    """|y| per token [..., 1] (correctly rounded sqrt of a fixed-order sum of squares), stored as
    float16 (kept >= its smallest subnormal so u = y / n is finite)."""
    return ordered.sqrt(ordered.sum_squares(y)).clamp(FP_EPS, 65504.0).to(FP)


def _steps(p, steps: turbo.Steps | None) -> turbo.Steps:
    return steps or turbo.head_steps(p.lloyd_max_L, p.qjl_MD)


def mse_quantize(y: Tensor, spec, p, steps=None) -> tuple[Tensor, dict[str, Tensor]]:
    norm = _fp16_norm(y)
    return _steps(p, steps).nearest(y / norm.float()), {"norm": norm}


def mse_dequantize(codes: Tensor, dyn: dict[str, Tensor], spec, p, steps=None) -> Tensor:
    return _steps(p, steps).levels(codes) * dyn["norm"].float()


def prod_quantize(y: Tensor, spec, p, steps=None) -> tuple[Tensor, dict[str, Tensor]]:
    """code = mse index + 2^(b-1) * [S r >= 0]: b-1 bits of TQ_mse and the QJL sign in the top bit."""
    steps = _steps(p, steps)
    norm = _fp16_norm(y)
    u = y / norm.float()
    idx = steps.nearest(u)
    r = u - steps.levels(idx)
    gamma = ordered.sqrt(ordered.sum_squares(r)).clamp(max=65504.0).to(FP)
    return idx + (steps.signs(r) << (p.bits - 1)), {"norm": norm, "gamma": gamma}


def prod_dequantize(codes: Tensor, dyn: dict[str, Tensor], spec, p, steps=None) -> Tensor:
    steps = _steps(p, steps)
    top = p.bits - 1
    u = steps.levels(codes & ((1 << top) - 1)) + steps.qjl(codes >> top, dyn["gamma"])
    return u * dyn["norm"].float()


def check(s, where: str) -> str | None:
    if s.head_bits is not None or s.bits >= 16:
        return f"{where}: kind {s.kind!r} needs one width below 16 for every head (bits < 16, no head_bits)"
    if s.group_size:
        return f"{where}.group_size: kind {s.kind!r} codes whole head vectors (group_size 0)"
    return None


MSE = Kind("turbo", mse_quantize, mse_dequantize, check=check, per_token=True, own_width=True, table="lloyd_max_L",
           code_nbytes=lambda spec, b, B, T, D: B * T * (packing.packed_nbytes(D, b) + 2),  # float16 norm per token
           roles=lambda spec, H, D: {"lloyd_max": (H, 2**spec.bits)})
PROD = Kind("turbo_prod", prod_quantize, prod_dequantize, check=check, per_token=True, own_width=True,
            table="lloyd_max_L",
            code_nbytes=lambda spec, b, B, T, D: B * T * (packing.packed_nbytes(D, b) + 4),  # norm and residual norm
            roles=lambda spec, H, D: {"lloyd_max": (H, 2 ** (spec.bits - 1)), "qjl": (H, D, D)})
