"""Rows of mixed-width fields, packed and unpacked in a few whole-tensor operations.

The layout is exactly that of `quant/fields.py` (recipes/FORMAT.md, "Mixed-width fields"): field
i of a row occupies stream bits [o_i, o_i + w_i), least significant bit first, stream bit j in
byte j // 8 at bit j % 8, the row padded with zero bits to a whole byte. `fields.FieldLayout`
expands every row into single bits; a runtime that unpacks the whole cached history every step
cannot afford that, so `RowLayout` reads each field from the (at most three) bytes it touches:

    word_i  = byte[o_i // 8] | byte[o_i // 8 + 1] << 8 | byte[o_i // 8 + 2] << 16
    field_i = (word_i >> (o_i % 8)) & (2^w_i - 1)

A field of up to 16 bits starting at any bit of a byte fits in those 24 bits. Byte indices past
the end of the row are clamped to its last byte: they only feed bits above the field, which the
mask drops. Packing is the mirror image: field i adds ((v_i << o_i % 8) >> 8j) & 255 to byte
o_i // 8 + j (fields never share a bit, so adding is or-ing; clamped bytes receive 0).

Several rows side by side (one per head, each starting on a byte) are one row of the
concatenated widths with padding fields between them: `RowLayout.concat` builds that, so the
codes of every head of a token are unpacked at once whatever each head's widths.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_FIELD_BITS = 16


class RowLayout:
    """The byte positions of one row of fields of widths `widths` (0..16 bits each)."""

    def __init__(self, widths, device: str | torch.device = "cpu"):
        w = torch.as_tensor(widths, dtype=torch.int64).flatten().cpu()
        if w.numel() and (int(w.min()) < 0 or int(w.max()) > MAX_FIELD_BITS):
            raise ValueError(f"field widths must lie in [0, {MAX_FIELD_BITS}], got {w.tolist()}")
        self.num_fields = len(w)
        self.nbytes = -(-int(w.sum()) // 8)
        starts = torch.cumsum(w, 0) - w
        first = starts // 8
        last = max(self.nbytes - 1, 0)
        self.byte_index = torch.stack([first, first + 1, first + 2], dim=-1).clamp(max=last).to(device)  # [F, 3]
        self.shift = (starts % 8).to(torch.int32).to(device)
        self.mask = ((1 << w) - 1).to(torch.int32).to(device)
        self.byte_shift = torch.tensor([0, 8, 16], dtype=torch.int32, device=device)
        self.first = first.clamp(max=last).to(device)
        self.widths = w

    @staticmethod
    def concat(rows, device: str | torch.device = "cpu") -> "RowLayout":
        """One layout for several rows of fields laid side by side, each padded to whole bytes
        (the unpacked fields of the padding are dropped: `num_fields` counts real fields)."""
        widths, keep = [], []
        for row in rows:
            row = [int(x) for x in row]
            pad = -sum(row) % 8
            keep += [True] * len(row) + ([False] if pad else [])
            widths += row + ([pad] if pad else [])
        layout = RowLayout(widths, device)
        keep_t = torch.tensor(keep, dtype=torch.bool)
        layout.byte_index, layout.shift, layout.mask, layout.first = (
            t[keep_t.to(t.device)] for t in (layout.byte_index, layout.shift, layout.mask, layout.first))
        layout.widths = layout.widths[keep_t]
        layout.num_fields = int(keep_t.sum())
        return layout

    def select(self, fields: Tensor, valid: Tensor) -> "RowLayout":
        """A layout that unpacks only `fields` (indices into this row's fields), in that order;
        entries where `valid` is false unpack as 0."""
        out = object.__new__(RowLayout)
        out.__dict__.update(self.__dict__)
        idx = fields.to(self.first.device)
        out.first, out.shift = self.first[idx], self.shift[idx]
        out.mask = torch.where(valid.to(idx.device), self.mask[idx], 0).to(torch.int32)
        out.num_fields = len(idx)
        return out

    def unpack(self, packed: Tensor) -> Tensor:
        """uint8 [..., nbytes] -> int32 [..., num_fields]."""
        return self.unpack_columns(packed.unsqueeze(-1)).squeeze(-1)

    def unpack_columns(self, packed: Tensor) -> Tensor:
        """uint8 [..., nbytes, N] (N rows stored byte-major) -> int32 [..., num_fields, N]: selecting
        fields along a leading axis copies runs of N values, where the last axis would gather single ones."""
        if self.nbytes == 0:
            return torch.zeros(*packed.shape[:-2], self.num_fields, packed.shape[-1], dtype=torch.int32, device=packed.device)
        b = torch.nn.functional.pad(packed.to(torch.int32), (0, 0, 0, 2))
        # the 24 bits from each byte on (slices, shifts and ors: half the time of one unfold and a
        # weighted sum over it, whose strided reduction is slow, at every batch size measured)
        word = b[..., :-2, :] | (b[..., 1:-1, :] << 8) | (b[..., 2:, :] << 16)
        return (word.index_select(-2, self.first) >> self.shift[:, None]) & self.mask[:, None]

    def pack(self, values: Tensor, out: Tensor | None = None) -> Tensor:
        """Non-negative integers [..., num_fields] (field i < 2^w_i) -> uint8 [..., nbytes], into `out` if given."""
        lead = values.shape[:-1]
        if out is None:
            out = torch.empty(*lead, self.nbytes, dtype=torch.uint8, device=values.device)
        if self.nbytes == 0:
            return out
        parts = ((values.to(torch.int32) << self.shift).unsqueeze(-1) >> self.byte_shift) & 255  # [..., F, 3]
        acc = torch.zeros(*lead, self.nbytes, dtype=torch.int32, device=values.device)
        acc.index_add_(-1, self.byte_index.flatten(), parts.flatten(-2))
        return out.copy_(acc)
