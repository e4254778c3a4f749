"""Bounded uniform samples of tokens (queries, keys, values) per layer: reservoir sampling.

The statistics (stats.py) summarise every token without keeping any; the fitters also need
a few real tokens (static ranges, rotations, the baselines' codebooks). A `QuerySample` keeps
at most `capacity` of them per layer, drawn uniformly from the stream, with memory that does
not grow with the rollout; `merge_queries` combines the samples of shards and processes.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor


def _mix(*ints: int) -> int:
    """A deterministic 63-bit seed from a few integers (no Python hash randomisation)."""
    h = 0x9E3779B97F4A7C15
    for i in ints:
        h = ((h ^ (i & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class QuerySample:
    """A bounded uniform sample of query tokens per layer (reservoir sampling, Algorithm R).

    A sampled item is one token's query over all heads, [Q, D]. Randomness comes from one
    seeded generator per layer, so the same stream of updates gives the same sample. After
    `from_tensors` or `merge_queries` the generators are reseeded from (seed, layer, seen).

    `merge_queries` keeps a weighted subsample of the union (each stored row stands for
    seen/kept items of its side), which is uniform in expectation but, unlike `merge` of
    `KVStats`, not order-independent: merge(a, b) and merge(b, a) may keep different rows.
    What always holds: at most `capacity` rows, every row comes from a or b, the union is
    kept whole when it fits, `num_seen` adds up, and the same inputs give the same output.
    Reservoirs with different seeds merge (the result takes the first one's seed).
    """

    def __init__(self, *, num_layers: int, num_heads: int, head_dim: int, capacity: int = 4096,
                 seed: int = 0, device: str | torch.device = "cpu"):
        if min(num_layers, num_heads, head_dim, capacity) < 1:
            raise ValueError("QuerySample num_layers, num_heads, head_dim and capacity must be >= 1")
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.capacity, self.seed = capacity, seed
        self.device = torch.device(device)
        self.q_LCQD = torch.zeros(num_layers, capacity, num_heads, head_dim, device=self.device)
        self.num_seen_L = torch.zeros(num_layers, dtype=torch.int64)
        self.reseed()

    def reseed(self) -> None:
        """Reseed from (seed, layer, seen): a stream resumed at this point draws the same numbers."""
        self._gens = [torch.Generator().manual_seed(_mix(self.seed, layer, int(self.num_seen_L[layer])))
                      for layer in range(self.num_layers)]

    def settings(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "num_heads": self.num_heads, "head_dim": self.head_dim,
                "capacity": self.capacity, "seed": self.seed}

    def update(self, layer: int, q_BQTD: Tensor) -> None:
        """Offer every token of one frame's queries of `layer` to the reservoir."""
        B, Q, T, D = q_BQTD.shape
        if Q != self.num_heads or D != self.head_dim:
            raise ValueError(
                f"queries must be [B, {self.num_heads}, T, {self.head_dim}], got {list(q_BQTD.shape)}")
        rows_NQD = q_BQTD.detach().to(self.device, torch.float32).permute(0, 2, 1, 3).reshape(B * T, Q, D)
        n, seen, C = B * T, int(self.num_seen_L[layer]), self.capacity
        pos_N = seen + torch.arange(n)
        u_N = torch.rand(n, generator=self._gens[layer], dtype=torch.float64)
        # item at (0-based) position i >= C takes slot randint(0, i) if that slot is < C
        slot_N = torch.where(pos_N < C, pos_N, (u_N * (pos_N + 1)).floor().long())
        keep_N = slot_N < C
        # several items of this frame may draw the same slot: sequentially, the last one wins
        last_C = torch.full((C,), -1, dtype=torch.int64).scatter_reduce(
            0, slot_N[keep_N], torch.arange(n)[keep_N], reduce="amax")
        filled_C = last_C >= 0
        self.q_LCQD[layer, filled_C.to(self.device)] = rows_NQD[last_C[filled_C].to(self.device)]
        self.num_seen_L[layer] += n

    def samples(self, layer: int) -> Tensor:
        """The sampled queries of `layer`, [min(seen, capacity), Q, D]."""
        return self.q_LCQD[layer, : min(int(self.num_seen_L[layer]), self.capacity)]

    def to_tensors(self) -> dict[str, Tensor]:
        return {"samples": self.q_LCQD.detach().to("cpu", copy=True), "num_seen": self.num_seen_L.clone()}

    @classmethod
    def from_tensors(cls, settings: Mapping[str, int], tensors: Mapping[str, Tensor],
                     device: str | torch.device = "cpu") -> QuerySample:
        out = cls(**settings, device=device)
        for name, ref in (("samples", out.q_LCQD), ("num_seen", out.num_seen_L)):
            t = tensors.get(name)
            if t is None or t.shape != ref.shape or t.dtype != ref.dtype:
                got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                raise ValueError(f"query tensor {name} is {got}, expected {ref.dtype} {list(ref.shape)}")
            ref.copy_(t)
        out.reseed()
        return out


def merge_queries(a: QuerySample, b: QuerySample) -> QuerySample:
    """A deterministic weighted subsample of the union of two reservoirs (see QuerySample)."""
    if {**a.settings(), "seed": 0} != {**b.settings(), "seed": 0}:
        raise ValueError(f"cannot merge query samples with settings {a.settings()} and {b.settings()}")
    out = QuerySample(**a.settings(), device=a.device)
    for layer in range(a.num_layers):
        xa, xb = a.samples(layer), b.samples(layer).to(a.device)
        na, nb = int(a.num_seen_L[layer]), int(b.num_seen_L[layer])
        cand = torch.cat([xa, xb])
        if len(cand) > a.capacity:
            # Efraimidis-Spirakis weighted sampling: keep the top keys u^(1/w)
            w = torch.cat([torch.full((len(xa),), na / max(len(xa), 1)),
                           torch.full((len(xb),), nb / max(len(xb), 1))])
            gen = torch.Generator().manual_seed(_mix(a.seed, layer, na, nb))
            key = torch.rand(len(cand), generator=gen, dtype=torch.float64).log() / w.double()
            cand = cand[key.topk(a.capacity).indices.sort().values.to(a.device)]
        out.q_LCQD[layer, : len(cand)] = cand
        out.num_seen_L[layer] = na + nb
    out.reseed()
    return out
