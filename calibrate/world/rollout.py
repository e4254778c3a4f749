"""Roll TinyWorld over camera poses through a cache: its own outputs fed back, or true frames.

Frame 0 is always the true first view; frame t (t >= 1) is generated at pose t from frame
t-1. In a free rollout frame t-1 is the model's own output (how the model is used); in a
teacher-forced rollout it is the true frame (how one-step quality is measured). Generated
frames are clamped to [0, 1] before being fed back, as a renderer would.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from calibrate.cache import KVCache
from calibrate.world.model import TinyWorld


@torch.no_grad()
def rollout(
    model: TinyWorld,
    cache: KVCache,
    first_frame_B3HW: Tensor,
    poses_BN3: Tensor,
    actions_BN3: Tensor,
    true_frames_BN3HW: Tensor | None = None,
    on_frame: Callable[[int, Tensor], None] | None = None,
    keep_frames: bool = True,
) -> Tensor:
    """Generate frames 0..N-1 [B, N, 3, H, W]; teacher-forced when `true_frames_BN3HW` is given.

    `on_frame(t, frame_B3HW)` is called after each generated frame (progress, streaming metrics).
    With `keep_frames=False` only the last frame is returned ([B, 1, 3, H, W]): memory stays
    constant however long the rollout (statistics replay needs only what the cache sees).
    """
    num_frames = poses_BN3.shape[1]
    frames = [first_frame_B3HW]
    prev = first_frame_B3HW
    for t in range(1, num_frames):
        pred = model.step(cache, prev, poses_BN3[:, t - 1], poses_BN3[:, t], actions_BN3[:, t]).clamp(0.0, 1.0)
        if not keep_frames:
            frames.clear()
        frames.append(pred)
        if on_frame is not None:
            on_frame(t, pred)
        prev = pred if true_frames_BN3HW is None else true_frames_BN3HW[:, t]
    return torch.stack(frames, dim=1)
