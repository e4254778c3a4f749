"""The fitting objective: attention-output error with the history quantized, plus a temporal term.

Given one layer's recorded fp frames (q, k, v of every frame of a calibration rollout,
post-rotary) and candidate dequantized keys/values k^, v^ for the same frames, replay the
cache teacher-forced: the query of frame f attends to its own fresh K/V in full precision and
to the kept history (sink frames + the newest `window`) in its quantized form, exactly as the
runtime does. Per head:

    e_f   = o^_f - o_f                                      (attention-output error of frame f)
    rel   = sqrt( sum_f ||e_f||^2 / sum_f ||o_f||^2 )      (relative output error)
    tmp   = sqrt( mean_f ||e_f - e_{f-1}||^2 / mean_f ||o_f||^2 )   (frame-to-frame change)
    J     = rel + lambda_temporal * tmp

`rel` is what per-frame benchmarks would minimize; `tmp` penalizes error that jumps between
frames, which the eye sees as flicker (a steady error is a slightly different but stable
image). Heads are independent within a layer (a head's output depends only on its own K/V),
so candidates are scored per head in one batched pass.

Shape legend: B trajectories, H heads, F frames, T tokens per frame, D head_dim, N = F*T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from calibrate.cache import Rope, block_mask


@dataclass
class LayerTrace:
    """One layer's recorded fp frames: q, k (post-rotary), v as [B, H, F, T, D]; optionally the
    keys before the rotary encoding (`k_pre`) and the rotary angles of each frame [B, F, T, A]."""

    q: Tensor
    k: Tensor
    v: Tensor
    window: int
    sink_frames: int
    k_pre: Tensor | None = None
    angles: Tensor | None = None

    def rotate(self, k_pre_BHFTD: Tensor) -> Tensor:
        """Keys given before the rotary encoding, rotated as their frames were: [B, H, F, T, D]."""
        B, H, F, T, D = k_pre_BHFTD.shape
        rope = Rope(self.angles.reshape(B, F * T, -1))
        return rope.apply(k_pre_BHFTD.reshape(B, H, F * T, D)).reshape(B, H, F, T, D)

    @property
    def shape(self):
        return self.q.shape

    def masks(self) -> tuple[Tensor, Tensor]:
        """(visible [N, N], own-frame block diagonal [N, N]) for the cache's token policy."""
        B, H, F, T, D = self.q.shape
        visible = block_mask(F, T, self.window, self.sink_frames)
        own = block_mask(F, T, 1, 0)
        return visible, own


def _flat(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


def attention_outputs(trace: LayerTrace, k_hat: Tensor | None = None, v_hat: Tensor | None = None,
                      recent: tuple[int, Tensor | None, Tensor | None] | None = None,
                      sink: tuple[int, Tensor | None, Tensor | None] | None = None,
                      keyframe: tuple[int, Tensor | None, Tensor | None] | None = None,
                      shift: dict[str, Tensor] | None = None) -> Tensor:
    """Outputs [B, H, F, T, D] of every frame's queries over the kept history as the runtime stores it.

    Each (query frame f, key frame j) pair reads K/V in one precision class, in this priority
    (the runtime's): j == f -> the fresh fp K/V; f - j <= r -> "recent" = (r, k_r, v_r);
    j < s -> "sink" = (s, k_s, v_s); j % N == 0 -> "keyframe" = (N, k_n, v_n); otherwise
    "other" = (k_hat, v_hat). A None tensor means fp. Frame j of the trace is frame j of the
    rollout. `shift` = {class name: c [B, H, F, T]} subtracts c (per query token) from the
    logits of that class's keys: the key-noise logit correction as the runtime applies it.
    """
    B, H, F, T, D = trace.q.shape
    q, k, v = _flat(trace.q), _flat(trace.k), _flat(trace.v)
    visible, own = trace.masks()
    j = torch.arange(F).repeat_interleave(T).unsqueeze(0).expand(F * T, -1)  # key frame of each column
    classes = [("own", own, k, v)]
    taken = own.clone()
    if recent is not None and recent[0] > 0:
        m = block_mask(F, T, recent[0] + 1, 0) & ~taken
        classes.append(("recent", m, _flat(recent[1]), _flat(recent[2])))
        taken |= m
    if sink is not None and sink[0] > 0:
        m = (j < sink[0]) & ~taken
        classes.append(("sink", m, _flat(sink[1]), _flat(sink[2])))
        taken |= m
    if keyframe is not None and keyframe[0] > 0:
        m = (j % keyframe[0] == 0) & ~taken
        classes.append(("keyframe", m, _flat(keyframe[1]), _flat(keyframe[2])))
        taken |= m
    classes.append(("other", ~taken, _flat(k_hat), _flat(v_hat)))
    scale = 1.0 / math.sqrt(D)
    logits = torch.zeros(B, H, F * T, F * T, dtype=q.dtype)
    for name, mask, kc, _ in classes:
        class_logits = torch.einsum("bhnd,bhmd->bhnm", q, k if kc is None else kc) * scale
        if shift is not None and name in shift:
            class_logits = class_logits - shift[name].reshape(B, H, F * T, 1)
        logits = torch.where(mask, class_logits, logits)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    out = sum((probs * mask) @ (v if vc is None else vc) for _, mask, _, vc in classes)
    return out.reshape(B, H, F, T, D)


@dataclass
class HeadScores:
    rel: Tensor  # [H]
    temporal: Tensor  # [H]

    def objective(self, lambda_temporal: float) -> Tensor:
        return self.rel + lambda_temporal * self.temporal


def head_scores(reference: Tensor, candidate: Tensor) -> HeadScores:
    """Per-head relative error and temporal change of `candidate` vs `reference` ([B,H,F,T,D])."""
    err = (candidate - reference).double()
    ref2 = reference.double().pow(2).sum(dim=(0, 2, 3, 4))
    F = reference.shape[2]
    rel = (err.pow(2).sum(dim=(0, 2, 3, 4)) / ref2.clamp_min(1e-30)).sqrt()
    dt = (err[:, :, 1:] - err[:, :, :-1]).pow(2).sum(dim=(0, 2, 3, 4)) / max(F - 1, 1)
    temporal = (dt / (ref2 / F).clamp_min(1e-30)).sqrt()
    return HeadScores(rel.float(), temporal.float())
