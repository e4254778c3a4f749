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

from calibrate.cache import Rope
from calibrate.quant.blockattn import OnlineSoftmax


OBJECTIVE_BLOCK_ELEMENTS = 1 << 24  # logits one block of (query rows x key columns) may hold


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


def _flat(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


@dataclass(frozen=True)
class _Class:
    """A precision class of (query frame, key frame) pairs and the K/V the runtime reads for it."""

    name: str
    k: Tensor | None  # [B, H, F, T, D]; None: the trace's fp tensor
    v: Tensor | None
    param: int  # recent: r frames; sink: s frames; keyframe: interval N; own/other: unused

    def takes(self, f_R: Tensor, j_C: Tensor) -> Tensor:
        """[R, C] bool: the pairs (query frame f, key frame j) this class would read (before priority)."""
        f, j = f_R.unsqueeze(1), j_C.unsqueeze(0)
        if self.name == "own":
            return j == f
        if self.name == "recent":
            return (f - j >= 1) & (f - j <= self.param)
        if self.name == "sink":
            return (j < self.param).expand(len(f_R), -1)
        if self.name == "keyframe":
            return (j % self.param == 0).expand(len(f_R), -1)
        return torch.ones(len(f_R), len(j_C), dtype=torch.bool, device=f_R.device)


def _classes(recent, sink, keyframe, k_hat, v_hat) -> list[_Class]:
    """The classes in the runtime's priority order: own, recent, sink, keyframe, other."""
    out = [_Class("own", None, None, 0)]
    for name, c in (("recent", recent), ("sink", sink), ("keyframe", keyframe)):
        if c is not None and c[0] > 0:
            out.append(_Class(name, c[1], c[2], c[0]))
    out.append(_Class("other", k_hat, v_hat, 0))
    return out


def visible_frames(f: Tensor, j: Tensor, window: int, sink_frames: int) -> Tensor:
    """[R, C] bool: key frame j is held when query frame f attends (cache.block_mask's rule)."""
    f, j = f.unsqueeze(1), j.unsqueeze(0)
    return (j <= f) & ((j > f - window) | (j < sink_frames))


def query_frame_blocks(F: int, T: int, heads: int, window: int, sink_frames: int, budget: int) -> list[range]:
    """Consecutive query frames per block, as many as keep (their rows) x (the key frames any of
    them sees) x `heads` (batch x heads) logits within `budget`; at least one frame per block."""
    blocks, f0 = [], 0
    while f0 < F:
        n = 1
        while f0 + n < F and heads * (n + 1) * T * _num_keys(f0, f0 + n + 1, window, sink_frames) * T <= budget:
            n += 1
        blocks.append(range(f0, f0 + n))
        f0 += n
    return blocks


def _num_keys(f0: int, f1: int, window: int, sink_frames: int) -> int:
    return len(_key_frames(range(f0, f1), window, sink_frames))


def _key_frames(frames: range, window: int, sink_frames: int) -> list[int]:
    """Key frames some query frame of `frames` sees: the sinks and the window before the last, in order."""
    lo = max(frames.start - window + 1, 0)
    return sorted(set(range(min(sink_frames, frames.stop))) | set(range(lo, frames.stop)))


def attention_outputs(trace: LayerTrace, k_hat: Tensor | None = None, v_hat: Tensor | None = None,
                      recent: tuple[int, Tensor | None, Tensor | None] | None = None,
                      sink: tuple[int, Tensor | None, Tensor | None] | None = None,
                      keyframe: tuple[int, Tensor | None, Tensor | None] | None = None,
                      shift: dict[str, Tensor] | None = None, budget: int | None = None) -> Tensor:
    """Outputs [B, H, F, T, D] of every frame's queries over the kept history as the runtime stores it.

    Each (query frame f, key frame j) pair reads K/V in one precision class, in this priority
    (the runtime's): j == f -> the fresh fp K/V; f - j <= r -> "recent" = (r, k_r, v_r);
    j < s -> "sink" = (s, k_s, v_s); j % N == 0 -> "keyframe" = (N, k_n, v_n); otherwise
    "other" = (k_hat, v_hat). A None tensor means fp. Frame j of the trace is frame j of the
    rollout. `shift` = {class name: c [B, H, F, T]} subtracts c (per query token) from the
    logits of that class's keys: the key-noise logit correction as the runtime applies it.

    Streaming: query frames go a block at a time over the key frames they see (sinks + window),
    so at most `budget` logits (default `OBJECTIVE_BLOCK_ELEMENTS`) exist at once, never
    [F*T, F*T]. A block of several frames masks each precision class as the dense computation
    did (one block covering every frame is that computation, bit for bit); a block of one frame
    gathers each key frame from its class, as the runtime reads its cache, and attends once, its
    keys a block at a time through the online softmax (quant/blockattn.py) when they exceed the
    budget.
    """
    B, H, F, T, D = trace.q.shape
    budget = budget or OBJECTIVE_BLOCK_ELEMENTS
    classes = _classes(recent, sink, keyframe, k_hat, v_hat)
    out = trace.q.new_empty(B, H, F, T, D)
    for frames in query_frame_blocks(F, T, B * H, trace.window, trace.sink_frames, budget):
        keys = _key_frames(frames, trace.window, trace.sink_frames)
        block = _one_frame if len(frames) == 1 else _dense
        out[:, :, frames.start:frames.stop] = block(trace, classes, frames, keys, shift, budget)
    return out


def _select(x: Tensor, frames) -> Tensor:
    """x [B, H, F, T, D] at `frames` (a range or list of frame indices), flattened to [B, H, n*T, D]."""
    if isinstance(frames, range) and frames.step == 1:
        part = x[:, :, frames.start:frames.stop]
    elif list(frames) == list(range(frames[0], frames[-1] + 1)):
        part = x[:, :, frames[0]:frames[-1] + 1]
    else:
        part = x.index_select(2, torch.tensor(list(frames), device=x.device))
    return _flat(part)


def _class_masks(trace: LayerTrace, classes: list[_Class], frames, keys) -> tuple[Tensor, list[Tensor]]:
    """(visible [R*T, C*T], each class's pairs [R*T, C*T] after priority), token level."""
    T = trace.q.shape[3]
    f = torch.tensor(list(frames), device=trace.q.device)
    j = torch.tensor(list(keys), device=trace.q.device)
    tokens = lambda m: m.repeat_interleave(T, 0).repeat_interleave(T, 1)
    taken = torch.zeros(len(f), len(j), dtype=torch.bool, device=f.device)
    masks = []
    for c in classes:
        m = c.takes(f, j) & ~taken
        taken |= m
        masks.append(tokens(m))
    return tokens(visible_frames(f, j, trace.window, trace.sink_frames)), masks


def _dense(trace: LayerTrace, classes: list[_Class], frames, keys, shift, budget: int) -> Tensor:
    """Several query frames: the softmax over every key the block's rows see, each class by mask."""
    B, H, F, T, D = trace.q.shape
    q = _select(trace.q, frames)
    visible, masks = _class_masks(trace, classes, frames, keys)
    logits = torch.zeros(B, H, q.shape[2], visible.shape[1], dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(D)
    for c, mask in zip(classes, masks):
        class_logits = torch.einsum("bhnd,bhmd->bhnm", q, _select(trace.k if c.k is None else c.k, keys)) * scale
        if shift is not None and c.name in shift:
            class_logits = class_logits - _select(shift[c.name].unsqueeze(-1), frames).reshape(B, H, -1, 1)
        logits = torch.where(mask, class_logits, logits)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    out = sum((probs * mask) @ _select(trace.v if c.v is None else c.v, keys) for c, mask in zip(classes, masks))
    return out.reshape(B, H, len(frames), T, D)


def _one_frame(trace: LayerTrace, classes: list[_Class], frames, keys, shift, budget: int) -> Tensor:
    """One query frame: every key frame it sees read from its class (the runtime's read), one
    attention; key frames a block at a time through the online softmax beyond `budget` logits."""
    B, H, F, T, D = trace.q.shape
    f = frames.start
    f_t, j_t = torch.tensor([f]), torch.tensor(keys)
    taken = torch.zeros(1, len(keys), dtype=torch.bool)
    owner = [None] * len(keys)  # the class each key frame is read from
    for c in classes:
        m = c.takes(f_t, j_t) & ~taken
        taken |= m
        for i in m[0].nonzero().flatten().tolist():
            owner[i] = c
    read = lambda which: torch.stack([(getattr(c, which) if getattr(c, which) is not None else getattr(trace, which))
                                      [:, :, j] for j, c in zip(keys, owner)], dim=2).flatten(2, 3)
    k, v = read("k"), read("v")
    bias = None
    if shift is not None and any(c.name in shift for c in owner):
        zero = trace.q.new_zeros(B, H, T)
        bias = -torch.stack([shift[c.name][:, :, f] if c.name in shift else zero for c in owner], dim=-1)
        bias = bias.unsqueeze(-1).expand(B, H, T, len(keys), T).flatten(3, 4)
    acc = OnlineSoftmax(trace.q[:, :, f], key_block=max(budget // (B * H * T), 1))
    acc.add(k, v, bias)
    return acc.result().unsqueeze(2)


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
