"""A quantized cache in two tiers: what attention reads on the device, what it can recall from the host.

A recipe with a memory plan (`calibrate/plan.py`, `scheme.policy.plan`) runs its cache in tiers:

- **device tier**: the sink frames and the newest `window` frames, held and coded exactly as a
  cache without a plan holds them, plus `recall_slots` slots of frames recalled from the
  host tier. Attention reads all of them at every step.
- **host tier**: a frame evicted from the window moves to the host tier at its stored precision
  (its packed codes; never a float copy), up to `host_frames` frames, the oldest dropped first.
  It must decode there on its own, so it moves in its *host form*:
  - a predictive tensor (chain.py) moves as an **anchor** of its integer states. The oldest
    frame of the window already is one (its predecessor was evicted before it), so in steady
    state its bytes move unchanged; only a frame whose predecessor is a sink (frame 1 with one
    sink) is re-stored, exactly, as an anchor when it leaves. Keeping the delta chain on the
    host instead (about 2.5x smaller for the shipped recipe) would make a recalled frame need
    every frame back to an anchor: decoding on the host or moving the chain, on every recall.
    Host memory is the cheap tier, so the plan spends it to keep recall a plain copy (the
    anchor bytes are counted: `host_frame_nbytes`). Without `temporal` every frame is intra
    and moves as stored;
  - a per-frame code moves as stored (its width is the spec's own: key frames and the span
    states of kind `prq` are not supported with a host tier and refused by `check_plan`).
  Keys stored before the rotary encoding move with their coordinates. With `recall="pose"` the
  host also keeps each frame's camera pose (3 float32 per trajectory: the pose index).
- **recall**: once per step, at its first layer (after that layer's eviction), the runtime picks
  for each trajectory of the batch the `recall_slots` host frames whose pose is nearest the pose
  being generated (`plan.pose_distance`: sqrt(dx^2 + dy^2 + (yaw_radius * wrap(dyaw))^2), ties
  to the newer frame). The model tells that pose with `cache.expect(coords)` before the step
  (TinyWorld: the camera pose its queries are rotated by); a model that does not falls back to
  the newest key's pose (the frame being continued). Every layer recalls the same frames. A
  recalled frame is held as its host form (an anchor) in a slot of the device tier; with
  `reuse="resident"` a slot that stays selected keeps its bytes, so only newly selected frames
  move host -> device; `"none"` recopies every slot at every step.

Byte accounting is exact and from the recipe alone: `predicted_device_bytes` (window and sinks
as `memory.predicted_cache_bytes`, plus the filled slots) equals the runtime's `nbytes()`,
`predicted_host_bytes` equals `HostTier.nbytes()`; the traffic (`Tiers.traffic`) is counted
from the rows really copied, host -> device (recalls) and device -> host (evictions).

On CUDA the host tier is pinned memory and both copies are issued `non_blocking` on the current
stream (ordered with the attention that reads them; the CPU never waits for them). On CPU both
tiers live in RAM: the interface and the accounting are the same.

Models without a camera pose (the Wan adapter's rotary coordinate is the chunk index) cannot
recall by pose: `recall="pose"` needs 3 rotary coordinates per frame and is refused otherwise
(one line, exit 2). They may still use a plan without recall (window, sinks, budget).

`Tiers` is a runtime's companion and knows no runtime: each runtime hands it the host form of a
frame leaving its window (`evicted`) and a slot's device buffers to recall into (`recall`): the
runtime (fastcache.py) does, its stores in their own layouts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import SLOT_BASE, Rope, kept_frames
from calibrate.codec import frame_nbytes, span_of
from calibrate.memory import (KINDS, STEADY_STATE_MARGIN, fp16_cache_bytes, fp16_frame_bytes, head_frame_nbytes,
                              predicted_cache_bytes, steady_phases)
from calibrate.plan import POSE_COORDS, MemoryPlan, pose_distance
from calibrate.recipe import Recipe, Scheme
from calibrate.types import ModelInfo

POSE_BYTES = 4 * POSE_COORDS  # one float32 pose (x, y, yaw) per trajectory and host frame


# ---- the byte model (from the recipe alone) ----------------------------------------------------
def slot_nbytes(model: ModelInfo, scheme: Scheme, batch: int = 1) -> int:
    """Bytes of one frame in host form over every layer: what a recall slot holds and what one
    frame costs the host tier (without the pose index)."""
    T, D = model.tokens_per_frame, model.head_dim
    total = 0
    for pair in scheme.layers:
        total += batch * pair.k.rotary_coords * 4
        for kind in KINDS:
            spec = getattr(pair, kind)
            for h in range(model.num_kv_heads):
                if spec.kind == "predictive":
                    total += head_frame_nbytes(spec, h, "anchor" if spec.temporal else "delta", batch, T, D)
                else:
                    total += frame_nbytes(spec, spec.bits_of(h), batch, T, D)
    return total


def host_frame_nbytes(model: ModelInfo, scheme: Scheme, plan: MemoryPlan, batch: int = 1) -> int:
    """Bytes one frame costs the host tier: its host form plus its pose (with recall by pose)."""
    return slot_nbytes(model, scheme, batch) + (POSE_BYTES * batch if plan.recall == "pose" else 0)


def host_count(plan: MemoryPlan, num_appended: int) -> int:
    """Frames the host tier holds after `num_appended` appends: every evicted frame, up to capacity."""
    evicted = num_appended - len(kept_frames(num_appended, plan.window, plan.sink_frames))
    return min(plan.host_frames, evicted)


def filled_slots(plan: MemoryPlan, num_appended: int) -> int:
    """Recall slots holding a frame after `num_appended` appends (the host may hold fewer frames)."""
    return min(plan.recall_slots, host_count(plan, num_appended))


def predicted_device_bytes(model: ModelInfo, scheme: Scheme, plan: MemoryPlan, num_appended: int,
                           batch: int = 1) -> int:
    """Bytes of the device tier after `num_appended` appends: window and sinks, plus filled slots."""
    return (predicted_cache_bytes(model, scheme, num_appended, plan.window, plan.sink_frames, batch)
            + filled_slots(plan, num_appended) * slot_nbytes(model, scheme, batch))


def predicted_bytes(model: ModelInfo, scheme: Scheme, num_appended: int, window: int, sink_frames: int,
                    batch: int = 1) -> int:
    """Bytes a cache of `scheme` holds on the device after `num_appended` appends: with a memory plan
    its device tier (`predicted_device_bytes`), else `memory.predicted_cache_bytes` of this window."""
    if scheme.policy.plan is not None:
        return predicted_device_bytes(model, scheme, scheme.policy.plan, num_appended, batch)
    return predicted_cache_bytes(model, scheme, num_appended, window, sink_frames, batch)


def predicted_host_bytes(model: ModelInfo, scheme: Scheme, plan: MemoryPlan, num_appended: int,
                         batch: int = 1) -> int:
    return host_count(plan, num_appended) * host_frame_nbytes(model, scheme, plan, batch)


def steady_device_bytes(model: ModelInfo, scheme: Scheme, plan: MemoryPlan) -> int:
    """The device tier's bytes per trajectory at steady state (window full, every slot filled),
    the largest over one period of the key-frame and span phases (as `memory.bits_per_element`)."""
    n0 = plan.sink_frames + plan.window + plan.recall_slots + STEADY_STATE_MARGIN
    return max(predicted_device_bytes(model, scheme, plan, n) for n in range(n0, n0 + steady_phases(scheme)))


def fp16_device_bytes(model: ModelInfo, scheme: Scheme, num_appended: int, window: int, sink_frames: int,
                      batch: int = 1) -> int:
    """`fp16_cache_bytes` of the frames a cache of `scheme` holds on the device: with a memory plan,
    the plan's window and sinks plus its filled recall slots (FORMAT.md, "Memory plan")."""
    plan = scheme.policy.plan
    if plan is None:
        return fp16_cache_bytes(model, num_appended, window, sink_frames, batch)
    return (fp16_cache_bytes(model, num_appended, plan.window, plan.sink_frames, batch)
            + filled_slots(plan, num_appended) * fp16_frame_bytes(model, batch))


def check_plan(recipe: Recipe) -> None:
    """ValueError (naming the recipe and the field) when the recipe's plan cannot run as written:
    a device tier above its budget, or a host tier with what a host form cannot hold."""
    plan, where = recipe.scheme.policy.plan, recipe.path or "recipe"
    if plan is None:
        return
    need = steady_device_bytes(recipe.model, recipe.scheme, plan)
    if need > plan.device_budget_bytes:
        raise ValueError(f"{where}: scheme.policy.plan: the device tier needs {need} bytes per trajectory at steady "
                         f"state ({plan.label()}), above its device_budget_bytes={plan.device_budget_bytes}")
    if not plan.host_frames:
        return
    policy = recipe.scheme.policy
    if policy.keyframe_interval:
        raise ValueError(f"{where}: scheme.policy.plan.host_frames: a host tier holds frames at the spec's own width; "
                         f"key frames (policy.keyframe_interval={policy.keyframe_interval}) are not supported with it")
    if policy.recent_frames >= plan.window:
        raise ValueError(f"{where}: scheme.policy.recent_frames={policy.recent_frames} must be below plan.window="
                         f"{plan.window}: evicted frames would leave in float16, and the host tier holds codes")
    for i, pair in enumerate(recipe.scheme.layers):
        for kind in KINDS:
            if span_of(getattr(pair, kind), 0) is not None:
                raise ValueError(f"{where}: scheme.layers[{i}].{kind}: kind 'prq' with span state is not supported "
                                 f"with a host tier (plan.host_frames={plan.host_frames})")


def device_window(recipe: Recipe, window: int, sink_frames: int) -> tuple[int, int]:
    """The window and sinks a cache of `recipe` keeps on the device: its memory plan's (refused by
    `check_plan` when it cannot run as written), or without a plan the ones asked for."""
    plan = recipe.scheme.policy.plan
    if plan is None:
        return window, sink_frames
    check_plan(recipe)
    return plan.window, plan.sink_frames


# ---- the host tier -------------------------------------------------------------------------------
# A record is one frame's host form in a layer: a tree (dicts and lists) of tensors whose first axis
# is the batch. Its structure is the runtime's own; the tiers only move and count it.
def tree_map(fn, record):
    if isinstance(record, dict):
        return {k: tree_map(fn, v) for k, v in record.items()}
    if isinstance(record, list):
        return [tree_map(fn, v) for v in record]
    return fn(record) if isinstance(record, Tensor) else record


def tree_leaves(record) -> list[Tensor]:
    if isinstance(record, dict):
        return [t for v in record.values() for t in tree_leaves(v)]
    if isinstance(record, list):
        return [t for v in record for t in tree_leaves(v)]
    return [record] if isinstance(record, Tensor) else []


def record_nbytes(record) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(record))


class HostTier:
    """Evicted frames per layer in host form, oldest first, at most `capacity` per layer, and the
    pose of each (`poses`, kept with layer 0's frames). Tensors live on the CPU, pinned when the
    device tier is on a GPU."""

    def __init__(self, num_layers: int, capacity: int, pinned: bool, keep_poses: bool):
        self.capacity = capacity
        self.pinned = pinned
        self.keep_poses = keep_poses
        self.frames: list[dict[int, dict]] = [{} for _ in range(num_layers)]
        self.poses: dict[int, Tensor] = {}

    def to_host(self, t: Tensor) -> Tensor:
        if not self.pinned:
            return t.cpu()  # the runtime hands over tensors it no longer writes
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)

    def put(self, layer: int, index: int, record: dict, pose_B3: Tensor | None) -> int:
        """Store one frame's host form; returns the bytes that moved device -> host."""
        moved = tree_map(self.to_host, record)
        self.frames[layer][index] = moved
        if layer == 0 and self.keep_poses:
            self.poses[index] = pose_B3
        if len(self.frames[layer]) > self.capacity:
            oldest = next(iter(self.frames[layer]))
            del self.frames[layer][oldest]
            if layer == 0:
                self.poses.pop(oldest, None)
        return record_nbytes(moved)

    def indices(self) -> list[int]:
        """Frames held (by layer 0), oldest first."""
        return list(self.frames[0])

    def nbytes(self) -> int:
        frames = sum(record_nbytes(r) for layer in self.frames for r in layer.values())
        return frames + sum(p.numel() * p.element_size() for p in self.poses.values())


# ---- the tiers of one cache ----------------------------------------------------------------------
class Tiers:
    """Host tier, recall rule, slot assignment and traffic counters of one cache with a plan.

    Runtime-agnostic: a runtime calls `before_append` before it stores a frame in a layer,
    `evicted` with the host form of each frame leaving its window, and `recall` after the append,
    handing it a function that gives the device record of a slot (a tree shaped like the host
    records, each tensor [B, ...] on the device: the runtime's own buffers or views of them);
    `recall` copies the selected rows into it and returns the slots it changed.
    """

    @classmethod
    def of(cls, recipe: Recipe, device: torch.device) -> "Tiers | None":
        """The tiers of a cache of `recipe`: None without a host tier (no plan, or a plan of window,
        sinks and budget alone)."""
        plan = recipe.scheme.policy.plan
        return cls(recipe.model.num_layers, plan, device, recipe.path or "") if plan and plan.host_frames else None

    def __init__(self, num_layers: int, plan: MemoryPlan, device: torch.device, where: str = ""):
        self.plan = plan
        self.where = where
        self.host = HostTier(num_layers, plan.host_frames, device.type == "cuda", plan.recall == "pose")
        self.query: Tensor | None = None  # coordinates told by `expect` for the coming step
        self.steps = 0  # frames appended (layer 0)
        self._poses: dict[int, Tensor] = {}  # pose of each frame on the device (layer 0's appends)
        self._selected_for = -1  # frame index whose step the current assignment belongs to
        self._assign: list[list[int]] = []  # [slot][row] -> host frame held there
        self._changed: list[tuple[int, int]] = []  # (slot, row) pairs the current step copies
        self.bytes_to_device = 0
        self.bytes_to_host = 0

    @property
    def filled(self) -> int:
        """Slots holding a frame (the same in every layer after a step's `recall`)."""
        return len(self._assign)

    def before_append(self, layer: int, index: int, key_rope: Rope) -> None:
        """Count the step and note the frame's pose (layer 0)."""
        if layer:
            return
        self.steps += 1
        if self.plan.recall != "pose":
            return
        coords = key_rope.coords_BP
        if coords is None or coords.shape[-1] != POSE_COORDS:
            got = "none" if coords is None else f"{coords.shape[-1]} (not a camera pose)"
            raise ValueError(f"recipe {self.where}: scheme.policy.plan.recall='pose' recalls host "
                             f"frames by camera pose (x, y, yaw): the model's rotary encoding must give "
                             f"{POSE_COORDS} coordinates per frame, it gives {got}; use a plan with recall 'none'")
        self._poses[index] = coords.detach().to(torch.float32).cpu().clone()

    def evicted(self, layer: int, index: int, record: dict) -> None:
        """Frame `index` leaves the device window: its host form goes to the host tier."""
        pose = self._poses.pop(index, None) if layer == 0 else None
        self.bytes_to_host += self.host.put(layer, index, record, pose)

    def recall(self, layer: int, index: int, slot_record) -> set[int]:
        """After the append of frame `index`: copy this step's selection into the layer's slots
        (`slot_record(s, like)`: the device record of slot s, shaped like host record `like`)."""
        if not self.plan.recall_slots:
            return set()
        if self._selected_for != index:
            self._select(index)
        host = self.host.frames[layer]
        for s, b in self._changed:
            source = host[self._assign[s][b]]
            for dst, src in zip(tree_leaves(slot_record(s, source)), tree_leaves(source), strict=True):
                dst[b].copy_(src[b], non_blocking=True)
                self.bytes_to_device += src[b].numel() * src[b].element_size()
        return {s for s, _ in self._changed}

    # -- the recall rule --------------------------------------------------------------------------
    def _select(self, index: int) -> None:
        """Pick each row's nearest host frames for the step that stores frame `index` and work out
        which (slot, row) pairs change (all of them without `reuse="resident"`)."""
        self._selected_for = index
        query = self.query if self.query is not None else self._poses.get(index)
        self.query = None
        newest_first = self.host.indices()[::-1]
        count = min(self.plan.recall_slots, len(newest_first))
        if count == 0:
            self._changed = []
            return
        poses_FB3 = torch.stack([self.host.poses[f] for f in newest_first])
        chosen = nearest(poses_FB3, query.detach().cpu(), self.plan.yaw_radius, count)  # [count, B] positions
        rows = poses_FB3.shape[1]
        previous = self._assign
        assign = [[-1] * rows for _ in range(count)]
        changed = []
        for b in range(rows):
            wanted = [newest_first[i] for i in chosen[:, b].tolist()]
            if self.plan.reuse == "resident":
                for s in range(min(len(previous), count)):
                    if previous[s][b] in wanted:
                        assign[s][b] = previous[s][b]
            free = iter(f for f in wanted if f not in {assign[s][b] for s in range(count)})
            for s in range(count):
                if assign[s][b] == -1:
                    assign[s][b] = next(free)
                    changed.append((s, b))
        self._assign, self._changed = assign, changed

    def traffic(self) -> dict:
        """Bytes moved so far, per direction, and per appended frame."""
        steps = max(self.steps, 1)
        return {"host_to_device_bytes": self.bytes_to_device, "device_to_host_bytes": self.bytes_to_host,
                "frames": self.steps, "host_to_device_per_frame": self.bytes_to_device / steps,
                "device_to_host_per_frame": self.bytes_to_host / steps}


def nearest(poses_FB3: Tensor, query_B3: Tensor, yaw_radius: float, count: int) -> Tensor:
    """Positions [count, B] of the `count` poses nearest the query in each row (the recall rule),
    nearest first; `poses_FB3` lists the candidates newest first, so equal distances go to the
    newer frame (a stable sort keeps that order)."""
    d_FB = pose_distance(poses_FB3, query_B3, yaw_radius)
    return torch.sort(d_FB, dim=0, stable=True).indices[:count]


__all__ = ["HostTier", "SLOT_BASE", "Tiers", "check_plan", "device_window", "host_count", "host_frame_nbytes", "nearest",
           "predicted_bytes", "predicted_device_bytes", "predicted_host_bytes", "record_nbytes", "slot_nbytes", "steady_device_bytes",
           "tree_leaves", "tree_map"]
