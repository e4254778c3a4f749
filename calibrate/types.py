"""What world models and the compiler share: plain data, no behaviour of either side.

A model (TinyWorld, an adapter) describes itself with a `ModelInfo` and is driven over
`Trajectory` values; the compiler (replay, fitting, the recipe, the runtime, evaluation) reads
the same two. Neither side imports the other for them: both import this module, which imports
nothing of the project.

- `ModelInfo`: the shape of a model's KV cache (layers, kv heads, head_dim, tokens per cache
  frame) and a fingerprint of its weights; a recipe records it and is checked against it.
- `Trajectory`: camera poses and the actions between them, of one `FAMILIES` family, from a
  seed. TinyWorld's generators (world/trajectories.py) make them; any model may be driven by them.
- `weights_fingerprint`: the short hash of a module's weights that `ModelInfo.fingerprint` holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

FAMILIES = ("orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static")
# Families made on request only (not in the default sets, which iterate FAMILIES): `long_revisit`
# wanders away for 64-512 frames before returning (the memory-plan benchmark and plan search).
LONG_FAMILIES = ("long_revisit",)
ALL_FAMILIES = FAMILIES + LONG_FAMILIES


@dataclass
class ModelInfo:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_frame: int
    fingerprint: str

    @property
    def elements_per_frame(self) -> int:
        """K and V elements of one frame in one layer."""
        return 2 * self.num_kv_heads * self.tokens_per_frame * self.head_dim


def check_family(family: str) -> None:
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown trajectory family {family!r}; allowed: {', '.join(ALL_FAMILIES)}")


@dataclass(frozen=True)
class Trajectory:
    """Poses [T, 3] (x, y, unwrapped yaw) and actions [T, 3] (forward, strafe_left, dyaw), float32."""

    family: str
    seed: int
    poses: Tensor
    actions: Tensor

    def __post_init__(self) -> None:
        check_family(self.family)
        if self.poses.ndim != 2 or self.poses.shape[1] != 3 or self.poses.shape[0] == 0:
            raise ValueError(f"poses must have shape [T, 3] with T >= 1, got {tuple(self.poses.shape)}")
        if self.actions.shape != self.poses.shape:
            raise ValueError(f"actions shape {tuple(self.actions.shape)} != poses shape {tuple(self.poses.shape)}")

    @property
    def num_frames(self) -> int:
        return int(self.poses.shape[0])


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short, stable hash of the weights (recipes record which model they were fitted on)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
