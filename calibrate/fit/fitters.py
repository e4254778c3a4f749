"""Fitters: choose each layer's quantization of K and V on the teacher-forced objective.

For every layer and tensor (K, V) the fitter searches, at 2 bits:

- rotation: none, randomized Hadamard, or a learned orthogonal rotation in closed form (the
  eigenvectors of the channel Gram matrix from the statistics: PCA/KLT, which decorrelates
  channels so per-channel ranges fit the data's principal axes);
- granularity: static per channel (ranges from calibration, no per-frame parameters: zero
  overhead) or dynamic per token (group = head_dim, float16 scale and zero point per token);
- clipping ratio per head from `fit.clip_grid` (1.0 = min/max is always a candidate, so the
  fitted clip is never worse than min/max on the objective).

Then a greedy allocator spends the rest of `fit.budget_bits` (average bits per cached element,
every per-frame overhead counted from the recipe's byte prediction) on the upgrades with the
best objective gain per byte: +1/+2 bits for one (layer, head, tensor), or outlier channels
(the channels with the largest range after rotation, kept in float16) for one (layer, tensor).
Every choice is recorded with its reason and scores in the recipe's `fit` metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from calibrate.codec import fake_quant_heads
from calibrate.fit.objective import LayerTrace, attention_outputs, head_scores
from calibrate.quant import rotation as rot
from calibrate.recipe import TensorSpec


@dataclass
class Choice:
    """The fitted quantization of one tensor (K or V) of one layer."""

    spec: TensorSpec
    tensors: dict[str, Tensor]  # role -> [H, ...]
    score: float  # objective (sum over heads) at this choice
    clip_H: Tensor  # the fitted clipping ratio per head (static ranges are re-cut from it per width)
    reasons: dict = field(default_factory=dict)


def rotations(kind: str, layer: int, gram_HDD: Tensor, names: list[str]) -> dict[str, Tensor | None]:
    H, D, _ = gram_HDD.shape
    out: dict[str, Tensor | None] = {}
    for name in names:
        if name == "none":
            out[name] = None
        elif name == "hadamard":
            out[name] = torch.stack([rot.random_hadamard(D, seed=7919 * layer + 31 * h + (kind == "v")) for h in range(H)])
        elif name == "learned":
            # PCA: columns = eigenvectors of the (uncentered) channel second-moment matrix, largest first
            _, evecs = torch.linalg.eigh(gram_HDD.double())
            out[name] = evecs.flip(-1).float().contiguous()
    return out


def static_ranges(x_HND: Tensor, rotation_HDD: Tensor | None, clip_H: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Per-channel asymmetric (scale, zero_point) [H, D] from calibration samples, clipped per head."""
    y = x_HND if rotation_HDD is None else x_HND @ rotation_HDD
    lo, hi = y.amin(1), y.amax(1)
    shrink = (1 - clip_H.unsqueeze(1)) * (hi - lo) / 2
    lo, hi = lo + shrink, hi - shrink
    return ((hi - lo) / (2**bits - 1)).clamp_min(1e-6), lo


def outlier_channels(x_HND: Tensor, rotation_HDD: Tensor | None, n: int) -> Tensor:
    """The n channels per head with the largest absmax relative to the head's median (after rotation)."""
    y = x_HND if rotation_HDD is None else x_HND @ rotation_HDD
    absmax = y.abs().amax(1)
    ratio = absmax / absmax.median(dim=1, keepdim=True).values.clamp_min(1e-8)
    return ratio.topk(n, dim=1).indices.sort(dim=1).values.to(torch.int64)


def _candidate(granularity: str, rotation_name: str, rotation_HDD, clip_H: Tensor, sample_HND: Tensor, D: int,
               bits: int = 2) -> tuple[TensorSpec, dict[str, Tensor]]:
    tensors: dict[str, Tensor] = {}
    if rotation_HDD is not None:
        tensors["rotation"] = rotation_HDD
    if granularity == "static":
        spec = TensorSpec(bits=bits, axis="channel", static=True, rotation=rotation_name)
        scale, zero = static_ranges(sample_HND, rotation_HDD, clip_H, bits)
        tensors.update(scale=scale, zero_point=zero)
    else:
        spec = TensorSpec(bits=bits, axis="token", group_size=D, rotation=rotation_name)
        tensors["clip"] = clip_H.clone()
    return spec, tensors


def fit_tensor(kind: str, layer: int, trace: LayerTrace, reference: Tensor, other_hat: Tensor | None,
               sample_HND: Tensor, gram_HDD: Tensor, rotation_names: list[str], clip_grid: list[float],
               lambda_temporal: float) -> Choice:
    """Best rotation x granularity x per-head clip for `kind` of `layer` at 2 bits."""
    B, H, F, T, D = trace.q.shape
    x = trace.k if kind == "k" else trace.v
    granularities = ["static", "token"]
    best: Choice | None = None
    table = {}
    for rname, R in rotations(kind, layer, gram_HDD, rotation_names).items():
        for gran in granularities:
            per_clip = []
            for c in clip_grid:
                clip_H = torch.full((H,), float(c))
                spec, tensors = _candidate(gran, rname, R, clip_H, sample_HND, D)
                x_hat = fake_quant_heads(x, spec, tensors, [2] * H)
                out = attention_outputs(trace, *((x_hat, other_hat) if kind == "k" else (other_hat, x_hat)))
                per_clip.append(head_scores(reference, out).objective(lambda_temporal))
            scores_CH = torch.stack(per_clip)
            idx_H = scores_CH.argmin(0)
            clip_H = torch.tensor([clip_grid[i] for i in idx_H.tolist()])
            score = float(scores_CH.gather(0, idx_H.unsqueeze(0)).sum())
            table[f"{rname}/{gran}"] = round(score, 6)
            table[f"{rname}/{gran}/minmax"] = round(float(scores_CH[clip_grid.index(1.0)].sum()), 6) if 1.0 in clip_grid else None
            if best is None or score < best.score:
                spec, tensors = _candidate(gran, rname, R, clip_H, sample_HND, D)
                best = Choice(spec, tensors, score, clip_H,
                              {"rotation": rname, "granularity": gran, "clip": clip_H.tolist()})
    assert best is not None
    best.reasons["why"] = "lowest teacher-forced objective over the candidates (rotation/granularity: score)"
    best.reasons["candidates"] = table
    return best


def fitted_spec(spec: TensorSpec, head_bits: list[int], outliers: int = 0, sparse_fraction: float = 0.0,
                comp_rank: int = 0) -> TensorSpec:
    """The choice's spec with per-head bits, `outliers` float16 channels per head, a dense-and-sparse
    share and a compensator rank: all the memory model needs to count its bytes."""
    spec = replace(spec, bits=min(head_bits), head_bits=list(head_bits) if len(set(head_bits)) > 1 else None,
                   sparse_fraction=sparse_fraction, comp_rank=comp_rank)
    return replace(spec, outliers=outliers) if outliers else spec


def with_bits(choice: Choice, sample_HND: Tensor, head_bits: list[int], outliers: Tensor | None,
              sparse_fraction: float = 0.0, comp: tuple[Tensor, Tensor] | None = None,
              logit_var: Tensor | None = None) -> tuple[TensorSpec, dict[str, Tensor]]:
    """The choice with per-head bits (static ranges recomputed per width), outlier channels,
    dense-and-sparse outliers, a low-rank compensator (down [H, D, r], up [H, r, D]) and the
    key-noise logit correction (role `logit_bias` [H, D], keys only)."""
    spec = fitted_spec(choice.spec, head_bits, 0 if outliers is None else outliers.shape[1], sparse_fraction,
                       0 if comp is None else comp[0].shape[-1])
    tensors = dict(choice.tensors)
    if spec.axis == "channel" and spec.static:
        clip_H = choice.clip_H
        parts = [static_ranges(sample_HND[h : h + 1], None if "rotation" not in tensors else tensors["rotation"][h : h + 1],
                               clip_H[h : h + 1], b) for h, b in enumerate(head_bits)]
        tensors["scale"] = torch.cat([p[0] for p in parts])
        tensors["zero_point"] = torch.cat([p[1] for p in parts])
    if outliers is not None:
        tensors["outlier_channels"] = outliers
    if comp is not None:
        tensors["comp_down"], tensors["comp_up"] = comp
    if logit_var is not None:
        tensors["logit_bias"] = logit_var
    return spec, tensors


__all__ = ["Choice", "fit_tensor", "fitted_spec", "with_bits", "outlier_channels"]
