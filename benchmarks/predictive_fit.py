"""A predictive recipe from a few frames of K/V, without the calibration pipeline (benchmarks only).

The benchmarks need a recipe of the default kind for shapes no trained model ships with (a
Wan-shaped synthetic layer, a random-weight Wan2.1-1.3B). `Moments` is a cache observer that
accumulates, per layer and head, the mean, second moments and frame-to-frame change of K
(pre-rotary when the model gives rotary coordinates) and V; `predictive_recipe` fits every head
with `fit.predictive.fit_head` at `bits` per component, as the fitter's first step does (no
search, no closed-loop selection: a recipe of the right kind and size, not a tuned one).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import Attended, KVCache
from calibrate.fit.predictive import fit_head
from calibrate.predictive_roles import stack_heads
from calibrate.recipe import LayerSpec, Recipe, Scheme, TensorSpec, TokenPolicy
from calibrate.types import ModelInfo


class Moments:
    """Per layer and head: count, sum x, sum x x^T, sum dx dx^T of K (as stored) and V, float64."""

    def __init__(self, num_layers: int):
        self.sums: dict[tuple[int, str], list] = {}
        self.prev: dict[tuple[int, str], Tensor] = {}
        self.num_layers = num_layers

    def add(self, layer: int, kind: str, x_BHTD: Tensor) -> None:
        x = x_BHTD.detach().double().transpose(0, 1).flatten(1, 2)  # [H, N, D]
        key = (layer, kind)
        H, N, D = x.shape
        if key not in self.sums:
            self.sums[key] = [0, torch.zeros(H, D, dtype=torch.float64, device=x.device),
                              torch.zeros(H, D, D, dtype=torch.float64, device=x.device),
                              torch.zeros(H, D, D, dtype=torch.float64, device=x.device), 0]
        s = self.sums[key]
        s[0] += N
        s[1] += x.sum(1)
        s[2] += x.transpose(1, 2) @ x
        if key in self.prev and self.prev[key].shape == x.shape:
            d = x - self.prev[key]
            s[3] += d.transpose(1, 2) @ d
            s[4] += N
        self.prev[key] = x

    def stats(self, layer: int, kind: str) -> tuple[Tensor, Tensor, Tensor]:
        n, s1, s2, sd, nd = self.sums[(layer, kind)]
        mean = s1 / n
        cov = s2 / n - mean[:, :, None] * mean[:, None, :]
        return mean.float().cpu(), cov.cpu(), (sd / max(nd, 1)).cpu()


class MomentCache(KVCache):
    """The full-precision cache that feeds `Moments` with what every attend call stores."""

    def __init__(self, num_layers: int, window: int, sink_frames: int, moments: Moments, pre_rotary: bool):
        super().__init__(num_layers, window, sink_frames)
        self.moments, self.pre_rotary = moments, pre_rotary

    def observe(self, seen: Attended) -> None:
        self.moments.add(seen.layer, "k", seen.k_BHTD if self.pre_rotary else seen.k_rot_BHTD)
        self.moments.add(seen.layer, "v", seen.v_BHTD)


def predictive_recipe(info: ModelInfo, moments: Moments, bits: float = 2.5, rotary_coords: int = 0,
                      name: str = "predictive") -> Recipe:
    """Every layer's K and V predictive, each head fitted by `fit_head` from `moments`."""
    tensors, layers = {}, []
    for i in range(info.num_layers):
        specs = {}
        for kind in "kv":
            mean, cov, dcov = moments.stats(i, kind)
            heads = [fit_head(mean[h], cov[h], dcov[h], bits) for h in range(info.num_kv_heads)]
            roles = stack_heads(heads)
            tensors.update({f"layers.{i}.{kind}.{r}": t.contiguous() for r, t in roles.items()})
            specs[kind] = TensorSpec(bits=2, kind="predictive", rotation="learned",
                                     rotary_coords=rotary_coords if kind == "k" else 0,
                                     token_bits=roles["channel_bits"].sum(-1).tolist(),
                                     anchor_token_bits=roles["anchor_bits"].sum(-1).tolist())
        layers.append(LayerSpec(**specs))
    return Recipe(info, Scheme(name, layers, TokenPolicy(sink_frames=0, recent_frames=0),
                               notes=f"fit_head at {bits} bits per component (benchmark)"), tensors)
