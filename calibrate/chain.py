"""How a predictive tensor's frames are stored: a chain of delta frames behind one anchor.

A `kind="predictive"` spec (quant/predictive.py) codes frame f of a head against the previous
frame's integer state, so the cache holds its frames as a chain. Each held frame of one head is
stored in one of three forms:

- **delta** `{"modes", "codes"}`: one bit per token (1 = inter) packed along T as 1-bit
  fields (quant/fields.py: 8 tokens per byte, LSB first), and the token's code fields
  packed with the per-component widths `channel_bits` (quant/fields.py). Decoding needs the
  previous frame's states (none if every token is intra, as in the first frame of a rollout);
- **anchor** `{"anchor"}`: the states themselves, v + 2^(a-1) packed with the widths
  `anchor_bits`. A frame whose predecessor is not held (evicted from the window) is stored as
  an anchor, so every held frame decodes from held frames only. Re-storing a delta frame as an
  anchor is exact (integers in, the same integers out);
- **recent** `{"fp16"}`: the newest `recent_frames` frames in float16; a frame leaving that
  window is coded against its predecessor's states, from its float16 copy.

`frame_role` is the rule shared by the runtime and the memory model; `frame_nbytes` counts the
bytes of each form from the spec alone. `ChainCodec` holds one head's `PredictiveParams` and
turns a frame into its stored form and back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.quant import predictive as P
from calibrate.quant.fields import FieldLayout

FP = torch.float16


def frame_role(index: int, num_appended: int, kept: set[int] | list[int], recent_frames: int,
               temporal: bool = True) -> str:
    """'recent', 'anchor' or 'delta': how frame `index` of a predictive tensor is held (without
    `temporal` every frame is standalone: no anchors)."""
    if recent_frames > 0 and index >= num_appended - recent_frames:
        return "recent"
    if temporal and index > 0 and (index - 1) not in kept:
        return "anchor"
    return "delta"


def frame_nbytes(role: str, token_bits: int, anchor_token_bits: int, B: int, T: int, D: int) -> int:
    """Bytes of one head of one frame held in `role` (token_bits = sum of channel_bits, anchor
    likewise): delta = modes + codes, anchor = states, recent = float16."""
    if role == "recent":
        return 2 * B * T * D
    if role == "anchor":
        return B * T * -(-anchor_token_bits // 8)
    return B * -(-T // 8) + B * T * -(-token_bits // 8)


class ChainCodec:
    """One head's predictive code and the packing of its stored forms (layouts computed once)."""

    def __init__(self, params: P.PredictiveParams, temporal: bool = True):
        self.params = params
        self.temporal = temporal  # False: every token intra (the spec's `temporal`)
        device = params.unit_D.device
        self._codes = FieldLayout(params.bits_D, device)
        self._anchors = FieldLayout(params.anchor_bits_D, device)
        self._modes: dict[int, FieldLayout] = {}  # tokens per frame -> 1-bit layout

    def _mode_layout(self, T: int) -> FieldLayout:
        if T not in self._modes:
            self._modes[T] = FieldLayout([1] * T, self.params.unit_D.device)
        return self._modes[T]

    def encode(self, x_BTD: Tensor, v_prev: Tensor | None) -> tuple[dict[str, Tensor], Tensor]:
        """(stored delta frame, its states) of one frame; `v_prev` None = first frame of a chain."""
        inter, codes, v = P.encode(x_BTD, self.params, v_prev if self.temporal else None)
        stored = {"modes": self._mode_layout(inter.shape[-1]).pack(inter.to(torch.int64)), "codes": self._codes.pack(codes)}
        return stored, v

    def anchor(self, v_BTD: Tensor) -> dict[str, Tensor]:
        return {"anchor": self._anchors.pack(P.anchor_fields(v_BTD, self.params))}

    def states(self, stored: dict[str, Tensor], v_prev: Tensor | None) -> Tensor:
        """The integer states of a delta or anchor frame."""
        if "anchor" in stored:
            return P.from_anchor_fields(self._anchors.unpack(stored["anchor"]), self.params)
        inter = self._mode_layout(stored["codes"].shape[-2]).unpack(stored["modes"]).bool()
        return P.apply_codes(inter, self._codes.unpack(stored["codes"]), v_prev, self.params)

    def chain_states(self, frames: list[int], stored: list[dict[str, Tensor]]) -> list[Tensor]:
        """States of held frames `frames` (ascending) from their stored forms: a frame decodes
        from its predecessor's states when that is held, else it is an anchor or all-intra. The
        delta frames are unpacked in one batch."""
        deltas = [i for i, s in enumerate(stored) if "anchor" not in s]
        unpacked = {}
        if deltas:
            T = stored[deltas[0]]["codes"].shape[-2]
            modes = self._mode_layout(T).unpack(torch.stack([stored[i]["modes"] for i in deltas])).bool()
            codes = self._codes.unpack(torch.stack([stored[i]["codes"] for i in deltas]))
            unpacked = {i: (modes[j], codes[j]) for j, i in enumerate(deltas)}
        out: list[Tensor] = []
        for i, f in enumerate(frames):
            if i not in unpacked:
                out.append(self.states(stored[i], None))
                continue
            prev = out[i - 1] if i > 0 and frames[i - 1] == f - 1 else None
            out.append(P.apply_codes(*unpacked[i], prev, self.params))
        return out

    def values(self, v_BTD: Tensor) -> Tensor:
        return P.values(v_BTD, self.params)


def token_bits(params: P.PredictiveParams) -> tuple[int, int]:
    """(code bits, anchor bits) per token of one head."""
    return int(params.bits_D.sum()), int(params.anchor_bits_D.sum())


__all__ = ["ChainCodec", "frame_nbytes", "frame_role", "token_bits"]
