"""Helpers of the fast runtime's stores (fast_chain.py, fast_frames.py, fastcache.py): index
tensors made once per slot list, and a frame's tokens taken one block at a time."""

from __future__ import annotations

import torch
from torch import Tensor


class IndexTensors:
    """Index tensors of integer lists, made once per list: a step's slot lists repeat from step to
    step, and a host-to-device tensor per list and step would be work on the hot path."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.device, self.capacity = device, capacity
        self.made: dict[tuple, Tensor] = {}

    def __call__(self, values: list[int]) -> Tensor:
        key = tuple(values)
        if key not in self.made:
            if len(self.made) > self.capacity:
                self.made.clear()
            self.made[key] = torch.tensor(values, dtype=torch.long, device=self.device)
        return self.made[key]


def token_block(x, tokens: slice) -> Tensor:
    """Tokens of a frame given as a tensor [B, H, T, D] or as something with `block(tokens)`
    (`fastcache.RotatedKeys`: post-rotary keys made a block at a time)."""
    return x[:, :, tokens] if isinstance(x, Tensor) else x.block(tokens)

