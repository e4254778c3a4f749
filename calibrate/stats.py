"""Streaming, mergeable statistics of keys, values and attention.

Calibration replays long rollouts and has to summarise every key and value the cache ever
held without keeping them. `KVStats` is that summary: fixed-size tensors updated one frame
at a time, whose memory does not depend on the rollout length (the per-frame-bucket drift
summaries are bounded by `max_frames`). Every tensor declares how two summaries combine
(`MERGE`: sum, min or max), so shards of trajectories, processes and GPUs reduce *exactly*
to the summary of all the data: integer counts and histograms and min/max bit for bit,
float64 sums up to summation order.

Tokens. A frame's K or V arrives as `x_BHTD`; all B x T tokens (trajectories x tokens of the
frame) are samples of the same per-(layer, head, channel) distribution.

Tensors: `stats_config.py` lists each one, its shape, dtype and meaning (`KVStatsConfig.tensor_specs`
makes them).

Memory is fixed by the config. At Wan scale (L=30, H=12, D=128, NB=256) the histograms take
94 MB and the Gram matrices 47 MB per kind; everything else is small. Updates accumulate in
float64 on `device` (put it on the GPU next to the model to keep replay fast).

Derived views (`mean`, `var`, `kurtosis`, `percentile`, `outlier_channels`, `anchor_frames`,
`range_drift`, ...) are pure functions of a `KVStats`; they never return NaN, also for empty,
zero or constant input. Query vectors are not summarised here: `sample.QuerySample` keeps a
bounded uniform reservoir of them (and of K/V tokens) for the fitters, and a stats file can
carry such reservoirs alongside the statistics.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from calibrate.io import read_versioned, safetensors_bytes, write_bytes_atomic
from calibrate.sample import QuerySample
from calibrate.stats_config import CHANGE_KINDS, KINDS, KVStatsConfig

FORMAT = "kv-stats"
FORMAT_VERSION = "1.2"  # 1.1: kpre.* and *.delta_* for predictive codes; 1.2: *.sink_* for their sink code

# How each statistic combines across shards/ranks; keyed by the part of the name after "kind.".
MERGE: dict[str, str] = {
    "count": "sum", "sum": "sum", "sumsq": "sum", "sum3": "sum", "sum4": "sum",
    "min": "min", "max": "max", "absmax": "max", "hist": "sum", "gram": "sum",
    "bucket_count": "sum", "bucket_absmax_sum": "sum", "bucket_abs_sum": "sum",
    "bucket_absmax_max": "max",
    "rows": "sum", "age_mass": "sum", "age_pairs": "sum", "age_uniform": "sum",
    "anchor_mass": "sum", "anchor_pairs": "sum", "anchor_uniform": "sum",
    "delta_count": "sum", "delta_gram": "sum", "sink_count": "sum", "sink_sum": "sum", "sink_gram": "sum",
}
_INIT = {"min": math.inf, "max": -math.inf}  # everything else starts at 0
_EPS = 1e-12


def merge_rule(name: str) -> str:
    """The merge rule ("sum", "min" or "max") of tensor `name` ("k.sum", "attn.rows", ...)."""
    return MERGE[name.split(".", 1)[1]]


class KVStats:
    """The streaming summary; `stats_config.py` lists what each tensor holds."""

    def __init__(self, config: KVStatsConfig, device: str | torch.device = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.tensors: dict[str, Tensor] = {
            name: torch.full(shape, _INIT.get(name.split(".", 1)[1], 0), dtype=dtype, device=self.device)
            for name, (shape, dtype) in config.tensor_specs().items()
        }

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    # ---- updates ---------------------------------------------------------------------
    def update(self, layer: int, k_BHTD: Tensor, v_BHTD: Tensor, frame_index: int) -> None:
        """Add one frame's keys and values of `layer` (frame_index: position in the rollout)."""
        self.update_kind("k", layer, k_BHTD, frame_index)
        self.update_kind("v", layer, v_BHTD, frame_index)

    def update_kind(self, kind: str, layer: int, x_BHTD: Tensor, frame_index: int) -> None:
        """Add one frame's keys (kind "k") or values ("v") of `layer`."""
        cfg = self.config
        if kind not in KINDS:
            raise ValueError(f"stats kind must be one of {KINDS}, got {kind!r}")
        self._check_layer(layer)
        if x_BHTD.dim() != 4 or x_BHTD.shape[1] != cfg.num_heads or x_BHTD.shape[3] != cfg.head_dim:
            raise ValueError(
                f"stats expect {kind} as [B, {cfg.num_heads}, T, {cfg.head_dim}], got {list(x_BHTD.shape)}"
            )
        if frame_index < 0:
            raise ValueError(f"frame_index must be >= 0, got {frame_index}")
        B, H, T, D = x_BHTD.shape
        if B * T == 0:
            return
        x_HND = x_BHTD.detach().to(self.device, torch.float64).permute(1, 0, 2, 3).reshape(H, B * T, D)
        if not torch.isfinite(x_HND).all():
            raise ValueError(f"non-finite {kind} values in layer {layer}, frame {frame_index}")
        # this layer's slice of every tensor of `kind`, updated in place
        t = {name.split(".", 1)[1]: x[layer]
             for name, x in self.tensors.items() if name.startswith(f"{kind}.")}
        x2_HND = x_HND * x_HND
        a_HND = x_HND.abs()
        t["count"] += B * T
        t["sum"] += x_HND.sum(1)
        t["sumsq"] += x2_HND.sum(1)
        t["sum3"] += (x2_HND * x_HND).sum(1)
        t["sum4"] += (x2_HND * x2_HND).sum(1)
        t["min"].copy_(torch.minimum(t["min"], x_HND.amin(1)))
        t["max"].copy_(torch.maximum(t["max"], x_HND.amax(1)))
        t["absmax"].copy_(torch.maximum(t["absmax"], a_HND.amax(1)))
        t["gram"] += x_HND.transpose(1, 2) @ x_HND
        t["hist"] += self._histogram(x_HND)
        u = min(frame_index // cfg.bucket_size, cfg.num_buckets - 1)
        token_absmax_HN = a_HND.amax(-1)
        t["bucket_count"][u] += B * T
        t["bucket_absmax_sum"][:, u] += token_absmax_HN.sum(1)
        t["bucket_abs_sum"][:, u] += a_HND.sum((1, 2))
        t["bucket_absmax_max"][:, u] = torch.maximum(t["bucket_absmax_max"][:, u], token_absmax_HN.amax(1))

    def update_keys_before_rotation(self, layer: int, k_BHTD: Tensor) -> None:
        """Add one frame's pre-rotary keys of `layer` (count, sum, Gram)."""
        self._check_layer(layer)
        x_HND = self._tokens(k_BHTD, "kpre")
        t = self.tensors
        t["kpre.count"][layer] += x_HND.shape[1]
        t["kpre.sum"][layer] += x_HND.sum(1)
        t["kpre.gram"][layer] += x_HND.transpose(1, 2) @ x_HND

    def update_change(self, kind: str, layer: int, x_BHTD: Tensor, prev_BHTD: Tensor) -> None:
        """Add the change of one frame of `kind` ("k", "kpre" or "v") from the previous frame of the
        same trajectories: its Gram matrix, from which a predictive code sizes its inter steps."""
        if kind not in CHANGE_KINDS:
            raise ValueError(f"stats change kind must be one of {CHANGE_KINDS}, got {kind!r}")
        self._check_layer(layer)
        d_HND = self._tokens(x_BHTD, kind) - self._tokens(prev_BHTD, kind)
        self.tensors[f"{kind}.delta_count"][layer] += d_HND.shape[1]
        self.tensors[f"{kind}.delta_gram"][layer] += d_HND.transpose(1, 2) @ d_HND

    def update_sink(self, kind: str, layer: int, x_BHTD: Tensor) -> None:
        """Add one sink frame of `kind` ("k", "kpre" or "v"; a frame the cache keeps as a sink):
        count, sum and Gram, from which a predictive code sizes its sink code (the first frame of a
        rollout is not distributed like the rest: on WanWorld it is the given, clean frame)."""
        if kind not in CHANGE_KINDS:
            raise ValueError(f"stats sink kind must be one of {CHANGE_KINDS}, got {kind!r}")
        self._check_layer(layer)
        x_HND = self._tokens(x_BHTD, kind)
        self.tensors[f"{kind}.sink_count"][layer] += x_HND.shape[1]
        self.tensors[f"{kind}.sink_sum"][layer] += x_HND.sum(1)
        self.tensors[f"{kind}.sink_gram"][layer] += x_HND.transpose(1, 2) @ x_HND

    def _tokens(self, x_BHTD: Tensor, kind: str) -> Tensor:
        """[B, H, T, D] -> float64 [H, B*T, D] on this summary's device (shape and values checked)."""
        cfg = self.config
        if x_BHTD.dim() != 4 or x_BHTD.shape[1] != cfg.num_heads or x_BHTD.shape[3] != cfg.head_dim:
            raise ValueError(f"stats expect {kind} as [B, {cfg.num_heads}, T, {cfg.head_dim}], got {list(x_BHTD.shape)}")
        B, H, T, D = x_BHTD.shape
        x_HND = x_BHTD.detach().to(self.device, torch.float64).permute(1, 0, 2, 3).reshape(H, B * T, D)
        if not torch.isfinite(x_HND).all():
            raise ValueError(f"non-finite {kind} values")
        return x_HND

    def _histogram(self, x_HND: Tensor) -> Tensor:
        """Per-channel bin counts [H, D, NB]; out-of-range values clamp into the edge bins."""
        cfg = self.config
        H, N, D = x_HND.shape
        nb = cfg.num_bins
        bin_HND = ((x_HND - cfg.hist_range[0]) / cfg.bin_width).floor().clamp_(0, nb - 1).long()
        channel_HND = (torch.arange(H * D, device=x_HND.device).view(H, 1, D)).expand(H, N, D)
        flat = (channel_HND * nb + bin_HND).flatten()
        return torch.bincount(flat, minlength=H * D * nb).view(H, D, nb)

    def update_attention(self, layer: int, probs_BQF: Tensor, frame_indices: list[int], newest: int) -> None:
        """Add one frame's attention of `layer` over the cached frames.

        `probs_BQF[b, h, f]` is the attention mass query head h of trajectory b put on cached
        frame `frame_indices[f]`: softmax probabilities summed over that frame's tokens and
        averaged over the querying frame's tokens (`frame_mass` computes it), so each row sums
        to 1. `newest` is the index of the querying frame; the age of frame i is newest - i.
        """
        cfg = self.config
        self._check_layer(layer)
        F = len(frame_indices)
        if probs_BQF.dim() != 3 or probs_BQF.shape[1:] != (cfg.query_heads, F) or F == 0:
            raise ValueError(
                f"attention probs must be [B, {cfg.query_heads}, {F} frames], got {list(probs_BQF.shape)}"
            )
        B = probs_BQF.shape[0]
        if len(set(frame_indices)) != F or min(frame_indices) < 0 or max(frame_indices) > newest:
            raise ValueError(f"frame_indices must be distinct, in [0, newest={newest}], got {frame_indices}")
        idx_F = torch.tensor(frame_indices, dtype=torch.int64, device=self.device)
        age_F = (newest - idx_F).clamp(max=cfg.max_age)
        mass_QF = probs_BQF.detach().to(self.device, torch.float64).sum(0)
        t = self.tensors
        t["attn.rows"][layer] += B
        t["attn.age_mass"][layer].index_add_(1, age_F, mass_QF)
        t["attn.age_pairs"][layer].index_add_(0, age_F, torch.full_like(age_F, B))
        uniform_F = torch.full((F,), B / F, dtype=torch.float64, device=self.device)
        t["attn.age_uniform"][layer].index_add_(0, age_F, uniform_F)
        anchor_F = idx_F < cfg.num_anchor_frames
        if anchor_F.any():
            s = idx_F[anchor_F]
            t["attn.anchor_mass"][layer][:, s] += mass_QF[:, anchor_F]
            t["attn.anchor_pairs"][layer][s] += B
            t["attn.anchor_uniform"][layer][s] += B / F

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer must be in [0, {self.config.num_layers}), got {layer}")

    # ---- tensors and files -----------------------------------------------------------
    def to_tensors(self) -> dict[str, Tensor]:
        """Copies of all tensors on the CPU (what `save` writes)."""
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.tensors.items()}

    @classmethod
    def from_tensors(
        cls, config: KVStatsConfig, tensors: Mapping[str, Tensor], device: str | torch.device = "cpu"
    ) -> KVStats:
        """Rebuild from `to_tensors` output; ValueError names any missing/extra/misshapen tensor."""
        specs = config.tensor_specs()
        missing, extra = sorted(set(specs) - set(tensors)), sorted(set(tensors) - set(specs))
        if missing or extra:
            raise ValueError(f"stats tensors do not match the config: missing {missing}, unexpected {extra}")
        for name, (shape, dtype) in specs.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"stats tensor {name} is {t.dtype} {list(t.shape)}, config expects {dtype} {list(shape)}"
                )
        stats = cls(config, device)
        for name, t in tensors.items():
            stats.tensors[name].copy_(t)
        return stats

    def save(self, path: str | os.PathLike, model: Mapping[str, Any] | None = None,
             samples: Mapping[str, QuerySample] | None = None, extra: Mapping[str, str] | None = None) -> None:
        """Write one safetensors file atomically (`calibrate.io`: temp file next to it + rename).

        Metadata: format, format_version, config (JSON), model (the caller's JSON-able model
        description) and `samples` (JSON: name -> reservoir settings) for the token reservoirs
        given (e.g. {"q": ..., "k": ..., "v": ...}), whose tensors are stored as sample_<name>.*;
        `extra` string fields are stored as `extra.<key>` (e.g. a resume checkpoint's progress).
        """
        tensors = self.to_tensors()
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "config": self.config.to_json(),
            "model": json.dumps(dict(model or {}), sort_keys=True),
        }
        for name, sample in (samples or {}).items():
            tensors.update({f"sample_{name}.{n}": t for n, t in sample.to_tensors().items()})
        if samples:
            metadata["samples"] = json.dumps({n: s.settings() for n, s in samples.items()}, sort_keys=True)
        metadata.update({f"extra.{k}": v for k, v in (extra or {}).items()})
        write_bytes_atomic(path, safetensors_bytes(tensors, metadata))

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> KVStats:
        return load_stats(path, device).stats


@dataclass
class StatsFile:
    """What a stats file holds: the summary, the model description, the token reservoirs."""

    stats: KVStats
    model: dict[str, Any]
    samples: dict[str, QuerySample]
    extra: dict[str, str]


def load_stats(path: str | os.PathLike, device: str | torch.device = "cpu") -> StatsFile:
    """Read and validate a stats file; every problem raises ValueError(f"{path}: ...")."""
    path = Path(path)
    metadata, tensors = read_versioned(path, FORMAT, FORMAT_VERSION, "stats")
    try:
        config = KVStatsConfig.from_json(metadata["config"])
        model = json.loads(metadata.get("model", "{}"))
        settings = json.loads(metadata.get("samples", "{}"))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad metadata ({e})") from e
    samples = {}
    try:
        for name, sample_settings in settings.items():
            prefix = f"sample_{name}."
            part = {n[len(prefix):]: tensors.pop(n) for n in list(tensors) if n.startswith(prefix)}
            samples[name] = QuerySample.from_tensors(sample_settings, part, device)
        stats = KVStats.from_tensors(config, tensors, device)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    extra = {k[len("extra."):]: v for k, v in metadata.items() if k.startswith("extra.")}
    return StatsFile(stats=stats, model=model, samples=samples, extra=extra)


def merge(a: KVStats, b: KVStats) -> KVStats:
    """The summary of the union of the data of `a` and `b` (each tensor by its merge rule)."""
    if a.config != b.config:
        raise ValueError(f"cannot merge stats with different configs: {a.config} vs {b.config}")
    out = KVStats(a.config, a.device)
    ops = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
    for name, ta in a.tensors.items():
        out.tensors[name] = ops[merge_rule(name)](ta, b.tensors[name].to(a.device))
    return out


def frame_mass(probs_BQTN: Tensor, tokens_per_frame: int) -> Tensor:
    """Attention rows over N = F x tokens_per_frame cached tokens -> mass per frame [B, Q, F]."""
    B, Q, T, N = probs_BQTN.shape
    if N % tokens_per_frame:
        raise ValueError(f"{N} cached tokens are not whole frames of {tokens_per_frame} tokens")
    return probs_BQTN.reshape(B, Q, T, N // tokens_per_frame, tokens_per_frame).sum(-1).mean(2)
