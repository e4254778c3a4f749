"""Baselines and presets, each expressed as an ordinary recipe that the one runtime runs.

Every baseline is a point of the recipe's scheme space (recipe.py); only `kvquant2` and
`qvg2_static` need calibration data (K/V token samples from replay, `CALIBRATED`). TinyWorld
stores 16 tokens per frame, so token counts of the papers are expressed in whole frames;
deviations are listed per baseline and repeated in the recipe's `scheme.notes`. Bits/element
below are at steady state (window 16 + 1 sink frame, every byte counted: memory.py).

Arithmetic, for every baseline: the exact float32 rules of recipes/FORMAT.md ("Arithmetic"), which
a paper's own code does not follow to the bit: dynamic scales and minima (zero points) are
rounded to float16 *before* the codes are computed from them (the papers compute codes from the
unrounded values and store float16, or run in the model's float16/bf16); a zero or constant group
gets the scale floor 2^-24 instead of a division by zero or an epsilon; rotations, norms and
distances are fixed-order (halving-tree) float32 sums instead of BLAS products; every tie
(nearest level, nearest centroid, sparse outliers) goes to the lowest index; a frame leaving the
float16 recent window is coded from its float16 copy, not from the model's float32 values. Each
moves a value by at most an ulp or a code at a rounding boundary.

- `fp16`: every frame stored in float16 (the memory reference).
- `naive2`: the brief's example: per-token symmetric 2-bit, group 64, scale = absmax / 2,
  codes clamp(round(x/scale), -2, 1). No sink, no full-precision window. Deviations: the scale
  is rounded to float16 before the codes are computed (the brief divides by the float32 scale),
  round half to even, and an all-zero group stores scale 2^-24 (code 2, decoded 0).
- `kivi2` / `kivi4` (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
  KV Cache"): K per-channel, V per-token (group 32), asymmetric min/max,
  scale = (max - min) / (2^b - 1), round half to even, full-precision residual of R = 128
  tokens = 8 frames. Deviations: KIVI groups keys per channel over G = 32 tokens; a frame has
  16, so key groups span one frame (finer groups, more parameter bytes: counted). KIVI's key
  residual is a block buffer: 0-127 full-precision tokens, quantized 128 at a time once full;
  here keys, like values, keep a *sliding* float16 window of the newest 8 frames, which
  includes the frame just appended (so 7 earlier frames plus the fresh one; the fresh frame's
  own exact K/V are what it attends to anyway). A frame leaving the window is quantized from
  its float16 copy (not the model's values), with scale and minimum rounded to float16 before
  its codes are computed (KIVI stores float16 parameters but codes against the unrounded
  ones). 9.38 bits/element: the paper's row, not at our memory (`kivi2_lowmem` is).
- `kvquant2` (Hooper et al., 2024, "KVQuant"): K per-channel with *calibrated* static ranges,
  V per-token; non-uniform 2-bit levels fitted on calibration data (per layer and head,
  k-means on normalized values); 1% dense-and-sparse outliers kept in float16; the first
  frame (attention sink) in float16. Deviations: keys are quantized post-rotary (TinyWorld's
  rotary angles come from camera poses that the cache seam does not see; storing them would
  cost more than the codes); levels are plain k-means (no Fisher weighting); outliers are the
  top 1% of |x - center| per frame rather than per-vector thresholds, ties to the lowest
  position; values are clamped to [-1, 1] before the nearest level is chosen, and a fitted
  level outside [-1, 1] is still chosen where it is the nearest to a clamped value.
- `quarot2` (Ashkboos et al., 2024, "QuaRot"): randomized Hadamard rotation of K (with the
  query rotated alike: q.k unchanged) and of V (inverse on read), then asymmetric per-token
  2-bit with group = head_dim. No sink or window.
- `qvg2` (Xi et al., 2026, "Quant VideoGen"; formulas of its `quant-videogen` 0.1.0 package,
  quant/qvg.py), as published: semantic-aware smoothing by k-means over the tokens of each span
  (per layer, K/V and head), one stage, 2 k-means iterations, then an INT2 residual with levels
  {-1, 0, 1} and one FP8-E4M3 scale per token and block of 64 channels: the package's shipped
  setting (Self-Forcing, HY-WorldPlay, LingBot-v2 scripts). Its schedule too: a span is
  `quant_factor` = 8 chunks (the package's default, Self-Forcing's QUANT_FACTOR; a TinyWorld
  chunk is one frame), held in 16 bits until its last frame is appended, then k-means runs on
  all its tokens and the span is coded (`prq_deferred`); those pending frames are counted:
  2.49 bits/element in the one phase where every kept frame is coded, 8.20 at the worst (7
  pending frames of 17), 5.35 on average over the 8 phases (`memory.phase_bits`). No float16 sink: the first frame is quantized with its
  span as in the Self-Forcing integration (`quant_sink_keep_chunks` = 0), and the frame being
  generated attends to its own exact K/V as the package's current chunk does. Deviations, and why:
  - *Centroid budget.* The package uses 256 centroids per span of 37,440 tokens (Self-Forcing:
    ~146 tokens per centroid); a TinyWorld span of 8 frames has 128 tokens: 2 centroids (64
    tokens each) keep k-means a clustering (one centroid is mean removal).
  - *Indices* are bit-packed (1 bit for 2 centroids) where the package stores a uint8 per
    token: storage only, the same numerics.
  - float32 arithmetic with float16 centroids and float16 pending frames (the package: bf16
    model, bf16 centroids, residual and pending chunks); assignment to the nearest stored
    centroid (the package returns k-means' last ids, the same once converged); fixed-seed
    init shared by the batch rows (the package draws from the global RNG); the FP8 scale
    clamped to [2^-9, 448] (the package's real path divides by a zero scale on an all-zero
    block); the project's bit order; keys post-rotary (LingBot-v2 and HY-WorldPlay cache
    post-RoPE keys; Self-Forcing pre-RoPE). `benchmarks/peer_oracle.py` runs the package's
    own code on the same K/V (artifacts/benchmarks/peer_oracle.md).
- `qvg2_lowmem`: the best span code we found within 2.5 bits (2.49 at the worst span phase),
  the same quantizer with another schedule. Deferred spans cannot get there: one float16
  pending frame of 17 already costs ~0.8 bits. So each span's centroids are fitted on its
  *first* frame when it is stored and the later frames are smoothed with them as they arrive
  (resident bits = stored bits), spans of 16 frames with 2 centroids (S16C2: 128 tokens per
  centroid, near the package's ratio). The cost: the centroids see 16 tokens, not the span,
  and post-rotary keys turn with the camera (peer_oracle.md measures what that costs).
  Measured on 4 held-out trajectories x 64 frames: S16C2 30.9 dB at 2.49 bits vs S8C1 29.2 dB
  at 2.36, S4C1 29.7 at 2.48, S1C1 (per-frame spans) 29.9 at 3.13; 4 centroids (S16C4: 2.86
  bits) or 8-frame spans (S8C2: 2.61) exceed 2.5.
- `qvg2_static`: the same residual quantizer after static smoothing with 16 centroids per head
  fitted offline on calibration K/V by QVG's k-means (100 iterations), 2.25 bits. Kept because
  it teaches something: on 16-token frames the per-span centroid budget is what limits QVG,
  and calibrated centroids, which cost nothing per frame, do better at fewer bits.
- `kivi2_lowmem`: KIVI-2's quantizer (asymmetric min/max, round half to even, float16 scale
  and zero) with no float16 residual and V per-token groups of 64: 2.5 bits. Deviation: keys
  per-token (groups of 64 channels) instead of per-channel, because no per-channel key variant
  reaches 2.5 bits measured on 16-token frames: groups of one frame cost 2 + 32/16 = 4 bits
  for keys, and KIVI's longer key groups (G = 64 tokens = 4 frames, 2.5 bits stored) need a
  float16 key buffer of up to 3 frames that averages 3.8 bits for keys (3.1 for K and V).
  So this row is KIVI's own per-token-key ablation, at our memory.
- `turbo2.5` (Zandieh et al., 2025, "TurboQuant"; quant/turbo.py): per head a Haar-random
  rotation; keys TQ_prod at 2 bits (1-bit Lloyd-Max code of the Beta coordinate law + a 1-bit
  QJL sketch of the residual, m = head_dim, float16 norm and residual norm: 2.5 bits), values
  TQ_mse at 2 bits (Lloyd-Max, float16 norm: 2.25 bits); every frame quantized on write (the
  paper quantizes generated tokens too), no float16 frames. 2.375 bits. The decoded key
  k^ = n (c[code] + sqrt(pi/2)/m gamma S^T z) makes ordinary attention compute the paper's
  unbiased inner-product estimator. Deviations: no outlier-channel split (the paper's 2.5-bit
  setting runs two instances, 32 outlier channels at 3 bits and 96 at 2 of 128; with per-
  instance norms that costs > 2.5 bits at head_dim 64: 3.25 for keys); the sketch acts on the
  residual in the rotated basis (S Pi^T is Gaussian too: same estimator); norms in float16
  (the paper does not say); keys post-rotary.
- `jensen2` ("Quantized Keys Steal Attention", Tuncer et al., 2026; only the abstract was
  readable, the formula is the research spec's reconstruction, quant/jensen.py): a plain 2-bit
  cache, K per-channel over each frame's tokens and V per-token groups of 64 (asymmetric
  min/max, no float16 frames), with the logits of quantized keys lowered by
  sum_d q_d^2 Delta_d^2 / (24 D) from each key's own stored steps: 3.25 bits (per-channel key
  parameters of a 16-token frame cost 2 bits; the correction adds none). How it differs from
  the project's fitted `logit_bias` correction: quant/jensen.py; both are measured on this
  cache by `benchmarks/jensen.py`.
- `nvfp4` (NVIDIA's FP4 block format, the KV cache format LongLive-2.0 ships for Blackwell GPUs;
  codes/nvfp4.py): K and V as FP4 E2M1 values with an FP8 E4M3 scale per 16 channels of a token
  and a float32 scale per tensor, no float16 frames: 4.5 bits + 32 bits per head and frame (4.53
  at head_dim 64, 16 tokens). The 4.5-bit peer. Deviation: the per-tensor scale is taken per head
  and frame when the frame is stored (max|y| / (6 * 448), so no value saturates), where deployments
  calibrate one per tensor; keys post-rotary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from calibrate.quant import codebook, qvg, rotation, turbo
from calibrate.recipe import ModelInfo, Recipe, Scheme, TensorSpec, TokenPolicy, uniform_scheme

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
    notes = "per-token symmetric 2-bit, group 64, scale=absmax/2 (the brief's example); scale rounded to fp16 before coding"
    return Recipe(info, uniform_scheme("naive2", info.num_layers, spec, spec, pol, notes), {})


def _kivi(bits: int):
    def build(info: ModelInfo, calib) -> Recipe:
        k = TensorSpec(bits=bits, axis="channel")
        v = TensorSpec(bits=bits, axis="token", group_size=min(32, info.head_dim))
        recent = math.ceil(KIVI_RESIDUAL_TOKENS / info.tokens_per_frame)
        pol = TokenPolicy(sink_frames=0, recent_frames=recent, recent_bits=16)
        notes = (f"KIVI-{bits}: K per-channel, V per-token G=32, asymmetric min/max, fp16 residual of "
                 f"{KIVI_RESIDUAL_TOKENS} tokens = {recent} frames; key groups span one frame "
                 f"({info.tokens_per_frame} tokens) instead of 32 tokens; the residual is a sliding window "
                 "including the fresh frame (KIVI: a key block buffer of 0-127 tokens); frames are coded from "
                 "their fp16 copy with fp16-rounded scale and minimum")
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


# ---- issue 17: peers at equal memory ---------------------------------------------------------
def _kivi2_lowmem(info: ModelInfo, calib) -> Recipe:
    spec = TensorSpec(bits=2, axis="token", group_size=min(64, info.head_dim))
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = ("KIVI-2 quantizer (asymmetric min/max, round half to even, fp16 scale+zero) at <= 2.5 bits: no fp16 "
             "residual, V per-token G=64; K per-token G=64 instead of per-channel (per-channel key groups of one "
             f"{info.tokens_per_frame}-token frame cost 4 bits, longer groups need an fp16 key buffer)")
    return Recipe(info, uniform_scheme("kivi2_lowmem", info.num_layers, spec, spec, pol, notes), {})


QVG_BLOCK = 64  # quant_block_size of every shipped script but LingBot v1
QVG_STAGES = 1  # num_prq_stages of every shipped script but LingBot v1
QVG_KMEANS_ITERS = 2  # kmeans_max_iters of Self-Forcing, HY-WorldPlay and LingBot-v2
QVG_QUANT_FACTOR = 8  # chunks per span: the package's quant_factor (Self-Forcing's QUANT_FACTOR)
QVG_CENTROIDS = 2
QVG_LOWMEM_SPAN_FRAMES = 16
QVG_LOWMEM_CENTROIDS = 2


def _qvg_recipe(info: ModelInfo, name: str, span_frames: int, centroids: int, deferred: bool, schedule: str) -> Recipe:
    """QVG's PRQ quantizer (the package's shipped setting) under one span schedule."""
    spec = TensorSpec(bits=2, kind="prq", group_size=min(QVG_BLOCK, info.head_dim), prq_stages=QVG_STAGES,
                      prq_centroids=centroids, prq_span_frames=span_frames, prq_kmeans_iters=QVG_KMEANS_ITERS,
                      prq_deferred=deferred)
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = (f"{schedule}; {QVG_STAGES} k-means stage of {centroids} centroids per head and span ({QVG_KMEANS_ITERS} "
             f"iterations); INT2 residual (levels -1, 0, 1), FP8-E4M3 scale per token and block of {spec.group_size}; "
             "first frame quantized with its span (Self-Forcing integration); keys post-rotary")
    return Recipe(info, uniform_scheme(name, info.num_layers, spec, spec, pol, notes), {})


def _qvg2(info: ModelInfo, calib) -> Recipe:
    return _qvg_recipe(info, "qvg2", QVG_QUANT_FACTOR, QVG_CENTROIDS, True,
                       f"QVG (PRQ) as published: spans of {QVG_QUANT_FACTOR} frames held in 16 bits until complete, "
                       "then fitted on all their tokens")


def _qvg2_lowmem(info: ModelInfo, calib) -> Recipe:
    return _qvg_recipe(info, "qvg2_lowmem", QVG_LOWMEM_SPAN_FRAMES, QVG_LOWMEM_CENTROIDS, False,
                       f"QVG's quantizer at <= 2.5 bits: spans of {QVG_LOWMEM_SPAN_FRAMES} frames fitted on their first "
                       "frame when it is stored (no float16 pending frames)")


def _turbo25(info: ModelInfo, calib) -> Recipe:
    D, H = info.head_dim, info.num_kv_heads
    k = TensorSpec(bits=2, kind="turbo_prod", rotation="random")
    v = TensorSpec(bits=2, kind="turbo", rotation="random")
    levels = {"k": turbo.beta_lloyd_max(D, 1), "v": turbo.beta_lloyd_max(D, 2)}
    tensors = {}
    for i in range(info.num_layers):
        for j, kind in enumerate("kv"):
            seed = 1000 * i + 100 * j
            tensors[f"layers.{i}.{kind}.rotation"] = torch.stack([rotation.random_orthogonal(D, seed + h) for h in range(H)])
            tensors[f"layers.{i}.{kind}.lloyd_max"] = levels[kind].expand(H, -1).clone()
        tensors[f"layers.{i}.k.qjl"] = torch.stack([turbo.qjl_matrix(D, D, 1000 * i + 50 + h) for h in range(H)])
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = ("TurboQuant: Haar-random rotation per head; K = TQ_prod (1-bit Lloyd-Max + 1-bit QJL sketch, m = head_dim, "
             "fp16 norm and residual norm: 2.5 bits), V = TQ_mse (2-bit Lloyd-Max, fp16 norm: 2.25 bits); every frame "
             "quantized on write; no outlier-channel split (its per-instance norms cost > 2.5 bits at head_dim 64)")
    return Recipe(info, uniform_scheme("turbo2.5", info.num_layers, k, v, pol, notes), tensors)


def _jensen2(info: ModelInfo, calib) -> Recipe:
    k = TensorSpec(bits=2, axis="channel", jensen=True)
    v = TensorSpec(bits=2, axis="token", group_size=min(64, info.head_dim))
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = ("Jensen-bias correction (reconstructed from the abstract) on a plain 2-bit cache: K per-channel over each "
             "frame's tokens, V per-token G=64, asymmetric min/max; logits of quantized keys lowered by "
             "sum_d q_d^2 Delta_d^2 / (24 D) from each key's stored steps")
    return Recipe(info, uniform_scheme("jensen2", info.num_layers, k, v, pol, notes), {})


QVG_STATIC_CENTROIDS = 16
QVG_STATIC_KMEANS_ITERS = 100  # QuantizeConfig's default: offline, iterations are free


def _qvg2_static(info: ModelInfo, calib) -> Recipe:
    calib = _require(calib, "qvg2_static")
    C = QVG_STATIC_CENTROIDS
    spec = TensorSpec(bits=2, kind="prq", group_size=min(QVG_BLOCK, info.head_dim), centroids=C)
    tensors = {}
    for i in range(info.num_layers):
        for kind, sample in (("k", calib.k_LHND), ("v", calib.v_LHND)):
            x = sample[i].float()  # [H, N, D]: the heads are k-means' batch rows
            _, cents = qvg.kmeans(x, C, QVG_STATIC_KMEANS_ITERS, qvg.init_indices(x.shape[1], C))
            tensors[f"layers.{i}.{kind}.centroids"] = cents
    pol = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = (f"QVG residual (INT2, FP8 scale per block of {spec.group_size}) after static smoothing: {C} centroids per "
             "head fitted offline on calibration K/V with QVG's k-means, instead of per span at run time")
    return Recipe(info, uniform_scheme("qvg2_static", info.num_layers, spec, spec, pol, notes), tensors)


def _nvfp4(info: ModelInfo, calib) -> Recipe:
    spec = TensorSpec(bits=4, kind="nvfp4", group_size=16)
    notes = "NVFP4: E2M1 values, E4M3 scale per 16 channels, float32 scale per head and frame (max|x| / 2688)"
    return Recipe(info, uniform_scheme("nvfp4", info.num_layers, spec, spec, TokenPolicy(sink_frames=0, recent_frames=0),
                                       notes), {})


BUILDERS = {
    "fp16": _fp16,
    "naive2": _naive2,
    "kivi2": _kivi(2),
    "kivi4": _kivi(4),
    "kvquant2": _kvquant2,
    "quarot2": _quarot2,
    "qvg2": _qvg2,
    "qvg2_lowmem": _qvg2_lowmem,
    "kivi2_lowmem": _kivi2_lowmem,
    "turbo2.5": _turbo25,
    "jensen2": _jensen2,
    "qvg2_static": _qvg2_static,
    "nvfp4": _nvfp4,
}
BASELINES = tuple(BUILDERS)
CALIBRATED = ("kvquant2", "qvg2_static")  # need K/V samples from a calibration replay


def preset_scheme(name: str, info: ModelInfo) -> Scheme:
    """The scheme (specs and policy, not the fitted tensors) of baseline `name`, without calibration
    data: calibrated presets are built on a small synthetic sample, which changes only their tensors."""
    sample = None
    if name in CALIBRATED:
        g = torch.Generator().manual_seed(0)
        shape = (info.num_layers, info.num_kv_heads, 64, info.head_dim)
        sample = KVSample(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return build_baseline(name, info, sample).scheme


def build_baseline(name: str, info: ModelInfo, calib: KVSample | None = None) -> Recipe:
    """The recipe of baseline `name` for the model `info`."""
    if name not in BUILDERS:
        raise ValueError(f"unknown scheme '{name}'; baselines are {', '.join(BUILDERS)} (or give a recipe path)")
    recipe = BUILDERS[name](info, calib)
    recipe.metadata.setdefault("calibration", "{}")
    return recipe
