"""Encode one head of one frame's K or V as a recipe's `TensorSpec` says, and decode it.

This is the arithmetic both the runtime (packed storage) and the fitters (fake quantization)
share. Its input is a spec, the per-head role tensors of one layer's K or V (as a recipe holds
them, or as the fitter builds a candidate) and a width: `head_params(spec, tensors, head, bits)`
picks one head's parameters. `encode` returns the *stored* form of x_BTD (packed codes and
per-token parameters in float16); `decode` turns it back into values; `fake_quant` is the
reference path, the same arithmetic with codes left unpacked, that the tests hold the packed
runtime to (`fake_quant_heads` runs it over every head of whole frames); `frame_nbytes` says
what `encode` stores, from the spec alone, for the memory model (memory.py). The way values
become codes is a *code kind* (calibrate/codes/: uniform affine, codebook, prq, turbo, ...): the
plug-in point for new quantizers (ARCHITECTURE.md).

Order of operations for one head (x of shape [B, T, D]; B batch, T tokens, D head_dim):

1. rotate: y = x @ R (R orthogonal; identity if the spec has no rotation);
2. centroid smoothing: subtract the nearest of C static centroids (index stored per token);
3. outlier channels: copy them out in float16 and zero them in y;
4. dense-and-sparse: copy the largest `sparse_fraction` of |y - center| out in float16
   (flat index int16/int32 + value) and set them to the center so they do not stretch ranges;
5. quantize y as the spec's kind does (calibrate/codes/: each kind's module says how; dynamic
   parameters are rounded to their stored type *before* the codes are computed, so stored
   parameters and codes agree exactly);
6. pack the codes along D (recipes/FORMAT.md).

Decoding runs the steps backwards: unpack, dequantize, put sparse values and outlier channels
back, add the centroid, rotate back with R^T.

Every float step is the exact arithmetic of recipes/FORMAT.md ("Arithmetic"), so a runtime
written from the document alone stores the same bytes and decodes the same floats (the numpy
reader, recipes/reader.py, is held to that by tests/test_reader_exact.py): float32 in the
written order; products with the rotation, the compensator, the QJL sketch, and norms and
distances, are the fixed-order sums of quant/ordered.py (not BLAS: its order changes the last bit
and, at a rounding boundary, the code); ties go to the lowest index (nearest level or centroid,
sparse positions); a clip ratio is a float32; the scale floor is float16's smallest subnormal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from calibrate.codes import FP, KINDS
from calibrate.quant import codebook, ordered, packing, qvg
from calibrate.scheme_spec import TensorSpec


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
    lloyd_max_L: Tensor | None = None  # kinds turbo/turbo_prod: role `lloyd_max`
    qjl_MD: Tensor | None = None  # kind turbo_prod: role `qjl`
    span_centroids_BSCD: Tensor | None = None  # kind prq: the span's state (not a role: `with_span_state`)


def head_params(spec: TensorSpec, tensors: Mapping[str, Tensor], head: int, bits: int | None = None) -> HeadParams:
    """The parameters of head `head` stored at `bits` (default: the spec's own bits for the head).

    `tensors` maps a role (`scale`, `rotation`, ...) to its per-head stack [H, ...], as a recipe
    holds them for one layer and tensor (`Recipe.layer_tensors`) and as the fitter builds its
    candidates: the runtime and the fitter derive a head's parameters the same way, here.
    """
    t = lambda role: None if tensors.get(role) is None else tensors[role][head]
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
        lloyd_max_L=t("lloyd_max"),
        qjl_MD=t("qjl"),
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
    """The codebook row for a head stored at `bits` (FORMAT.md, "Token classes").

    A row of exactly n = 2^bits levels is used as is; a longer row of L levels is subsampled at
    the indices nearest to i (L - 1) / (n - 1) (never a tie: n - 1 is odd), computed in integers;
    a shorter row (e.g. an 8-bit sink frame of a 2-bit codebook) is replaced by the n uniform
    levels of `codebook.uniform_levels` (correctly rounded, not float32 linspace).
    """
    n = 2**bits
    if levels.numel() == n:
        return levels
    if levels.numel() > n:
        return levels[subsample_indices(levels.numel(), n).to(levels.device)]
    return codebook.uniform_levels(bits).to(device=levels.device, dtype=levels.dtype)


def subsample_indices(num_levels: int, n: int) -> Tensor:
    """round(i (L - 1) / (n - 1)) for i = 0 .. n-1 in exact integer arithmetic (int64 [n])."""
    i = torch.arange(n, dtype=torch.int64)
    return (2 * i * (num_levels - 1) + (n - 1)) // (2 * (n - 1))


def _quantize(y: Tensor, spec: TensorSpec, p: HeadParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Codes [B, T, D] (uint8, unpacked) and the dynamic parameters to store (step 5: the kind's)."""
    return KINDS[spec.kind].quantize(y, spec, p)


def _dequantize(codes: Tensor, dyn: dict[str, Tensor], spec: TensorSpec, p: HeadParams) -> Tensor:
    return KINDS[spec.kind].dequantize(codes, dyn, spec, p)


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
        y = ordered.matmul(y, p.rotation_DD)
    if p.centroids_CD is not None:
        assign = ordered.sq_distances(y, p.centroids_CD).argmin(-1)  # first minimum: ties to the lowest index
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
        idx = sparse_positions((y - center).abs().reshape(B, T * D), k)
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
        y = y + ordered.matmul(ordered.matmul(y, p.comp_down_DR), p.comp_up_RD)
    if p.rotation_DD is not None:
        y = ordered.matmul(y, p.rotation_DD.T)
    return y


def sparse_positions(magnitude_BN: Tensor, k: int) -> Tensor:
    """The k flat positions of largest magnitude per row, ascending (int64 [B, k]).

    Ties go to the lowest position (a stable descending sort keeps equal values in index
    order), as FORMAT.md says: `topk` picks among equal values in no stated order, and float16
    inputs (a recent frame re-encoded from its float16 copy) tie often.
    """
    order = torch.sort(magnitude_BN, dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=-1).values


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
    if span_of(spec, 0) is not None and p.span_centroids_BSCD is None:  # a frame on its own is its span
        p = with_span_state(p, fit_span_state(x_BTD, spec, p))
    y, side = _prepare(x_BTD, spec, p)
    codes, dyn = _quantize(y, spec, p)
    return _finish(_dequantize(codes, dyn, spec, p), side, p), codes


def fake_quant_heads(x_BHFTD: Tensor, spec: TensorSpec, tensors: Mapping[str, Tensor], bits_H: list[int]) -> Tensor:
    """`fake_quant` of every head of whole frames [B, H, F, T, D], head h at `bits_H[h]`.

    Each frame is quantized on its own (per-frame parameters as the runtime computes them);
    `tensors` are the per-head roles of one layer's K or V (see `head_params`).
    """
    B, H, F, T, D = x_BHFTD.shape
    out = []
    for h in range(H):
        y = x_BHFTD[:, h].reshape(B * F, T, D)
        out.append(fake_quant(y, spec, head_params(spec, tensors, h, bits_H[h]))[0].reshape(B, F, T, D))
    return torch.stack(out, dim=1)


def stored_nbytes(stored: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in stored.values())


def frame_nbytes(spec: TensorSpec, bits: int, B: int, T: int, D: int) -> int:
    """Bytes `encode` stores for one head of B x T tokens at `bits`, from the spec alone.

    The memory model (memory.py) sums this over heads, layers and the frames a cache holds; a
    test holds it to `stored_nbytes` of what `encode` really returns.
    """
    if bits >= 16:
        return B * T * D * 2
    n = KINDS[spec.kind].code_nbytes(spec, bits, B, T, D)
    if spec.centroids:
        n += B * T  # uint8 index of the nearest centroid per token
    if spec.outliers:
        n += B * T * spec.outliers * 2
    if spec.sparse_fraction > 0:
        k = max(1, round(spec.sparse_fraction * T * D))
        n += B * k * ((2 if T * D < 2**15 else 4) + 2)
    return n


# ---- span state: dynamic parameters the frames of a span share (kind "prq": its centroids) ----
# A span is `prq_span_frames` consecutive frames (span of frame f = f // prq_span_frames). The first
# frame of a span the runtime encodes below 16 bits fits the state on its own values (y after steps
# 1-4); the span's later frames are coded against it; the runtime holds it while a kept frame of
# the span is held below 16 bits (memory.span_state_bytes counts it). With `prq_deferred` the
# span's frames are held in float16 (`span_pending`) until its last frame is appended; the state is
# then fitted on the tokens of all its held frames to be coded, in frame order, and each is coded.
def span_of(spec: TensorSpec, index: int) -> int | None:
    """The span of frame `index`, or None when the spec's kind keeps no span state."""
    if spec.kind == "prq" and spec.prq_stages > 0:
        return index // spec.prq_span_frames
    return None


def span_pending(spec: TensorSpec, index: int, num_appended: int) -> bool:
    """Frame `index` is held in float16 after `num_appended` appends: its spec defers its span
    (`prq_deferred`) and the span's last frame has not been appended yet."""
    return spec.prq_deferred and (index // spec.prq_span_frames + 1) * spec.prq_span_frames > num_appended


def fit_span_state(x_BTD: Tensor, spec: TensorSpec, p: HeadParams) -> Tensor:
    """The span's centroids [B, stages, C, D] (float16), fitted on the tokens x (one frame, or a
    deferred span's frames concatenated; quant/qvg.py)."""
    y, _ = _prepare(x_BTD, spec, p)
    return qvg.fit_centroids(y, spec.prq_stages, spec.prq_centroids, spec.prq_kmeans_iters)


def with_span_state(p: HeadParams, state: Tensor) -> HeadParams:
    return replace(p, span_centroids_BSCD=state)


def span_state_nbytes(spec: TensorSpec, B: int, D: int) -> int:
    """Bytes of one span's state for one head: float16 centroids [B, stages, C, D]."""
    return B * spec.prq_stages * spec.prq_centroids * D * 2 if span_of(spec, 0) is not None else 0


# ---- key steps: what the Jensen-bias correction reads from a stored frame (quant/jensen.py) ----
def key_steps(stored: dict[str, Tensor], spec: TensorSpec, p: HeadParams, T: int, D: int,
              outlier_idx: Tensor | None = None) -> Tensor:
    """Grid step [..., T, D] of every stored element in the code basis (after the rotation): the
    scale of its uniform group (kind "uniform": dynamic per token/group or per channel, or the
    static per-channel scale; kind "prq": the FP8 residual scale); 0 where a value is exact
    (a float16 frame, outlier channels, sparse entries).

    The stored tensors may have any leading axes (one head's frame: [B]; quant/headcodec.py: a
    group's [B, Hg, J], with `p` and `outlier_idx`, its heads' outlier channels [..., n], shaped
    to broadcast over them; default `p.outlier_channels_n`)."""
    if "fp16" in stored:
        return torch.zeros_like(stored["fp16"], dtype=torch.float32)
    lead = stored["codes"].shape[:-2]
    if not KINDS[spec.kind].uniform_step:
        raise ValueError(f"kind {spec.kind!r} has no uniform step (the Jensen correction needs one: "
                         f"{', '.join(n for n, k in KINDS.items() if k.uniform_step)})")
    if spec.axis == "channel" and spec.static:
        step = p.scale_D.float().expand(*lead, T, D)
    elif spec.axis == "channel":
        step = stored["p_scale"].float().expand(*lead, T, D)
    else:
        G = spec.group_size or D
        step = stored["p_scale"].float().reshape(*lead, T, D // G, 1).expand(*lead, T, D // G, G).reshape(*lead, T, D)
    idx = p.outlier_channels_n if outlier_idx is None else outlier_idx
    if idx is not None:
        step = step.scatter(-1, idx.expand(*lead, T, idx.shape[-1]), 0.0)
    if "sparse_idx" in stored:
        step = step.reshape(*lead, T * D).scatter(-1, stored["sparse_idx"].long(), 0.0).reshape(*lead, T, D)
    return step.contiguous()
