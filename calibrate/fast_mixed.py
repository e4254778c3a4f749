"""The runtime's store for a layer that mixes kinds: one tensor predictive, the other coded per frame.

The format allows it (recipes/FORMAT.md: every tensor names its own kind), and `benchmarks.fit`
makes such layers when it holds one tensor of a predictive recipe in float16 to see how much of the
error it carries. `MixedStore` pairs a `fast_chain.ChainStore` of the predictive tensor with a
`fast_frames.FrameStore` of the other: each stores and evicts its own tensor as it would beside a
partner of its own kind, so bytes and codes are theirs. The two order their frames differently
(chain frames and a recent ring; pools by precision class), so attention reads the history as one
block, K and V of the held frames in frame order: a step's transient memory is the layer's history
in float32 (the other stores decode a workspace-sized block at a time). No memory plan and no logit
correction run on such a layer (`fastcache.fast_path_problem`).
"""

from __future__ import annotations

from calibrate.cache import kept_frames
from calibrate.fast_chain import ChainStore
from calibrate.fast_frames import FrameStore


class MixedStore:
    """A layer's predictive tensor in `predictive` and its per-frame tensor in `per_frame` (see the module docstring)."""

    single_block = True

    def __init__(self, chain: ChainStore, frames: FrameStore, window: int, sink_frames: int):
        self.predictive, self.per_frame = chain, frames
        self.window, self.sink = window, sink_frames

    def plan(self, B: int, budget: int) -> int:
        return (self.sink + self.window) * self.predictive.T  # keys of the one block (see the module docstring)

    def step(self, index: int, k_BHTD, v_BHTD, rope=None, decode: bool = True):
        """Store frame `index` in both stores and, when `decode`, yield the history it attends to."""
        for store in (self.predictive, self.per_frame):
            for _ in store.step(index, k_BHTD, v_BHTD, rope, decode=False):
                pass
        if decode:
            yield from self.history(index + 1, rope, exclude=index)

    def history(self, n: int, rope=None, exclude: int | None = None):
        """The held history without frame `exclude` as one block (k post-rotary, v, None)."""
        frames = [f for f in kept_frames(n, self.window, self.sink) if f != exclude]
        if self.predictive.B is None or not frames:
            return
        yield *self.read(n, frames, rope), None

    def read(self, n: int, frames: list[int], rope) -> tuple:
        """Post-rotary K and V [B, H, F*T, D] of held `frames`, in that order, each from its store."""
        (k, v), (k2, v2) = self.predictive.read(n, frames, rope), self.per_frame.read(n, frames, rope)
        return (k if k is not None else k2), (v if v is not None else v2)

    def bias_fn(self, q_BHTD):
        return None

    def logit_bias(self, n: int, q_BHTD, frames: list[int]) -> None:
        return None

    def nbytes(self, n: int) -> int:
        return self.predictive.nbytes(n) + self.per_frame.nbytes(n)

    def capacity_nbytes(self) -> int:
        return self.predictive.capacity_nbytes() + self.per_frame.capacity_nbytes()
