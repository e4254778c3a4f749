"""Kind "nvfp4": NVIDIA's 4-bit floating-point block format, the KV cache format LongLive-2.0
ships for Blackwell GPUs. Each value is an FP4 E2M1 number (sign, 2 exponent bits, 1 mantissa
bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) times an FP8 E4M3 scale per block of 16 consecutive
channels of a token, times a float32 scale per tensor. A tensor here is one head of one cached
frame: its scale s_t = max|y| / (6 * 448) over the frame's tokens, computed when the frame is
stored (deployments often calibrate it once instead; per frame no value saturates).

Per block (float32, each quotient and product rounded once):

    s_b = e4m3(clamp((max|y_block| / 6) / s_t, 2^-9, 448))      stored, 1 byte
    p   = s_b * s_t
    u   = y / p;  m = E2M1 magnitude index of |u| (nearest, ties to the even index, >= 6 -> 6)
    code = 8 [u < 0] + m                                        4 bits

Decode: y = (-1)^[code >= 8] E2M1[code mod 8] * p. 4.5 bits per element plus 32 bits per head
and frame; recipes/FORMAT.md is normative.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.codes.base import Kind
from calibrate.quant import affine, packing, qvg

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes, index = the 3 low bits
BLOCK = 16
FP4_MAX, FP8_MAX = 6.0, 448.0
TENSOR_MIN = 2.0**-126  # the per-tensor scale's floor (float32's smallest normal): an all-zero frame stays finite
# between magnitudes m and m + 1 a tie goes to the even index: crossed from m even only above the
# midpoint, from m odd at it
_MIDPOINTS = [(E2M1[m] + E2M1[m + 1]).item() / 2 for m in range(7)]


def magnitude_index(a: Tensor) -> Tensor:
    """E2M1 index (uint8) of |u| = a >= 0: nearest magnitude, ties to the even index, saturating at 6."""
    m = torch.zeros_like(a, dtype=torch.uint8)
    for k, mid in enumerate(_MIDPOINTS):
        m += (a >= mid) if k % 2 else (a > mid)
    return m


def tensor_scale(y: Tensor) -> Tensor:
    """s_t [..., 1, 1] (float32) of y [..., T, D]: max|y| / (6 * 448), floored at 2^-126."""
    return (y.abs().amax((-2, -1), keepdim=True) / (FP4_MAX * FP8_MAX)).clamp_min(TENSOR_MIN)


def quantize(y: Tensor, spec, p, steps=None) -> tuple[Tensor, dict[str, Tensor]]:
    s_t = tensor_scale(y)
    g = affine.group_view(y, BLOCK)  # [..., T, D/16, 16]
    s_b = qvg.fp8_e4m3((g.abs().amax(-1, keepdim=True) / FP4_MAX) / s_t.unsqueeze(-1))
    u = g / (s_b.float() * s_t.unsqueeze(-1))
    codes = magnitude_index(u.abs()) + (u < 0).to(torch.uint8) * 8
    return affine.ungroup(codes), {"scale": s_b, "tensor": s_t}


def dequantize(codes: Tensor, dyn: dict[str, Tensor], spec, p, steps=None) -> Tensor:
    g = affine.group_view(codes, BLOCK)
    values = E2M1.to(codes.device)[(g & 7).long()]
    values = torch.where(g >= 8, -values, values)
    return affine.ungroup(values * (dyn["scale"].float() * dyn["tensor"].unsqueeze(-1)))


def code_nbytes(spec, b: int, B: int, T: int, D: int) -> int:
    """Packed 4-bit codes, one E4M3 scale per 16 channels of a token, one float32 scale per frame."""
    return B * T * packing.packed_nbytes(D, b) + B * T * (D // BLOCK) + 4 * B


def check(s, where: str) -> str | None:
    if s.bits != 4 or s.head_bits is not None:
        return f"{where}.bits: kind 'nvfp4' codes every head at 4 bits (bits 4, no head_bits), got {s.bits}"
    if s.group_size != BLOCK:
        return f"{where}.group_size: kind 'nvfp4' scales blocks of {BLOCK} channels (group_size {BLOCK}), got {s.group_size}"
    return None


KIND = Kind("nvfp4", quantize, dequantize, code_nbytes, check=check, per_token=True, own_width=True, frame_wide=True)
