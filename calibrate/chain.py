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
  window is coded against its predecessor's states, from its float16 copy;
- **sink** `{"sink"}` (format 1.3, a spec with `sink_token_bits`): a sink frame (f < the cache's
  sink count) in the sink code, its fields w + 2^(z-1) packed with the widths `sink_bits`; its
  states (quant/predictive.sink_states) start the chain like an anchor's.

With `sink_hold` (format 1.4) a delta frame and an anchor also hold `{"holds"}`: one bit per token
(1 = its uncoded components take the sink's values, quant/predictive.sink_hold), packed like the
modes. A delta frame re-stored as an anchor keeps its holds.

`frame_role` is the rule shared by the runtime and the memory model; `frame_nbytes` counts the
bytes of each form from the spec alone.
"""

from __future__ import annotations


def frame_role(index: int, num_appended: int, kept: set[int] | list[int], recent_frames: int,
               temporal: bool = True, sink_coded: int = 0) -> str:
    """'recent', 'sink', 'anchor' or 'delta': how frame `index` of a predictive tensor is held
    (without `temporal` every frame is standalone: no anchors). `sink_coded`: frames below it are
    held in the sink code (the cache's sink count for a spec with `sink_token_bits`, else 0)."""
    if recent_frames > 0 and index >= num_appended - recent_frames:
        return "recent"
    if index < sink_coded:
        return "sink"
    if temporal and index > 0 and (index - 1) not in kept:
        return "anchor"
    return "delta"


def frame_nbytes(role: str, token_bits: int, anchor_token_bits: int, B: int, T: int, D: int,
                 sink_token_bits: int = 0, hold: bool = False) -> int:
    """Bytes of one head of one frame held in `role` (token_bits = sum of channel_bits, anchor
    and sink likewise): delta = modes + codes, anchor = states, sink = its fields, recent = float16;
    with `hold` (sink_hold) delta and anchor frames add their hold bits."""
    if role == "recent":
        return 2 * B * T * D
    if role == "sink":
        return B * T * -(-sink_token_bits // 8)
    holds = B * -(-T // 8) if hold else 0
    if role == "anchor":
        return B * T * -(-anchor_token_bits // 8) + holds
    return B * -(-T // 8) + B * T * -(-token_bits // 8) + holds


__all__ = ["frame_nbytes", "frame_role"]
