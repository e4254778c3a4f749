"""A memory plan's host tier and recall slots on the fast runtime's chain store (fast_chain.py).

`ChainHostTier` is a part of `fast_chain.ChainStore`: the host form of the frame a step evicts
(self-contained: an anchor, or without `temporal` intra codes and modes, with its hold bits),
and the recall slots (tiers.py fills them with host forms) decoded as blocks of keys and values.
A recalled frame's held tokens take the current reference of the sink hold, as every frame does.
"""

from __future__ import annotations

import torch

from calibrate.cache import SLOT_BASE


class ChainHostTier:
    """Host forms and recall slots of a `ChainStore` (its buffers, `code`, `_holds`, `_block`)."""

    def _host_form(self, f: int) -> dict:
        """Frame f (leaving the window) self-contained: its anchor (the held one, or a buffer the step
        packs from f's states), or without `temporal` its intra codes and modes as stored."""
        holds = {"holds": self.holds[:, self.slot(f)].clone()} if self.code.hold else {}
        if not self.temporal:
            return {"codes": self.codes[:, self.slot(f)].clone(), "modes": self.modes[:, self.slot(f)].clone(), **holds}
        return {"anchor": self.anchor.clone() if f == self.anchor_frame else torch.empty_like(self.anchor), **holds}

    def take_evicted(self) -> tuple[int, dict] | None:
        """(frame, host form) of the frame the last step evicted, once."""
        out, self._evicted = self._evicted, None
        return out

    def slot_views(self, s: int) -> dict:
        """Recall slot s as views of its buffers, shaped like a host form."""
        return {name: t[:, s] for name, t in self.slots.items()}

    def set_filled(self, filled: int) -> None:
        self.filled = filled

    def recalled(self, rope=None):
        """Blocks (k post-rotary, v, None) of the filled recall slots; `rope` as in `step`."""
        if not self.filled:
            return
        S = self.filled
        cos, sin = rope([SLOT_BASE + s for s in range(S)]) if self.pre_rotary else (None, None)
        for t0 in range(0, self.T, self.token_block):
            tokens = slice(t0, min(t0 + self.token_block, self.T))
            if self.temporal:  # [B, S, G, Tb, Dc]
                states = self.code.anchor_states(self.slots["anchor"][:, :S, :, tokens])
            else:  # intra frames: a scan without predecessors
                modes = self.slots["modes"][:, :S, :, t0 // 8: -(-tokens.stop // 8)]
                states = self.code.scan(self.slots["codes"][:, :S, :, tokens], modes, None, -1)
            states = states.transpose(1, 2)  # heads before frames, as `values` takes them
            ref_w = None  # the sink hold's reference (the sink's code is unpacked only when it is the reference)
            if self.code.hold:
                ref_w = self._reference_w(tokens, None if self.code.refresh else self._sink_code(self.S, tokens))
            held = None if ref_w is None else (self._holds(self.slots["holds"][:, :S], tokens), self.code.hold_part(ref_w))
            out = self._block(states, None, tokens, cos, sin, None, held)
            states = held = None  # not alive while the next block decodes (as in ChainStore._run)
            yield out
            out = None
