"""The memory plan: how a recipe's cache is laid out over a device tier and a host tier.

Quantization is one of several levers on a KV cache's device memory; a sliding window, a cache
tiered out to host memory and the recall of old frames stack with it. A `MemoryPlan` (format
1.1, `scheme.policy.plan` of a recipe; `recipes/FORMAT.md`, "Memory plan") fixes them together
under one device budget:

- the **device tier** is what attention reads at every step: the first `sink_frames` frames,
  the newest `window` frames, and `recall_slots` frames recalled from the host tier;
- the **host tier** holds up to `host_frames` frames evicted from the window (the oldest is
  dropped when it is full), at their stored precision: the codes they had on the device, made
  self-contained (a predictive frame is held as an anchor), never a float copy;
- **recall**: before the attention of a step, the `recall_slots` host frames whose camera pose
  is nearest the pose being generated are placed in the device tier (`recall="pose"`; distance
  `sqrt(dx^2 + dy^2 + (yaw_radius * wrap(dyaw))^2)`, ties to the newer frame);
- **reuse**: with `reuse="resident"` a slot keeps its frame while it stays selected, so only
  newly recalled frames cross from host to device; `"none"` copies every slot at every step.

`device_budget_bytes` is what the device tier may hold per trajectory (batch 1) at steady
state; a runtime refuses a plan that exceeds it (`calibrate.tiers.check_plan`), and the fitter
never proposes one (`calibrate.fit.plan_search`). This module is the format only: the fields,
their defaults and their checks; it imports nothing of the project.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RECALL_KEYS = ("pose", "none")
REUSE_RULES = ("resident", "none")
POSE_COORDS = 3  # recall="pose" reads the keys' rotary coordinates as (x, y, yaw)


@dataclass
class MemoryPlan:
    device_budget_bytes: int  # the device tier's steady-state bytes per trajectory must not exceed it
    window: int = 16  # newest frames on the device (the frame being stored counts)
    sink_frames: int = 1  # first frames on the device forever
    recall_slots: int = 0  # host frames placed on the device at each step
    host_frames: int = 0  # host-tier capacity in frames (0 = no host tier)
    recall: str = "pose"  # what recall compares: "pose" (camera pose of the key rotary) or "none"
    yaw_radius: float = 1.0  # room units one radian of yaw counts as in the pose distance
    reuse: str = "resident"  # "resident": a slot keeps its frame while still selected; "none": recopied every step

    def check(self, where: str = "plan") -> None:
        """ValueError naming the field when a value is out of range or two fields disagree."""
        for name in ("device_budget_bytes", "window", "sink_frames", "recall_slots", "host_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}.{name}: {value!r} must be an integer")
        if self.device_budget_bytes <= 0:
            raise ValueError(f"{where}.device_budget_bytes: {self.device_budget_bytes} must be > 0")
        if self.window < 1:
            raise ValueError(f"{where}.window: {self.window} must be >= 1")
        for name in ("sink_frames", "recall_slots", "host_frames"):
            if getattr(self, name) < 0:
                raise ValueError(f"{where}.{name}: {getattr(self, name)} must be >= 0")
        if self.recall not in RECALL_KEYS:
            raise ValueError(f"{where}.recall: {self.recall!r} is not one of {', '.join(map(repr, RECALL_KEYS))}")
        if self.reuse not in REUSE_RULES:
            raise ValueError(f"{where}.reuse: {self.reuse!r} is not one of {', '.join(map(repr, REUSE_RULES))}")
        if not isinstance(self.yaw_radius, (int, float)) or isinstance(self.yaw_radius, bool) \
                or not math.isfinite(self.yaw_radius) or self.yaw_radius < 0:
            raise ValueError(f"{where}.yaw_radius: {self.yaw_radius!r} must be a finite number >= 0")
        if self.recall_slots and self.recall == "none":
            raise ValueError(f"{where}.recall_slots: {self.recall_slots} slots need a recall key (recall 'pose')")
        if self.recall_slots and not self.host_frames:
            raise ValueError(f"{where}.recall_slots: {self.recall_slots} slots recall from the host tier, "
                             f"which host_frames=0 leaves out")

    def label(self) -> str:
        """Short name, e.g. 'w16+1s+8r' (window, sinks, recall slots)."""
        return f"w{self.window}+{self.sink_frames}s" + (f"+{self.recall_slots}r" if self.recall_slots else "")


def pose_distance(poses_FB3, query_B3, yaw_radius: float):
    """Distance of each pose [F, B, 3] to the query [B, 3] (x, y, yaw): the recall rule's metric,
    sqrt(dx^2 + dy^2 + (yaw_radius * wrap(dyaw))^2) in float64 ([F, B])."""
    p, q = poses_FB3.double(), query_B3.double()
    dyaw = p[..., 2] - q[..., 2]
    dyaw = dyaw - 2 * math.pi * ((dyaw + math.pi) / (2 * math.pi)).floor()  # wrapped to [-pi, pi)
    return _sqrt((p[..., 0] - q[..., 0]).square() + (p[..., 1] - q[..., 1]).square()
                 + (yaw_radius * dyaw).square())


def _sqrt(x):
    """IEEE's correctly rounded root (FORMAT.md "Arithmetic"): torch's float64 CPU sqrt is MKL's,
    1 ulp off on 1.2% of inputs, which can reorder two nearly equal distances; numpy's is the
    hardware's, and so is CUDA's."""
    if x.device.type != "cpu":
        return x.sqrt()
    import numpy as np
    import torch

    return torch.from_numpy(np.sqrt(x.detach().contiguous().numpy()))


__all__ = ["MemoryPlan", "POSE_COORDS", "RECALL_KEYS", "REUSE_RULES", "pose_distance"]
