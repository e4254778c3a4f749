"""The shape and binning of a streaming K/V/attention summary (`stats.KVStats`), and the tensors
it holds.

Tensors (names are `"{kind}.{stat}"`, kind `k`, `v` or `attn`; legend below):

    k.count         [L]            int64    tokens seen per layer
    k.sum, k.sumsq, k.sum3, k.sum4
                    [L, H, D]      float64  sums of x, x^2, x^3, x^4 (moments, kurtosis)
    k.min, k.max, k.absmax
                    [L, H, D]      float64  (+inf / -inf / 0 before any data)
    k.hist          [L, H, D, NB]  int64    fixed-bin histogram over `hist_range`; values
                                            below / above the range land in the first / last
                                            bin (so the edge bins are open-ended)
    k.gram          [L, H, D, D]   float64  sum over tokens of x x^T (rotations, PCA, low rank)
    k.bucket_count  [L, U]         int64    tokens per frame bucket (frame_index // bucket_size)
    k.bucket_absmax_sum [L, H, U]  float64  sum over tokens of the token's absmax over channels
    k.bucket_abs_sum    [L, H, U]  float64  sum over tokens and channels of |x|
    k.bucket_absmax_max [L, H, U]  float64  largest token absmax in the bucket
    (the same for v.*)
    kpre.count [L] int64, kpre.sum [L, H, D], kpre.gram [L, H, D, D] float64
                                    the same moments of the keys *before* the rotary encoding
                                    (a predictive code stores them, quant/predictive.py)
    {k,kpre,v}.delta_count [L] int64, {k,kpre,v}.delta_gram [L, H, D, D] float64
                                    tokens and sum of d d^T of the frame-to-frame change
                                    d = x_t - x_{t-1} of the same trajectory and token
    {k,kpre,v}.sink_count [L] int64, .sink_sum [L, H, D], .sink_gram [L, H, D, D] float64
                                    the same moments of the sink frames alone (the frames the
                                    recording cache keeps as sinks: a predictive sink code)
    attn.rows           [L]        int64    query rows seen (one per trajectory per update)
    attn.age_mass       [L, Q, A]  float64  attention mass on frames of age a (clipped at A-1)
    attn.age_pairs      [L, A]     int64    (row, cached frame) pairs at age a
    attn.age_uniform    [L, A]     float64  sum of 1/F over those pairs: the mass uniform
                                            attention would have given them
    attn.anchor_mass    [L, Q, S]  float64  attention mass on absolute frame index s < S
    attn.anchor_pairs   [L, S]     int64    rows in which frame s was cached
    attn.anchor_uniform [L, S]     float64  sum of 1/F over those rows

Legend: L layers, H kv heads, Q attention (query) heads, D head_dim, T tokens per frame,
B batch, F cached frames, NB histogram bins, A = max_age + 1 ages, S = num_anchor_frames,
U = ceil(max_frames / bucket_size) frame buckets (frames past max_frames go to the last).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

KINDS = ("k", "v")
CHANGE_KINDS = ("k", "kpre", "v")  # kinds whose frame-to-frame change is summarised


@dataclass(frozen=True, kw_only=True)
class KVStatsConfig:
    """Shape and binning of a `KVStats`; fixed before the first update so summaries merge."""

    num_layers: int
    """Transformer layers L."""
    num_heads: int
    """Key/value heads H."""
    head_dim: int
    """Channels per head D."""
    num_query_heads: int | None = None
    """Attention (query) heads Q of the attention probabilities; None means Q = H."""
    hist_range: tuple[float, float] = (-32.0, 32.0)
    """Range covered by the histogram bins; values outside land in the edge bins."""
    num_bins: int = 256
    """Histogram bins NB (uniform over `hist_range`)."""
    max_age: int = 1024
    """Frame ages are clipped to this (the last age bin holds all older frames)."""
    num_anchor_frames: int = 4
    """Attention on absolute frame indices below this is tracked separately (sinks)."""
    bucket_size: int = 16
    """Frames per drift bucket."""
    max_frames: int = 1024
    """Frames covered by drift buckets; later frames are counted in the last bucket."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hist_range", tuple(float(x) for x in self.hist_range))
        for name in ("num_layers", "num_heads", "head_dim", "num_bins", "bucket_size", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"stats {name} must be >= 1, got {getattr(self, name)}")
        if self.num_query_heads is not None and self.num_query_heads < 1:
            raise ValueError(f"stats num_query_heads must be >= 1, got {self.num_query_heads}")
        if self.max_age < 0 or self.num_anchor_frames < 0:
            raise ValueError("stats max_age and num_anchor_frames must be >= 0")
        lo, hi = self.hist_range
        if len(self.hist_range) != 2 or not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"stats hist_range must be two finite numbers lo < hi, got {self.hist_range}")

    @property
    def query_heads(self) -> int:
        return self.num_heads if self.num_query_heads is None else self.num_query_heads

    @property
    def num_buckets(self) -> int:
        return -(-self.max_frames // self.bucket_size)

    @property
    def bin_width(self) -> float:
        return (self.hist_range[1] - self.hist_range[0]) / self.num_bins

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor of a `KVStats` with this config."""
        L, H, D, Q = self.num_layers, self.num_heads, self.head_dim, self.query_heads
        U, A, S = self.num_buckets, self.max_age + 1, self.num_anchor_frames
        i64, f64 = torch.int64, torch.float64
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for kind in KINDS:
            specs[f"{kind}.count"] = ((L,), i64)
            for stat in ("sum", "sumsq", "sum3", "sum4", "min", "max", "absmax"):
                specs[f"{kind}.{stat}"] = ((L, H, D), f64)
            specs[f"{kind}.hist"] = ((L, H, D, self.num_bins), i64)
            specs[f"{kind}.gram"] = ((L, H, D, D), f64)
            specs[f"{kind}.bucket_count"] = ((L, U), i64)
            for stat in ("bucket_absmax_sum", "bucket_abs_sum", "bucket_absmax_max"):
                specs[f"{kind}.{stat}"] = ((L, H, U), f64)
        specs["kpre.count"] = ((L,), i64)
        specs["kpre.sum"] = ((L, H, D), f64)
        specs["kpre.gram"] = ((L, H, D, D), f64)
        for kind in CHANGE_KINDS:
            specs[f"{kind}.delta_count"] = ((L,), i64)
            specs[f"{kind}.delta_gram"] = ((L, H, D, D), f64)
            specs[f"{kind}.sink_count"] = ((L,), i64)
            specs[f"{kind}.sink_sum"] = ((L, H, D), f64)
            specs[f"{kind}.sink_gram"] = ((L, H, D, D), f64)
        specs["attn.rows"] = ((L,), i64)
        specs["attn.age_mass"] = ((L, Q, A), f64)
        specs["attn.age_pairs"] = ((L, A), i64)
        specs["attn.age_uniform"] = ((L, A), f64)
        specs["attn.anchor_mass"] = ((L, Q, S), f64)
        specs["attn.anchor_pairs"] = ((L, S), i64)
        specs["attn.anchor_uniform"] = ((L, S), f64)
        return specs

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVStatsConfig:
        return cls(**json.loads(text))
