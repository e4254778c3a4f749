"""`codec.py`'s per-frame code for several heads at once (one width, one clip), for the fast runtime.

`codec.encode`/`decode` take one head: x [B, T, D] and that head's `HeadParams`. A runtime
that stores every head of a frame, and decodes every head of many frames, each step, runs the
same arithmetic with a head axis: x [B, Hg, T, D] (encode) or [B, Hg, J, T, D] (decode), the
static parameters stacked over the Hg heads of a *group* (heads stored at the same width with
the same clip ratio, so the float32 steps are those of one head, and the codes equal
`codec.encode`'s exactly; tests/test_fastcache.py holds them equal). The steps are the module
docstring's of codec.py: rotation, centroids, outlier channels, dense-and-sparse, quantize
(codec's own functions, which broadcast: per-head level lookups for the codebook and turbo kinds,
prq's package functions with the heads folded into their batch axis), pack; and backwards.

Stored tensors keep codec.encode's names and dtypes with the head axis after the batch:
`codes` [B, Hg, T, ceil(D/8) b], `p_scale`/`p_zero` float16, `assign` uint8, `outliers`
float16, `sparse_idx`/`sparse_val`, or `fp16` at 16 bits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from calibrate import codec
from calibrate.codes import FP, KINDS
from calibrate.codes.uniform import channel_quantize
from calibrate.quant import affine, codebook, ordered, packing, qvg, turbo
from calibrate.scheme_spec import TensorSpec


def _matmul_heads(x: Tensor, m_HKN: Tensor) -> Tensor:
    """ordered.matmul_heads for x [B, Hg, ..., K] of any rank (the head axis second)."""
    B, Hg, K = x.shape[0], x.shape[1], x.shape[-1]
    out = ordered.matmul_heads(x.reshape(B, Hg, -1, K), m_HKN)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class GroupCodec:
    """The code of `heads` (all stored at `bits`) of one tensor of one layer."""

    def __init__(self, spec: TensorSpec, tensors: dict, heads: list[int], bits: int, D: int, device):
        self.spec, self.heads, self.bits, self.D = spec, heads, bits, D
        per = [codec.head_params(spec, tensors, h, bits) for h in heads]
        self.p = per[0]
        stack = lambda name: None if getattr(per[0], name) is None else torch.stack([getattr(q, name) for q in per]).to(device)
        self.rotation = stack("rotation_DD")
        self.centroids = stack("centroids_CD")
        self.outlier_idx = stack("outlier_channels_n")
        self.kind = KINDS[spec.kind]
        # kinds with a table of levels (codebook, turbo): their steps with one row (and one QJL sketch) per head
        table, self.qjl = (stack(self.kind.table) if self.kind.table else None), stack("qjl_MD")
        self.steps = None if table is None else turbo.Steps(
            lambda u: self._nearest(u, table), lambda c: self._levels_at(c, table),
            lambda r: turbo.qjl_signs(r, self.qjl, _matmul_heads), lambda z, g: turbo.qjl_values(z, g, self.qjl, _matmul_heads))
        self.comp = (stack("comp_down_DR"), stack("comp_up_RD"))
        scale, zero = stack("scale_D"), stack("zero_D")
        # parameters broadcast over [B, Hg, T, D] (encode) and [B, Hg, J, T, D] (decode)
        self.enc = replace(self.p, scale_D=None if scale is None else scale[:, None], zero_D=None if zero is None else zero[:, None],
                           rotation_DD=None, centroids_CD=None, outlier_channels_n=None, comp_down_DR=None, comp_up_RD=None)
        self.dec = replace(self.enc, scale_D=None if scale is None else scale[:, None, None],
                           zero_D=None if zero is None else zero[:, None, None])

    # ---- encode: x [B, Hg, T, D] -> stored tensors [B, Hg, ...] ---------------------------------------
    def encode(self, x: Tensor, span_state: Tensor | None = None, stats: Tensor | None = None) -> dict[str, Tensor]:
        """Stored tensors of x; kind prq with stages codes against `span_state` [B, Hg, stages, C, D]
        (the span's centroids, `fit_span_state`); kind uniform on a dynamic channel axis may be
        given the whole frame's ranges (`channel_stats`) and x a block of its tokens."""
        if self.bits >= 16:
            return {"fp16": x.to(FP)}
        spec, p = self.spec, self.enc
        y, side = self._prepare(x)
        if stats is not None:
            codes, dyn = channel_quantize(y, spec, p, stats)
        elif codec.span_of(spec, 0) is not None:  # prq: the package's functions take one batch axis
            B, Hg, T, D = y.shape
            codes, dyn = self.kind.quantize(y.reshape(B * Hg, T, D), spec, self._with_state(span_state))
            codes = codes.view(B, Hg, T, D)
            dyn = {k: v.reshape(B, Hg, *v.shape[1:]) for k, v in dyn.items()}
        else:
            codes, dyn = self.kind.quantize(y, spec, p, self.steps)
        stored = {"codes": packing.pack(codes, self.bits)}
        stored.update({f"p_{k}": v for k, v in dyn.items()})
        stored.update(side)
        return stored

    def channel_stats(self, x: Tensor) -> Tensor:
        """affine.range_stats of x's tokens after steps 1-4 (merge blocks with torch.maximum)."""
        return affine.range_stats(self._prepare(x)[0], symmetric=self.spec.symmetric, reduce_dims=(-2,))

    def fit_span_state(self, x: Tensor) -> Tensor:
        """codec.fit_span_state for every head of the group: x [B, Hg, T, D] -> [B, Hg, stages, C, D] float16.
        One k-means per head over the batch, the reference's own calls."""
        y, _ = self._prepare(x)
        spec = self.spec
        return torch.stack([qvg.fit_centroids(y[:, h], spec.prq_stages, spec.prq_centroids, spec.prq_kmeans_iters)
                            for h in range(y.shape[1])], dim=1)

    def _with_state(self, state: Tensor | None) -> codec.HeadParams:
        """The group's parameters with a span state [..., stages, C, D] flattened to one batch axis."""
        if state is None:
            raise ValueError("kind 'prq' codes a frame against its span's centroids: none given")
        return replace(self.enc, span_centroids_BSCD=state.reshape(-1, *state.shape[-3:]))

    def _prepare(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """codec._prepare for the group (steps 1-4): y [B, Hg, T, D] and the side tensors to store."""
        spec, p = self.spec, self.enc
        y = x.float()
        side: dict[str, Tensor] = {}
        B, Hg, T, D = y.shape
        if self.rotation is not None:  # the fixed-order product of codec.py: the same codes, bit for bit
            y = ordered.matmul_heads(y, self.rotation)
        if self.centroids is not None:
            assign = ordered.sq_distances_heads(y, self.centroids).argmin(-1)  # ties to the lowest index
            side["assign"] = assign.to(torch.uint8)
            y = y - self._centroid(assign)
        if self.outlier_idx is not None:
            idx = self.outlier_idx[None, :, None, :].expand(B, Hg, T, -1)
            side["outliers"] = y.gather(-1, idx).to(FP)
            y = y.scatter(-1, idx, codec._center(spec, p, y).gather(-1, idx))
        if spec.sparse_fraction > 0:
            k = max(1, round(spec.sparse_fraction * T * D))
            center = codec._center(spec, p, y).reshape(B, Hg, T * D)
            flat = y.reshape(B, Hg, T * D)
            idx = codec.sparse_positions((flat - center).abs().reshape(B * Hg, T * D), k).reshape(B, Hg, k)
            side["sparse_idx"] = idx.to(torch.int16 if T * D < 2**15 else torch.int32)
            side["sparse_val"] = flat.gather(-1, idx).to(FP)
            y = flat.scatter(-1, idx, center.gather(-1, idx)).reshape(B, Hg, T, D)
        return y, side

    def _centroid(self, assign: Tensor) -> Tensor:
        """The centroid of each token: assign [B, Hg, ...] -> [B, Hg, ..., D]."""
        heads = torch.arange(len(self.heads), device=assign.device).view(1, -1, *([1] * (assign.dim() - 2)))
        return self.centroids[heads, assign.long()]

    def key_steps(self, stored: dict[str, Tensor], T: int) -> Tensor:
        """codec.key_steps with a head axis: the grid step [B, Hg, J, T, D] of every stored element of
        stored tensors [B, Hg, J, ...] (T tokens each; 0 where exact), for the Jensen correction."""
        idx = None if self.outlier_idx is None else self.outlier_idx[None, :, None, None, :]
        return codec.key_steps(stored, self.spec, self.dec, T, self.D, outlier_idx=idx)

    @staticmethod
    def _levels_at(codes: Tensor, levels: Tensor) -> Tensor:
        """codebook.decode per head: codes [B, Hg, ...] -> each head's `levels` [Hg, L] at them."""
        B, Hg = codes.shape[:2]
        flat = codes.transpose(0, 1).reshape(Hg, -1).long()
        return levels.gather(-1, flat).reshape(Hg, B, *codes.shape[2:]).transpose(0, 1)

    @staticmethod
    def _nearest(u: Tensor, levels: Tensor) -> Tensor:
        """codebook.nearest_level per head: u [B, Hg, ...] in the normalized domain -> uint8 codes."""
        B, Hg = u.shape[:2]
        x = u.transpose(0, 1).reshape(Hg, -1).contiguous()
        codes = codebook.nearest_rows(x, levels)
        return codes.reshape(Hg, B, *u.shape[2:]).transpose(0, 1)

    # ---- decode: stored tensors [B, Hg, J, ...] -> x [B, Hg, J, T, D] ---------------------------------
    def decode(self, stored: dict[str, Tensor], T: int, span_state: Tensor | None = None) -> Tensor:
        """x [B, Hg, J, T, D] of stored tensors [B, Hg, J, ...]; kind prq with stages takes each
        frame's span state [B, Hg, J, stages, C, D]."""
        if self.bits >= 16:
            return stored["fp16"].float()
        spec, p, D = self.spec, self.dec, self.D
        codes = packing.unpack(stored["codes"], self.bits, D)
        dyn = {k[2:]: v for k, v in stored.items() if k.startswith("p_")}
        if codec.span_of(spec, 0) is not None:
            lead = codes.shape[:3]
            flat = lambda t: t.reshape(-1, *t.shape[3:])
            y = self.kind.dequantize(flat(codes), {k: flat(v) for k, v in dyn.items()}, spec, self._with_state(span_state))
            y = y.view(*lead, *y.shape[1:])
        else:
            y = self.kind.dequantize(codes, dyn, spec, p, self.steps)
        B, Hg, J = y.shape[:3]
        if "sparse_val" in stored:
            y = y.reshape(B, Hg, J, T * D).scatter(-1, stored["sparse_idx"].long(), stored["sparse_val"].float())
            y = y.reshape(B, Hg, J, T, D)
        if "outliers" in stored:
            idx = self.outlier_idx[None, :, None, None, :].expand(B, Hg, J, T, -1)
            y = y.scatter(-1, idx, stored["outliers"].float())
        if "assign" in stored:
            y = y + self._centroid(stored["assign"])
        down, up = self.comp
        if down is not None:
            y = y + (y @ down[:, None]) @ up[:, None]
        if self.rotation is not None:
            y = y @ self.rotation.transpose(-1, -2)[:, None]
        return y
