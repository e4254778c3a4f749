"""Encode one head of one frame's K or V as a recipe's `TensorSpec` says, and decode it.

This is the arithmetic both the runtime (packed storage) and the fitters (fake quantization)
share. `encode` returns the *stored* form of x_BTD (packed codes and per-token parameters in
float16); `decode` turns it back into values; `fake_quant` is the reference path, the same
arithmetic with codes left unpacked, that the tests hold the packed runtime to.

Order of operations for one head (x of shape [B, T, D]; B batch, T tokens, D head_dim):

1. rotate: y = x @ R (R orthogonal; identity if the spec has no rotation);
2. centroid smoothing: subtract the nearest of C static centroids (index stored per token);
3. outlier channels: copy them out in float16 and zero them in y;
4. dense-and-sparse: copy the largest `sparse_fraction` of |y - center| out in float16
   (flat index int16/int32 + value) and set them to the center so they do not stretch ranges;
5. quantize y: uniform affine (dynamic per token and group, dynamic per channel over the frame's
   tokens, or static per channel from the recipe) or a codebook of normalized levels; dynamic
   parameters are rounded to float16 *before* the codes are computed, so stored parameters and
   codes agree exactly;
6. pack the codes along D (recipes/FORMAT.md).

Decoding runs the steps backwards: unpack, dequantize, put sparse values and outlier channels
back, add the centroid, rotate back with R^T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from calibrate.quant import affine, codebook, packing
from calibrate.recipe import Recipe, TensorSpec

FP = torch.float16  # storage type of kept-in-full-precision values and dynamic parameters
FP_EPS = 2.0**-24  # smallest positive float16: dynamic scales never round to 0 when stored


@dataclass(frozen=True)
class HeadParams:
    """Static parameters of one head of one tensor (views into the recipe's tensors)."""

    bits: int
    rotation_DD: Tensor | None = None
    scale_D: Tensor | None = None
    zero_D: Tensor | None = None
    clip: float = 1.0
    levels_L: Tensor | None = None
    outlier_channels_n: Tensor | None = None
    centroids_CD: Tensor | None = None
    comp_down_DR: Tensor | None = None
    comp_up_RD: Tensor | None = None


def head_params(recipe: Recipe, layer: int, kind: str, head: int, bits: int | None = None) -> HeadParams:
    spec: TensorSpec = getattr(recipe.scheme.layers[layer], kind)
    t = lambda role: None if recipe.tensor(layer, kind, role) is None else recipe.tensor(layer, kind, role)[head]
    clip = t("clip")
    native = spec.bits_of(head)
    b = native if bits is None else bits
    levels = t("codebook")
    if levels is not None and b < 16:
        levels = _levels_for_bits(levels, b)
    scale = t("scale")
    if scale is not None and spec.kind == "uniform" and b < 16:
        scale = static_scale_for_bits(scale, native, b, spec.symmetric)
    return HeadParams(
        bits=b,
        rotation_DD=t("rotation"),
        scale_D=scale,
        zero_D=t("zero_point"),
        clip=spec.clip if clip is None else float(clip),
        levels_L=levels,
        outlier_channels_n=t("outlier_channels"),
        centroids_CD=t("centroids"),
        # the compensator is fitted on the spec's own precision: frames stored at other bits
        # (sink, recent, key frames) are decoded without it
        comp_down_DR=t("comp_down") if b == native else None,
        comp_up_RD=t("comp_up") if b == native else None,
    )


def static_scale_for_bits(scale: Tensor, native_bits: int, bits: int, symmetric: bool) -> Tensor:
    """A static per-channel step fitted for `native_bits`, re-cut for `bits` over the same range.

    Frames stored at another precision than the spec's (sink, recent, key frames) keep the
    calibrated range [zero, zero + scale (2^b0 - 1)] (asymmetric) or [-scale 2^(b0-1), ...]
    (symmetric) and split it into 2^bits steps.
    """
    if bits == native_bits:
        return scale
    if symmetric:
        return scale * 2.0 ** (native_bits - 1) / 2.0 ** (bits - 1)
    return scale * (2**native_bits - 1) / (2**bits - 1)


def _levels_for_bits(levels: Tensor, bits: int) -> Tensor:
    """The codebook row for a head stored at `bits`.

    A row of exactly 2^bits levels is used as is; fewer bits take evenly spaced levels of the
    row; more bits than the row holds (e.g. an 8-bit sink frame of a 2-bit codebook) use 2^bits
    uniform levels on [-1, 1].
    """
    if levels.numel() == 2**bits:
        return levels
    if levels.numel() > 2**bits:
        return levels[torch.linspace(0, levels.numel() - 1, 2**bits).round().long()]
    return torch.linspace(-1.0, 1.0, 2**bits, dtype=levels.dtype, device=levels.device)


def _quantize(y: Tensor, spec: TensorSpec, p: HeadParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Codes [B, T, D] (uint8, unpacked) and the dynamic parameters to store."""
    D = y.shape[-1]
    if spec.kind == "codebook":
        if spec.axis == "channel" and spec.static:
            scale, zero = p.scale_D, p.zero_D
            dyn = {}
        else:
            g = affine.group_view(y, spec.group_size or D)
            scale = (g.abs().amax(-1, keepdim=True) * p.clip).clamp_min(FP_EPS).to(FP).float()
            zero = torch.zeros_like(scale)
            dyn = {"scale": scale.to(FP)}
            codes = codebook.nearest_level(((g - zero) / scale).clamp(-1, 1), p.levels_L)
            return affine.ungroup(codes), dyn
        codes = codebook.nearest_level(((y - zero) / scale).clamp(-1, 1), p.levels_L)
        return codes, dyn
    if spec.axis == "channel" and spec.static:
        return affine.quantize(y, p.scale_D, p.zero_D, p.bits, spec.symmetric), {}
    if spec.axis == "channel":
        scale, zero = affine.compute_params(y, p.bits, symmetric=spec.symmetric, reduce_dims=(-2,), clip_ratio=p.clip,
                                            eps=FP_EPS)
        scale, zero = scale.to(FP).float(), zero.to(FP).float()
        dyn = {"scale": scale.to(FP)} if spec.symmetric else {"scale": scale.to(FP), "zero": zero.to(FP)}
        return affine.quantize(y, scale, zero, p.bits, spec.symmetric), dyn
    g = affine.group_view(y, spec.group_size or D)
    scale, zero = affine.compute_params(g, p.bits, symmetric=spec.symmetric, reduce_dims=(-1,), clip_ratio=p.clip,
                                        eps=FP_EPS)
    scale, zero = scale.to(FP).float(), zero.to(FP).float()
    dyn = {"scale": scale.to(FP)} if spec.symmetric else {"scale": scale.to(FP), "zero": zero.to(FP)}
    return affine.ungroup(affine.quantize(g, scale, zero, p.bits, spec.symmetric)), dyn


def _dequantize(codes: Tensor, dyn: dict[str, Tensor], spec: TensorSpec, p: HeadParams) -> Tensor:
    D = codes.shape[-1]
    if spec.kind == "codebook":
        vals = codebook.decode(codes, p.levels_L)
        if spec.axis == "channel" and spec.static:
            return vals * p.scale_D + p.zero_D
        g = affine.group_view(vals, spec.group_size or D)
        return affine.ungroup(g * dyn["scale"].float())
    if spec.axis == "channel" and spec.static:
        return affine.dequantize(codes, p.scale_D, p.zero_D, p.bits, spec.symmetric)
    zero = dyn["zero"].float() if "zero" in dyn else None
    if spec.axis == "channel":
        return affine.dequantize(codes, dyn["scale"].float(), zero, p.bits, spec.symmetric)
    g = affine.group_view(codes, spec.group_size or D)
    return affine.ungroup(affine.dequantize(g, dyn["scale"].float(), zero, p.bits, spec.symmetric))


def _center(spec: TensorSpec, p: HeadParams, y: Tensor) -> Tensor:
    if spec.axis == "channel" and spec.static and p.scale_D is not None:
        mid = p.zero_D + p.scale_D * ((2**p.bits - 1) / 2 if spec.kind == "uniform" and not spec.symmetric else 0.0)
        return mid.expand_as(y)
    return torch.zeros_like(y)


def _prepare(x_BTD: Tensor, spec: TensorSpec, p: HeadParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Steps 1-4: rotation, centroids, outliers, sparse values. Returns y and what to store."""
    y = x_BTD.float()
    side: dict[str, Tensor] = {}
    if p.rotation_DD is not None:
        y = y @ p.rotation_DD
    if p.centroids_CD is not None:
        assign = torch.cdist(y, p.centroids_CD.unsqueeze(0).expand(y.shape[0], -1, -1)).argmin(-1)
        side["assign"] = assign.to(torch.uint8)
        y = y - p.centroids_CD[assign]
    if p.outlier_channels_n is not None:
        side["outliers"] = y[..., p.outlier_channels_n].to(FP)
        y = y.clone()
        y[..., p.outlier_channels_n] = _center(spec, p, y)[..., p.outlier_channels_n]
    if spec.sparse_fraction > 0:
        B, T, D = y.shape
        k = max(1, round(spec.sparse_fraction * T * D))
        center = _center(spec, p, y)
        idx = (y - center).abs().reshape(B, T * D).topk(k, dim=-1).indices.sort(dim=-1).values
        side["sparse_idx"] = idx.to(torch.int16 if T * D < 2**15 else torch.int32)
        side["sparse_val"] = y.reshape(B, T * D).gather(-1, idx).to(FP)
        y = y.reshape(B, T * D).scatter(-1, idx, center.reshape(B, T * D).gather(-1, idx)).reshape(B, T, D)
    return y, side


def _finish(y: Tensor, side: dict[str, Tensor], p: HeadParams) -> Tensor:
    """Steps 4-1 backwards on the dequantized y."""
    if "sparse_val" in side:
        B, T, D = y.shape
        y = y.reshape(B, T * D).scatter(-1, side["sparse_idx"].long(), side["sparse_val"].float()).reshape(B, T, D)
    if "outliers" in side:
        y = y.clone()
        y[..., p.outlier_channels_n] = side["outliers"].float()
    if "assign" in side:
        y = y + p.centroids_CD[side["assign"].long()]
    if p.comp_down_DR is not None:
        y = y + (y @ p.comp_down_DR) @ p.comp_up_RD
    if p.rotation_DD is not None:
        y = y @ p.rotation_DD.T
    return y


def encode(x_BTD: Tensor, spec: TensorSpec, p: HeadParams) -> dict[str, Tensor]:
    """The stored form of one head: every tensor in it counts toward the cache's bytes."""
    if p.bits >= 16:
        return {"fp16": x_BTD.to(FP)}
    y, side = _prepare(x_BTD, spec, p)
    codes, dyn = _quantize(y, spec, p)
    stored = {"codes": packing.pack(codes, p.bits)}
    stored.update({f"p_{k}": v for k, v in dyn.items()})
    stored.update(side)
    return stored


def decode(stored: dict[str, Tensor], spec: TensorSpec, p: HeadParams, head_dim: int) -> Tensor:
    if "fp16" in stored:
        return stored["fp16"].float()
    codes = packing.unpack(stored["codes"], p.bits, head_dim)
    dyn = {k[2:]: v for k, v in stored.items() if k.startswith("p_")}
    return _finish(_dequantize(codes, dyn, spec, p), stored, p)


def fake_quant(x_BTD: Tensor, spec: TensorSpec, p: HeadParams) -> tuple[Tensor, Tensor | None]:
    """Reference path (no packing): (dequantized x, unpacked codes or None at 16 bits)."""
    if p.bits >= 16:
        return x_BTD.to(FP).float(), None
    y, side = _prepare(x_BTD, spec, p)
    codes, dyn = _quantize(y, spec, p)
    return _finish(_dequantize(codes, dyn, spec, p), side, p), codes


def stored_nbytes(stored: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in stored.values())


def predicted_nbytes(spec: TensorSpec, p: HeadParams, B: int, T: int, D: int) -> int:
    """Bytes `encode` stores for one head of one frame, from the spec alone."""
    if p.bits >= 16:
        return B * T * D * 2
    n = B * T * packing.packed_nbytes(D, p.bits)
    if not (spec.axis == "channel" and spec.static):
        per = 1 if spec.symmetric or spec.kind == "codebook" else 2
        groups = T * (D // (spec.group_size or D)) if spec.axis == "token" else D
        n += B * groups * per * 2
    if p.centroids_CD is not None:
        n += B * T
    if p.outlier_channels_n is not None:
        n += B * T * p.outlier_channels_n.numel() * 2
    if spec.sparse_fraction > 0:
        k = max(1, round(spec.sparse_fraction * T * D))
        n += B * k * ((2 if T * D < 2**15 else 4) + 2)
    return n
