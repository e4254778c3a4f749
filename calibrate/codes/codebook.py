"""Kind "codebook": non-uniform levels in [-1, 1] (role `codebook`, one row per head) times a
float16 absmax scale per token and group, or the static per-channel `scale` and `zero_point`."""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.codes.base import FP, FP_EPS, Kind, packed_nbytes
from calibrate.quant import affine, codebook


def quantize(y: Tensor, spec, p, steps=None) -> tuple[Tensor, dict[str, Tensor]]:
    nearest = steps.nearest if steps else (lambda u: codebook.nearest_level(u, p.levels_L))
    D = y.shape[-1]
    if spec.axis == "channel" and spec.static:
        scale, zero = p.scale_D, p.zero_D
        return nearest(((y - zero) / scale).clamp(-1, 1)), {}
    g = affine.group_view(y, spec.group_size or D)
    scale = (g.abs().amax(-1, keepdim=True) * p.clip).clamp_min(FP_EPS).to(FP).float()
    zero = torch.zeros_like(scale)
    codes = nearest(((g - zero) / scale).clamp(-1, 1))
    return affine.ungroup(codes), {"scale": scale.to(FP)}


def dequantize(codes: Tensor, dyn: dict[str, Tensor], spec, p, steps=None) -> Tensor:
    D = codes.shape[-1]
    vals = steps.levels(codes) if steps else codebook.decode(codes, p.levels_L)
    if spec.axis == "channel" and spec.static:
        return vals * p.scale_D + p.zero_D
    g = affine.group_view(vals, spec.group_size or D)
    return affine.ungroup(g * dyn["scale"].float())


def roles(spec, H: int, D: int) -> dict[str, tuple[int, ...]]:
    """One row of 2^b levels per head, b the widest width below 16 any head is stored at."""
    return {"codebook": (H, 2 ** max(spec.bits_of(h) if spec.bits_of(h) < 16 else 0 for h in range(H)))}


def check(spec, where: str) -> str | None:
    if spec.axis == "channel" and not spec.static:
        return (f"{where}.static: a codebook with axis 'channel' must be static (dynamic codebooks are per "
                "token: use axis 'token')")
    return None


KIND = Kind("codebook", quantize, dequantize, roles=roles, check=check, table="levels_L",
            code_nbytes=lambda spec, b, B, T, D: packed_nbytes(spec, b, B, T, D, 1))  # scale only (levels are symmetric)
