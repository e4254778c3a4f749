"""The adapter API: what the pipeline needs from a world model to replay, calibrate and evaluate it.

A model takes part through two things only:

- the `KVCache` seam (calibrate/cache.py): every self-attention layer hands the cache one cache
  frame of queries, pre-rotary keys, values and the keys' rotary encoding, and gets the
  attention output back. `cache.attend` stores the frame's K/V; `cache.attend_uncommitted`
  attends the same way without storing (diffusion models' denoising passes, whose noisy K/V
  are not what later frames should see);
- a `WorldAdapter` (this protocol): the model's shape (`info`), a rollout of a batch of
  trajectories through a given cache, ground truth when the model has a renderer, and a
  preview of its frames as RGB for the GIF strips.

A *cache frame* is the unit the model appends per generation step: one frame for TinyWorld,
one chunk of `chunk_frames` latent frames for Wan (`info.tokens_per_frame` counts its tokens).
Everything downstream (statistics, fitting, the recipe, the runtime, evaluation, the CI gate)
sees only `info` and what passes through the cache, so a new model needs an adapter and nothing
else. Adapters live next to this file; `calibrate.adapters.load_world` picks one by
`model.name`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from calibrate.cache import KVCache
from calibrate.types import ModelInfo, Trajectory


class AdapterError(ValueError):
    """A model that cannot be loaded as configured (missing extra, bad path, wrong shapes)."""


class WorldAdapter(Protocol):
    info: ModelInfo  # layers, kv heads, head_dim, tokens per cache frame, weights fingerprint

    def rollout(self, trajs: list[Trajectory], cache: KVCache, device: torch.device, truth: Tensor | None = None,
                keep_frames: bool = True, progress: Callable[[int], None] | None = None) -> Tensor:
        """Free rollout of trajectories of equal length through `cache`: frames [B, N, C, H, W].

        Deterministic for given weights and trajectories (noise, if any, is seeded from each
        trajectory's seed). `truth` (from `ground_truth`) may supply given frames, e.g. the first.
        With `keep_frames=False` only the last frame is returned ([B, 1, C, H, W]) so memory
        does not grow with the rollout. `progress(n)` is called as n more frames are done.
        """
        ...

    def ground_truth(self, trajs: list[Trajectory], device: torch.device) -> Tensor | None:
        """True frames [B, N, C, H, W], or None for a model without a renderer (metrics against
        ground truth are then taken against the full-precision rollout)."""
        ...

    def preview(self, frames: Tensor) -> Tensor:
        """Frames [..., C, H, W] as RGB [..., 3, H, W] in [0, 1] for the GIF strips."""
        ...
