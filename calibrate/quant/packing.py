"""Sub-byte packing of b-bit codes into bytes: the cross-runtime layout of ``recipes/FORMAT.md``.

The layout is a little-endian bit stream along the LAST axis, row by row:

* element i of a row occupies stream bits ``[i*b, (i+1)*b)``, its least significant bit first;
* stream bit j lives in byte ``j // 8`` at bit position ``j % 8`` (0 = least significant);
* each row is padded with zero codes up to a multiple of 8 elements, so 8 codes fill exactly
  b bytes and every row is a whole number of bytes: ``packed_nbytes(n, b) = ceil(n/8) * b``.

Equivalently, a block of 8 codes ``c_0..c_7`` is the little-endian integer
``sum_i c_i << (i*b)`` written in b bytes. For b in {2, 4, 8} the codes never straddle a byte
(byte k holds codes ``k*(8/b) ..`` with code i at bit ``(i*b) % 8``); for b = 3 they do, and
the general bit-stream path handles it. 8-bit rows are padded too, so one formula holds for
every width.

The fast paths loop only over the ``8/b`` positions in a byte or over the b bits, never over
elements; ``tests/test_packing.py`` checks them against a slow per-bit reference and against
the golden vectors of ``recipes/FORMAT.md``.
"""

from __future__ import annotations

import torch

from calibrate.quant.affine import check_bits


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of one packed row of ``n`` codes: ``ceil(n / 8) * bits``."""
    check_bits(bits)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    return -(-n // 8) * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[..., n]`` (each < 2^bits) into ``[..., packed_nbytes(n, bits)]``."""
    check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("codes must have at least one axis (the packed axis is the last)")
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(
            f"codes out of range for {bits}-bit packing: max {int(codes.max())} >= {2**bits}"
        )
    n = codes.shape[-1]
    pad = -n % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    lead = codes.shape[:-1]
    if 8 % bits == 0:
        # whole codes per byte: byte k = OR_j codes[k*per + j] << (j*bits)
        per = 8 // bits
        blocks = codes.reshape(*lead, codes.shape[-1] // per, per)
        out = torch.zeros(blocks.shape[:-1], dtype=torch.uint8, device=codes.device)
        for j in range(per):
            out |= blocks[..., j] << (j * bits)
        return out
    # general bit stream: expand to bits (LSB first), regroup by 8, reassemble bytes
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(*lead, codes.shape[-1] * bits // 8, 8)
    out = torch.zeros(stream.shape[:-1], dtype=torch.uint8, device=codes.device)
    for pos in range(8):
        out |= stream[..., pos] << pos
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., packed_nbytes(n, bits)]`` -> codes ``[..., n]``."""
    nbytes = packed_nbytes(n, bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != nbytes:
        raise ValueError(
            f"packed last axis must have {nbytes} bytes for n={n} at {bits} bits, "
            f"got shape {tuple(packed.shape)}"
        )
    lead = packed.shape[:-1]
    mask = 2**bits - 1
    if 8 % bits == 0:
        per = 8 // bits
        parts = [(packed >> (j * bits)) & mask for j in range(per)]
        codes = torch.stack(parts, dim=-1).reshape(*lead, nbytes * per)
        return codes[..., :n]
    positions = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> positions) & 1).reshape(*lead, nbytes * 8 // bits, bits)
    codes = torch.zeros(stream.shape[:-1], dtype=torch.uint8, device=packed.device)
    for k in range(bits):
        codes |= stream[..., k] << k
    return codes[..., :n]
