"""The integer states of a chain of predictive frames, all frames at once (a segmented scan).

Along a chain of frames (quant/predictive.py) each token's state either restarts or moves:

    v_j = base_j               where the token is reset at frame j (intra-coded, or an anchor)
    v_j = v_(j-1) + step_j     where it is inter-coded

so v_j = base_L + step_(L+1) + ... + step_j with L the last reset at or before j. With
contrib_j = base_j at resets and step_j elsewhere and C the running sum of contrib along the
chain, that is C_j - (C_L - contrib_L): one cumulative sum, one cumulative max (for L) and one
gather, exact in integers, for every frame, token and component together. The first frame of
every chain is a reset (the first frame is intra, and a frame whose predecessor is not held is
an anchor), so L always exists.

Shapes: the frame axis is `dim` (1 below); contrib [B, J, T, G, D] int32, reset broadcastable
to it (one flag per token: [B, J, T, G, 1]).
"""

from __future__ import annotations

import torch
from torch import Tensor


def segmented_states(contrib: Tensor, reset: Tensor, dim: int = 1) -> Tensor:
    """States v_j (same shape and dtype as `contrib`) of the chain along `dim`."""
    J = contrib.shape[dim]
    total = torch.cumsum(contrib, dim=dim, dtype=contrib.dtype)
    before = total - contrib  # C_(j-1): the sum up to the frame before j
    shape = [1] * reset.dim()
    shape[dim] = J
    positions = torch.arange(J, device=contrib.device, dtype=torch.int64).view(shape)
    last_reset = torch.where(reset, positions, torch.zeros((), dtype=torch.int64, device=contrib.device) - 1)
    last_reset = torch.cummax(last_reset, dim=dim).values
    return total - torch.gather(before, dim, last_reset.expand_as(contrib).contiguous())
