"""TinyWorld through the adapter API: frames are RGB, ground truth comes from the renderer."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from calibrate.cache import KVCache
from calibrate.types import ModelInfo, Trajectory, weights_fingerprint
from calibrate.world.model import TinyWorld
from calibrate.world.render import make_scene, render
from calibrate.world.rollout import rollout


class TinyWorldAdapter:
    def __init__(self, model: TinyWorld, name: str = "tinyworld"):
        self.model = model
        c = model.cfg
        self.info = ModelInfo(name=name, num_layers=c.num_layers, num_kv_heads=c.num_heads, head_dim=c.head_dim,
                              tokens_per_frame=c.tokens_per_frame, fingerprint=weights_fingerprint(model))

    def ground_truth(self, trajs: list[Trajectory], device: torch.device, first_only: bool = False) -> Tensor:
        return torch.stack([render(make_scene(t.seed), t.poses[:1] if first_only else t.poses) for t in trajs]).to(device)

    def rollout(self, trajs: list[Trajectory], cache: KVCache, device: torch.device, truth: Tensor | None = None,
                keep_frames: bool = True, progress: Callable[[int], None] | None = None) -> Tensor:
        """Frame 0 is the true first view (from `truth` when given), frames 1.. are generated."""
        first = truth[:, 0] if truth is not None else self.ground_truth(trajs, device, first_only=True)[:, 0]
        poses = torch.stack([t.poses for t in trajs]).to(device)
        actions = torch.stack([t.actions for t in trajs]).to(device)
        on_frame = (lambda t, f: progress(1)) if progress is not None else None
        return rollout(self.model, cache, first, poses, actions, on_frame=on_frame, keep_frames=keep_frames)

    def preview(self, frames: Tensor) -> Tensor:
        return frames
