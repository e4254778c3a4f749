"""The fit's trace: a bounded token sample of the calibration frames, per layer.

The teacher-forced objective (fit/objective.py) replays recorded frames: every traced frame's
queries, keys and values, with the history quantized. Keeping every token of every frame is
what stopped a real-size model (Wan2.1-1.3B: 30 layers x 12 heads x 128 channels x 4680 tokens
per cache frame is ~138 GB per trajectory in float32). So the recorder keeps, of the first
`B'` calibration trajectories (whichever replay batches they fall in) and their first `F` cache
frames, a fixed sample of `S` token slots:

- the same slots in every frame and layer: a token's chain of frames stays whole (the
  predictive code predicts a slot from the same slot in the previous frame), and the sampled
  queries attend to the sampled keys, so the objective is that of the model restricted to
  those slots (at TinyWorld's 16 tokens per frame every slot is kept and nothing changes);
- one copy: queries, keys *before* the rotary encoding and values, in the trace's dtype (the
  dtype the model computes K/V in: float32, or bfloat16 for a bf16 Wan, whose K/V are exact in
  bfloat16), plus each slot's rotary angles in float32; rotated keys are recomputed when a
  layer is scored (`Trace.layer`);
- on the configured device (the GPU next to the model, where the fit then runs).

Bytes, with L layers, H kv heads, D head_dim, A = D / 2 rotary angles per token and e bytes per
element of the trace's dtype:

    per slot   = B' * F * (3 * L * H * D * e + 4 * A)
    S          = min(T, fit.trace_tokens, floor(fit.trace_bytes / per slot))
    trace      = S * per slot

`B'` = min(fit.trace_trajectories, the calibration trajectories); `F` = min(fit.trace_frames,
the calibration trajectories' cache frames) (calibration.trace_plan). `plan_trace` refuses a
budget that holds no slot, before any replay.

Shape legend: B' traced trajectories, H heads, F frames, S sampled slots, D head_dim, A angles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from calibrate.cache import Rope
from calibrate.fit.objective import LayerTrace
from calibrate.types import ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TracePlan:
    """What the recorder keeps: `trajectories` x `frames` x `slots` of the model's tokens."""

    num_layers: int
    num_heads: int
    head_dim: int
    trajectories: int  # B'
    frames: int  # F
    slots_S: Tensor  # token slots kept in every frame, sorted, int64 [S]
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return int(self.slots_S.numel())

    def nbytes(self) -> int:
        """Bytes of the full trace: S * B' * F * (3 L H D e + 4 A)."""
        return self.num_slots * slot_bytes(self.num_layers, self.num_heads, self.head_dim, self.trajectories,
                                           self.frames, element_size(self.dtype))


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slot_bytes(num_layers: int, num_heads: int, head_dim: int, trajectories: int, frames: int, elem: int) -> int:
    """Bytes one token slot costs in the trace: its q, pre-rotary k and v in every layer, and its angles."""
    return trajectories * frames * (3 * num_layers * num_heads * head_dim * elem + 4 * (head_dim // 2))


def plan_trace(info: ModelInfo, trajectories: int, frames: int, max_tokens: int, max_bytes: int,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> TracePlan:
    """The slots to keep under `max_tokens` per frame and `max_bytes` in all (module docstring);
    a ValueError naming `fit.trace_bytes` when not one slot fits. Slots are drawn without
    replacement from a generator seeded by `seed` (all of them when all fit)."""
    T = info.tokens_per_frame
    per_slot = slot_bytes(info.num_layers, info.num_kv_heads, info.head_dim, trajectories, frames, element_size(dtype))
    num = min(T, max_tokens, max_bytes // per_slot)
    if num < 1:
        raise ValueError(f"config: fit.trace_bytes={max_bytes} holds not one token per frame of this model: one slot "
                         f"of {trajectories} trajectories x {frames} frames costs {per_slot} bytes (lower "
                         f"fit.trace_frames or fit.trace_trajectories, or raise fit.trace_bytes)")
    if num == T:
        slots = torch.arange(T)
    else:
        slots = torch.randperm(T, generator=torch.Generator().manual_seed(seed))[:num].sort().values
    return TracePlan(info.num_layers, info.num_kv_heads, info.head_dim, trajectories, frames, slots, dtype)


class Trace:
    """The traced frames: per layer q, pre-rotary k, v [B', H, F, S, D] and the slots' rotary
    angles [B', F, S, A], filled frame by frame as the replay observes them, each replay batch
    into its own rows (trajectory i of the replay is row i)."""

    def __init__(self, plan: TracePlan, device: torch.device | str = "cpu"):
        self.plan = plan
        self.device = torch.device(device)
        self.q: list[Tensor] = []
        self.k_pre: list[Tensor] = []
        self.v: list[Tensor] = []
        self.angles: Tensor | None = None
        self.rotary_coords = 0  # coordinates the model's rotary gives per frame (0: none)
        self.num_frames = 0  # frames filled (every layer, every row)
        self._filled = [0] * plan.trajectories  # frames filled per row
        self._slots = plan.slots_S.to(self.device)

    def _allocate(self, A: int) -> None:
        p = self.plan
        shape = (p.trajectories, p.num_heads, p.frames, p.num_slots, p.head_dim)
        for store in (self.q, self.k_pre, self.v):
            store.extend(torch.empty(shape, dtype=p.dtype, device=self.device) for _ in range(p.num_layers))
        self.angles = torch.empty(shape[0], p.frames, p.num_slots, A, dtype=torch.float32, device=self.device)
        log.info("trace: %d trajectories x %d frames x %d of the frames' tokens, %.1f MiB (%s)", shape[0], p.frames,
                 p.num_slots, self.nbytes() / 2**20, p.dtype)

    def put(self, layer: int, index: int, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, rope: Rope,
            row: int = 0) -> None:
        """Keep frame `index` of `layer` (pre-rotary keys) of a batch whose first trajectory is
        row `row`, if the frame and some of the batch's trajectories are among the traced ones."""
        p = self.plan
        if index >= p.frames or row >= p.trajectories:
            return
        if not self.q:
            self._allocate(rope.angles_BTA.shape[-1])
        b = min(q_BHTD.shape[0], p.trajectories - row)
        rows = slice(row, row + b)
        for store, x in ((self.q, q_BHTD), (self.k_pre, k_BHTD), (self.v, v_BHTD)):
            store[layer][rows, :, index] = x[:b].index_select(2, self._slots).to(store[layer].dtype)
        if layer == 0:
            angles = rope.angles_BTA.index_select(1, self._slots)
            self.angles[rows, index] = angles.expand(b, -1, -1) if angles.shape[0] == 1 else angles[:b]
            coords = rope.coords_BP
            self.rotary_coords = 0 if coords is None or rope.at is None else coords.shape[-1]
        if layer == p.num_layers - 1:
            self._filled[rows] = [index + 1] * b
            self.num_frames = min(self._filled)

    def nbytes(self) -> int:
        """Bytes of the tensors held (all of them are allocated at the first frame; with several
        processes each holds the layers it fits, `distributed.gather_trace`)."""
        return sum(t.numel() * t.element_size() for t in self.q + self.k_pre + self.v if t is not None) + \
            (0 if self.angles is None else self.angles.numel() * 4)

    def layer(self, layer: int, window: int, sink_frames: int, trajectories: int | None = None,
              heads: slice = slice(None)) -> LayerTrace:
        """The objective's view of `layer` (float32; keys rotated again from their angles), over the
        frames filled, the first `trajectories` traced trajectories (all by default) and `heads`."""
        if not self.q:
            raise ValueError("calibration recorded no frames to fit on (empty calibration set?)")
        if self.q[layer] is None:
            raise RuntimeError(f"layer {layer}'s trace is held by another process")
        b, f = trajectories or self.q[layer].shape[0], self.num_frames
        q, k_pre, v = (x[layer][:b, heads, :f].float() for x in (self.q, self.k_pre, self.v))
        angles = self.angles[:b, :f]
        out = LayerTrace(q, None, v, window=window, sink_frames=sink_frames, k_pre=k_pre, angles=angles)
        out.k = out.rotate(k_pre)
        return out


class LayerTraces:
    """Every layer's `LayerTrace`, made when asked for (a sequence the fitters index and iterate):
    the rotated keys of a layer exist only while that layer is scored."""

    def __init__(self, trace: Trace, window: int, sink_frames: int, trajectories: int | None = None):
        self.trace, self.window, self.sink_frames, self.trajectories = trace, window, sink_frames, trajectories

    def __len__(self) -> int:
        return self.trace.plan.num_layers

    def __getitem__(self, layer: int) -> LayerTrace:
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        return self.trace.layer(layer, self.window, self.sink_frames, self.trajectories)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def head(self, layer: int, head: int) -> LayerTrace:
        """`layer`'s view of one head (its objective depends on nothing else)."""
        return self.trace.layer(layer, self.window, self.sink_frames, self.trajectories, slice(head, head + 1))
