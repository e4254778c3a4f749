"""Kind "prq": Quant VideoGen's progressive residual code (quant/qvg.py): `prq_stages` stages
each take the nearest of `prq_centroids` span centroids off (their indices stored per token when
there are several), then the symmetric residual with one FP8 scale per token and group. The
centroids are the span's state (codec.py: `fit_span_state`, `with_span_state`)."""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.codes.base import Kind
from calibrate.quant import affine, packing, qvg


def quantize(y: Tensor, spec, p, steps=None) -> tuple[Tensor, dict[str, Tensor]]:
    """Take each stage's nearest span centroid off, then the symmetric residual with FP8 scales."""
    dyn: dict[str, Tensor] = {}
    if spec.prq_stages:
        y, ids = qvg.smooth(y, _span_centroids(p))
        if spec.prq_centroids > 1:  # with one centroid every index is 0: nothing to store
            dyn["assign"] = qvg.pack_ids(ids.transpose(-1, -2), spec.prq_centroids)  # [B, stages, packed tokens]
    g = affine.group_view(y, spec.group_size or y.shape[-1])
    scale = qvg.residual_scale(g, p.bits)
    dyn["scale"] = scale
    return affine.ungroup(qvg.residual_codes(g, scale, p.bits)), dyn


def dequantize(codes: Tensor, dyn: dict[str, Tensor], spec, p, steps=None) -> Tensor:
    g = affine.group_view(codes, spec.group_size or codes.shape[-1])
    r = affine.ungroup(qvg.residual_values(g, dyn["scale"], p.bits))
    if not spec.prq_stages:
        return r
    cents = _span_centroids(p)
    if "assign" in dyn:
        ids = qvg.unpack_ids(dyn["assign"], spec.prq_centroids, r.shape[-2]).transpose(-1, -2).long()
    else:
        ids = torch.zeros(*r.shape[:-1], spec.prq_stages, dtype=torch.long, device=r.device)
    return qvg.unsmooth(r, cents, ids)


def _span_centroids(p) -> Tensor:
    if p.span_centroids_BSCD is None:
        raise ValueError("kind 'prq' codes a frame against its span's centroids: fit them with codec.fit_span_state "
                         "and pass them with codec.with_span_state")
    return p.span_centroids_BSCD


def code_nbytes(spec, b: int, B: int, T: int, D: int) -> int:
    """Packed codes, one FP8 scale per token and group, the stages' packed centroid indices (C > 1)."""
    n = B * T * packing.packed_nbytes(D, b) + B * T * (D // (spec.group_size or D))
    return n + (B * spec.prq_stages * qvg.ids_nbytes(T, spec.prq_centroids) if spec.prq_stages else 0)


def check(s, where: str) -> str | None:
    if s.prq_stages < 0:
        return f"{where}.prq_stages: {s.prq_stages} must be >= 0"
    if s.prq_stages and not 1 <= s.prq_centroids <= 256:
        return f"{where}.prq_centroids: {s.prq_centroids} not in [1, 256] (indices are stored as uint8)"
    if not s.prq_stages and s.prq_centroids:
        return f"{where}.prq_centroids: {s.prq_centroids} needs prq_stages >= 1"
    if s.prq_span_frames < 1:
        return f"{where}.prq_span_frames: {s.prq_span_frames} must be >= 1"
    if s.prq_kmeans_iters < 1:
        return f"{where}.prq_kmeans_iters: {s.prq_kmeans_iters} must be >= 1"
    if s.prq_deferred and not s.prq_stages:
        return f"{where}.prq_deferred: needs prq_stages >= 1 (a span state to defer)"
    return None


KIND = Kind("prq", quantize, dequantize, code_nbytes, check=check, uniform_step=True, per_token=True)
