"""Where the fast runtime's per-frame store keeps a frame, and which per-frame specs it runs.

A frame's K/V of one layer are held at the width of its class (memory.frame_class: `recent`,
`sink`, `key` or `main`, the spec's width per head). `fast_frames.FrameStore` keeps one *pool*
per class: a set of slots a frame takes when it is coded and gives back when evicted. Each
pool's capacity is the most frames of its class a cache with this window ever holds
(`capacities`), so a steady-state step allocates nothing; kind prq with stages keeps a span
state per span in use (`span_capacity`). `problem` and `pair_problem` name what the
runtime does not run.
"""

from __future__ import annotations

from torch import Tensor

from calibrate.cache import kept_frames
from calibrate.codec import span_of
from calibrate.codes import KINDS
from calibrate.memory import frame_class
from calibrate.recipe import TensorSpec, TokenPolicy

CLASSES = ("recent", "sink", "key", "main")


def pair_problem(k: TensorSpec, v: TensorSpec) -> str | None:
    """Why a layer's per-frame K and V have no fast path together, or None."""
    if (k.prq_deferred, k.prq_span_frames) != (v.prq_deferred, v.prq_span_frames) and (k.prq_deferred or v.prq_deferred):
        return "K and V with different deferred spans (prq_deferred, prq_span_frames)"
    return None


def problem(spec: TensorSpec, D: int, policy: TokenPolicy) -> str | None:
    """Why a per-frame spec has no fast path, or None."""
    if KINDS[spec.kind].quantize is None:
        return f"kind '{spec.kind}'"
    if spec.jensen and not KINDS[spec.kind].uniform_step:
        return f"the Jensen correction on kind '{spec.kind}'"
    if D % 8:
        return f"head_dim {D} is not a multiple of 8 (codes of a token are packed in blocks of 8)"
    return None


class Pool:
    """The slots of one class: per tensor (K, V), per group of heads, buffers [B, Hg, cap, ...]."""

    def __init__(self, name: str, widths: dict[str, list[int]], capacity: int):
        self.name, self.widths, self.capacity = name, widths, capacity
        self.free = list(range(capacity))
        self.frame_slot: dict[int, int] = {}
        self.buffers: dict[str, list[dict[str, Tensor]]] = {}
        self.slot_bytes = 0

    def alloc(self, frame: int) -> int:
        slot = self.free.pop(0) if self.name != "recent" else frame % self.capacity
        self.frame_slot[frame] = slot
        return slot

    def release(self, frame: int) -> None:
        slot = self.frame_slot.pop(frame)
        if self.name != "recent":
            self.free.append(slot)
            self.free.sort()


class SpanStates:
    """Kind prq's span states of one tensor: `states` [B, H, slots, stages, C, D] float16, the slot
    of each span in use, and the heads whose state for that span is fitted."""

    def __init__(self):
        self.states: Tensor | None = None
        self.slot: dict[int, int] = {}
        self.fitted: dict[int, set[int]] = {}

    def slot_of(self, span: int) -> int:
        """The slot of `span`'s state, taking a free one for a span without one."""
        if span not in self.slot:
            self.slot[span] = min(set(range(self.states.shape[2])) - set(self.slot.values()))
            self.fitted[span] = set()
        return self.slot[span]

    def release(self, live: dict[int, set[int]]) -> None:
        """Keep each span's states only for the heads that still hold a frame of it below 16 bits
        (`live`); a span no head holds gives its slot to new spans."""
        for span in list(self.slot):
            if span in live:
                self.fitted[span] &= live[span]
            else:
                del self.slot[span], self.fitted[span]


def capacities(pol: TokenPolicy, window: int, sink_frames: int) -> dict[str, int]:
    """The most frames of each class a cache of this window holds at once (simulated over a few
    key-frame periods): each class's pool capacity."""
    W, S = window, sink_frames
    most = dict.fromkeys(CLASSES, 0)
    horizon = S + W + pol.recent_frames + 3 * max(pol.keyframe_interval, 1) + 4
    for n in range(1, horizon):
        count = dict.fromkeys(CLASSES, 0)
        for f in kept_frames(n, W, S):
            count[frame_class(pol, f, n)] += 1
        most = {c: max(most[c], count[c]) for c in CLASSES}
    if pol.recent_frames:
        most["recent"] = pol.recent_frames
    return most


def span_capacity(spec: TensorSpec, pol: TokenPolicy, window: int, sink_frames: int) -> int:
    """The most spans in use at once (an upper bound): those of the frames held before a step,
    and the span of the frame it writes, before the evicted frames' spans are dropped."""
    W, S = window, sink_frames
    horizon = S + W + pol.recent_frames + 3 * spec.prq_span_frames + 4
    return max(len({span_of(spec, f) for f in kept_frames(n, W, S)} | {span_of(spec, n)}) for n in range(horizon))
