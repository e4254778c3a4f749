"""Helpers of the fast runtime's stores (fast_chain.py, fast_frames.py, fastcache.py): index
tensors made once per slot list, a frame's tokens taken one block at a time, and tables of one
bit per token and head (a predictive frame's modes and hold bits, bit t % 8 of byte t // 8)."""

from __future__ import annotations

import torch
from torch import Tensor


class IndexTensors:
    """Index tensors of integer lists, made once per list: a step's slot lists repeat from step to
    step, and a host-to-device tensor per list and step would be work on the hot path."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.device, self.capacity = device, capacity
        self.made: dict[tuple, Tensor] = {}

    def __call__(self, values: list[int]) -> Tensor:
        key = tuple(values)
        if key not in self.made:
            if len(self.made) > self.capacity:
                self.made.clear()
            self.made[key] = torch.tensor(values, dtype=torch.long, device=self.device)
        return self.made[key]


def token_block(x, tokens: slice) -> Tensor:
    """Tokens of a frame given as a tensor [B, H, T, D] or as something with `block(tokens)`
    (`fastcache.RotatedKeys`: post-rotary keys made a block at a time)."""
    return x[:, :, tokens] if isinstance(x, Tensor) else x.block(tokens)


_BIT_VALUES: dict[torch.device, Tensor] = {}  # 1, 2, 4, ..., 128 as uint8, per device


def _bit_values(device: torch.device) -> Tensor:
    if device not in _BIT_VALUES:
        _BIT_VALUES[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
    return _BIT_VALUES[device]


def pack_token_bits(bits_BGT: Tensor, out_BGC: Tensor, t0: int) -> None:
    """Write bits [B, G, Tb] bool (tokens t0.., t0 a multiple of 8) into their bytes of `out` [B, G, ceil(T/8)]."""
    B, G, Tb = bits_BGT.shape
    bits = bits_BGT if Tb % 8 == 0 else torch.nn.functional.pad(bits_BGT, (0, -Tb % 8))
    byte = (bits.view(B, G, -1, 8).to(torch.uint8) * _bit_values(bits.device)).sum(-1, dtype=torch.uint8)
    out_BGC[..., t0 // 8: t0 // 8 + byte.shape[-1]] = byte


def unpack_token_bits(rows: Tensor, tokens: slice) -> Tensor:
    """Bits [..., Tb] bool of `tokens` (tokens.start a multiple of 8) from byte rows [..., ceil(T/8)] uint8."""
    b = rows[..., tokens.start // 8: -(-tokens.stop // 8)]
    return (b.unsqueeze(-1) & _bit_values(rows.device)).ne(0).flatten(-2)[..., : tokens.stop - tokens.start]
