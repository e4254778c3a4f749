"""Baselines and presets, each expressed as an ordinary recipe that the one runtime runs.

Every baseline is a point of the recipe's scheme space (recipe.py); only `kvquant2` and `qvg2`
need calibration data (K/V token samples from replay). TinyWorld stores 16 tokens per frame,
so token counts of the papers are expressed in whole frames; deviations are listed per
baseline and repeated in the recipe's `scheme.notes`.

- `fp16`: every frame stored in float16 (the memory reference).
- `naive2`: the brief's example: per-token symmetric 2-bit, group 64, scale = absmax / 2,
  codes clamp(round(x/scale), -2, 1). No sink, no full-precision window.
- `kivi2` / `kivi4` (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
  KV Cache"): K per-channel, V per-token (group 32), asymmetric min/max,
  scale = (max - min) / (2^b - 1), round half to even, full-precision residual of R = 128
  tokens = 8 frames. Deviation: KIVI groups keys per channel over G = 32 tokens; a frame has
  16, so key groups span one frame (finer groups, more parameter bytes: counted).
- `kvquant2` (Hooper et al., 2024, "KVQuant"): K per-channel with *calibrated* static ranges,
  V per-token; non-uniform 2-bit levels fitted on calibration data (per layer and head,
  k-means on normalized values); 1% dense-and-sparse outliers kept in float16; the first
  frame (attention sink) in float16. Deviations: keys are quantized post-rotary (TinyWorld's
  rotary angles come from camera poses that the cache seam does not see; storing them would
  cost more than the codes); levels are plain k-means (no Fisher weighting); outliers are the
  top 1% of |x - center| per frame rather than per-vector thresholds.
- `quarot2` (Ashkboos et al., 2024, "QuaRot"): randomized Hadamard rotation of K (with the
  query rotated alike: q.k unchanged) and of V (inverse on read), then asymmetric per-token
  2-bit with group = head_dim. No sink or window.
- `qvg2` (Xi et al., 2026, "Quant VideoGen"): semantic-aware smoothing (subtract the nearest
  k-means centroid per token, per head) plus 2-bit residual per token (group 32); the first
  frame and the newest frame in float16. Deviations: centroids are fitted once on
  calibration data instead of per chunk (16-token frames would spend more bytes on
  per-chunk centroids than on codes); one residual stage, not progressive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from calibrate.quant import codebook, rotation
from calibrate.recipe import ModelInfo, Recipe, TensorSpec, TokenPolicy, uniform_scheme

KIVI_RESIDUAL_TOKENS = 128


@dataclass
class KVSample:
    """A bounded sample of cached tokens from calibration rollouts: k/v [L, H, N, D]."""

    k_LHND: Tensor
    v_LHND: Tensor


def _fp16(info: ModelInfo, calib) -> Recipe:
    spec = TensorSpec(bits=16)
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    return Recipe(info, uniform_scheme("fp16", info.num_layers, spec, spec, pol, "float16 cache"), {})


def _naive2(info: ModelInfo, calib) -> Recipe:
    spec = TensorSpec(bits=2, symmetric=True, axis="token", group_size=min(64, info.head_dim))
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = "per-token symmetric 2-bit, group 64, scale=absmax/2 (the brief's example)"
    return Recipe(info, uniform_scheme("naive2", info.num_layers, spec, spec, pol, notes), {})


def _kivi(bits: int):
    def build(info: ModelInfo, calib) -> Recipe:
        k = TensorSpec(bits=bits, axis="channel")
        v = TensorSpec(bits=bits, axis="token", group_size=min(32, info.head_dim))
        recent = math.ceil(KIVI_RESIDUAL_TOKENS / info.tokens_per_frame)
        pol = TokenPolicy(sink_frames=0, recent_frames=recent, recent_bits=16)
        notes = (f"KIVI-{bits}: K per-channel, V per-token G=32, asymmetric min/max, fp16 residual of "
                 f"{KIVI_RESIDUAL_TOKENS} tokens = {recent} frames; key groups span one frame "
                 f"({info.tokens_per_frame} tokens) instead of 32 tokens")
        return Recipe(info, uniform_scheme(f"kivi{bits}", info.num_layers, k, v, pol, notes), {})

    return build


def _quarot2(info: ModelInfo, calib) -> Recipe:
    spec = TensorSpec(bits=2, axis="token", group_size=info.head_dim, rotation="hadamard")
    tensors = {}
    for i in range(info.num_layers):
        for j, kind in enumerate("kv"):
            tensors[f"layers.{i}.{kind}.rotation"] = torch.stack(
                [rotation.random_hadamard(info.head_dim, seed=1000 * i + 100 * j + h) for h in range(info.num_kv_heads)]
            )
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = "QuaRot: randomized Hadamard on K (q alike) and V (inverse on read), asymmetric per-token 2-bit, group=head_dim"
    return Recipe(info, uniform_scheme("quarot2", info.num_layers, spec, spec, pol, notes), tensors)


def _require(calib, name: str) -> "KVSample":
    if calib is None:
        raise ValueError(f"scheme '{name}' needs calibration data (K/V samples from replay)")
    return calib


def _kvquant2(info: ModelInfo, calib) -> Recipe:
    calib = _require(calib, "kvquant2")
    k = TensorSpec(bits=2, kind="codebook", axis="channel", static=True, sparse_fraction=0.01)
    v = TensorSpec(bits=2, kind="codebook", axis="token", group_size=info.head_dim, sparse_fraction=0.01)
    tensors = {}
    for i in range(info.num_layers):
        keys = calib.k_LHND[i].float()  # [H, N, D]
        lo = torch.quantile(keys, 0.01, dim=1)
        hi = torch.quantile(keys, 0.99, dim=1)
        zero, scale = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-6)
        tensors[f"layers.{i}.k.zero_point"] = zero
        tensors[f"layers.{i}.k.scale"] = scale
        norm_k = ((keys - zero.unsqueeze(1)) / scale.unsqueeze(1)).clamp(-1, 1)
        tensors[f"layers.{i}.k.codebook"] = torch.stack([codebook.fit_levels(norm_k[h].flatten(), 2) for h in range(info.num_kv_heads)])
        vals = calib.v_LHND[i].float()
        norm_v = vals / vals.abs().amax(-1, keepdim=True).clamp_min(1e-8)
        tensors[f"layers.{i}.v.codebook"] = torch.stack([codebook.fit_levels(norm_v[h].flatten(), 2) for h in range(info.num_kv_heads)])
    pol = TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=0)
    notes = ("KVQuant-2: static calibrated per-channel K ranges (1st-99th percentile), per-token V, non-uniform 2-bit "
             "levels (k-means per layer/head), 1% dense-and-sparse outliers in fp16, sink frame fp16; "
             "keys post-rotary (pose rotary not visible to the cache)")
    return Recipe(info, uniform_scheme("kvquant2", info.num_layers, k, v, pol, notes), tensors)


QVG_CENTROIDS = 16


def _kmeans(x_ND: Tensor, k: int, seed: int, iters: int = 25) -> Tensor:
    """Deterministic k-means (k-means++-free: init from a seeded random subset)."""
    g = torch.Generator().manual_seed(seed)
    centers = x_ND[torch.randperm(x_ND.shape[0], generator=g)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x_ND, centers).argmin(-1)
        for c in range(k):
            members = x_ND[assign == c]
            if len(members):
                centers[c] = members.mean(0)
    return centers


def _qvg2(info: ModelInfo, calib) -> Recipe:
    calib = _require(calib, "qvg2")
    spec = TensorSpec(bits=2, axis="token", group_size=min(32, info.head_dim), centroids=QVG_CENTROIDS)
    tensors = {}
    for i in range(info.num_layers):
        for j, (kind, sample) in enumerate((("k", calib.k_LHND), ("v", calib.v_LHND))):
            tensors[f"layers.{i}.{kind}.centroids"] = torch.stack(
                [_kmeans(sample[i, h].float(), QVG_CENTROIDS, seed=1000 * i + 100 * j + h) for h in range(info.num_kv_heads)]
            )
    pol = TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=1, recent_bits=16)
    notes = (f"QVG-2: k-means centroid smoothing ({QVG_CENTROIDS} static centroids per head, fitted on calibration "
             "K/V) + 2-bit per-token residual G=32; sink and newest frame fp16; one residual stage")
    return Recipe(info, uniform_scheme("qvg2", info.num_layers, spec, spec, pol, notes), tensors)


BUILDERS = {
    "fp16": _fp16,
    "naive2": _naive2,
    "kivi2": _kivi(2),
    "kivi4": _kivi(4),
    "kvquant2": _kvquant2,
    "quarot2": _quarot2,
    "qvg2": _qvg2,
}
BASELINES = tuple(BUILDERS)


def build_baseline(name: str, info: ModelInfo, calib: KVSample | None = None) -> Recipe:
    """The recipe of baseline `name` for the model `info`."""
    if name not in BUILDERS:
        raise ValueError(f"unknown scheme '{name}'; baselines are {', '.join(BUILDERS)} (or give a recipe path)")
    recipe = BUILDERS[name](info, calib)
    recipe.metadata.setdefault("calibration", "{}")
    return recipe
