"""Packing of fields with a width per position: one row of mixed-width codes as one bit stream.

A transform code gives each coordinate its own bit width (8 bits for the strongest principal
component, 0 for the weakest), so a token's codes are fields of different widths. They are
packed like `packing.pack`'s rows, as a little-endian bit stream along the LAST axis:

* field i of a row has width ``w_i`` (0..16) and occupies stream bits ``[o_i, o_i + w_i)`` with
  ``o_i = w_0 + ... + w_{i-1}``, its least significant bit first;
* stream bit j lives in byte ``j // 8`` at bit position ``j % 8`` (0 = least significant);
* the row is padded with zero bits to a whole byte: ``fields_nbytes(w) = ceil(sum(w) / 8)``.

A zero-width field takes no bits (its value must be 0). With every width equal to b and a
multiple of 8 fields this is exactly `packing.pack`'s layout; the padding rule differs from
`packing.pack` otherwise (whole bytes, not whole blocks of 8 codes), so the two are separate
functions with separate golden vectors (recipes/FORMAT.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_FIELD_BITS = 16


def _widths(widths) -> Tensor:
    w = torch.as_tensor(widths, dtype=torch.int64).flatten().cpu()
    if w.numel() and (int(w.min()) < 0 or int(w.max()) > MAX_FIELD_BITS):
        raise ValueError(f"field widths must lie in [0, {MAX_FIELD_BITS}], got {w.tolist()}")
    return w


def fields_nbytes(widths) -> int:
    """Bytes of one packed row of fields of these widths: ``ceil(sum(widths) / 8)``."""
    return -(-int(_widths(widths).sum()) // 8)


class FieldLayout:
    """The bit layout of one row of fields of given widths, computed once (a runtime packs and
    unpacks the same widths every frame)."""

    def __init__(self, widths, device: str | torch.device = "cpu"):
        w = _widths(widths)
        self.widths = w.to(device)
        self.num_fields = len(w)
        self.nbytes = -(-int(w.sum()) // 8)
        # for every stream bit: the field it belongs to and its bit position within that field
        self.owner = torch.repeat_interleave(torch.arange(len(w)), w).to(device)
        starts = torch.cumsum(w, 0) - w
        self.position = (torch.arange(int(w.sum())) - starts[self.owner.cpu()]).to(device)
        self.limit = (1 << w).to(device)
        self.byte_weights = (1 << torch.arange(8)).to(device)

    def pack(self, values: Tensor) -> Tensor:
        """Non-negative integers ``[..., n]`` (value i < 2^widths[i]) -> uint8 ``[..., nbytes]``."""
        if values.dim() == 0 or values.shape[-1] != self.num_fields:
            raise ValueError(f"values must have {self.num_fields} fields on the last axis, got shape {tuple(values.shape)}")
        if values.is_floating_point():
            raise ValueError(f"values must be integers, got {values.dtype}")
        v = values.to(torch.int64)
        if v.numel() and (bool((v < 0).any()) or bool((v >= self.limit).any())):
            raise ValueError("a field value is negative or does not fit its width")
        stream = (v[..., self.owner] >> self.position) & 1  # [..., total bits]
        stream = torch.nn.functional.pad(stream, (0, self.nbytes * 8 - stream.shape[-1]))
        stream = stream.reshape(*v.shape[:-1], self.nbytes, 8)
        return (stream * self.byte_weights).sum(-1).to(torch.uint8)

    def unpack(self, packed: Tensor) -> Tensor:
        """uint8 ``[..., nbytes]`` -> int64 ``[..., n]``."""
        if packed.dtype != torch.uint8 or packed.dim() == 0 or packed.shape[-1] != self.nbytes:
            raise ValueError(f"packed must be uint8 with {self.nbytes} bytes on the last axis, got "
                             f"{packed.dtype} {tuple(packed.shape)}")
        bits = (packed.to(torch.int64).unsqueeze(-1) >> self.byte_weights.new_tensor(range(8))) & 1
        stream = bits.reshape(*packed.shape[:-1], self.nbytes * 8)[..., : len(self.owner)]
        out = torch.zeros(*packed.shape[:-1], self.num_fields, dtype=torch.int64, device=packed.device)
        return out.index_add_(-1, self.owner, stream << self.position) if len(self.owner) else out


def pack_fields(values: Tensor, widths) -> Tensor:
    """Pack non-negative integers ``[..., n]`` (value i < 2^widths[i]) into uint8 ``[..., fields_nbytes]``."""
    return FieldLayout(widths, values.device).pack(values)


def unpack_fields(packed: Tensor, widths) -> Tensor:
    """Inverse of :func:`pack_fields`: uint8 ``[..., fields_nbytes]`` -> int64 ``[..., n]``."""
    return FieldLayout(widths, packed.device).unpack(packed)
