"""Sub-byte packing: golden vectors parsed from recipes/FORMAT.md, slow reference, round trips."""

import re
from pathlib import Path

import pytest
import torch

from calibrate.quant.packing import pack, packed_nbytes, unpack

FORMAT_MD = Path(__file__).resolve().parents[1] / "recipes" / "FORMAT.md"
U8 = torch.uint8


def golden_vectors():
    """Rows ``| bits | codes | packed hex |`` of the golden table in FORMAT.md."""
    text = FORMAT_MD.read_text(encoding="utf-8")
    section = text.split("### Golden vectors", 1)[1]
    rows = []
    for m in re.finditer(r"^\|\s*(\d+)\s*\|([^|]+)\|([^|]+)\|\s*$", section, re.MULTILINE):
        bits = int(m.group(1))
        codes = [[int(c) for c in part.split()] for part in m.group(2).split(";")]
        packed = [bytes.fromhex(part.strip()) for part in m.group(3).split(";")]
        rows.append((bits, codes, packed))
    return rows


GOLDEN = golden_vectors()


def reference_pack_row(codes, bits):
    """Slow, obvious path: write each code bit by bit into the LSB-first stream."""
    out = bytearray(packed_nbytes(len(codes), bits))
    for i, c in enumerate(codes):
        for k in range(bits):
            j = i * bits + k
            out[j // 8] |= ((c >> k) & 1) << (j % 8)
    return bytes(out)


def test_golden_table_is_present_and_covers_all_widths():
    assert len(GOLDEN) >= 8
    assert {bits for bits, _, _ in GOLDEN} == {2, 3, 4, 8}
    assert any(len(codes[0]) % 8 for _, codes, _ in GOLDEN)  # a padded example
    assert any(len(codes) > 1 for _, codes, _ in GOLDEN)  # a multi-row example


@pytest.mark.parametrize("bits,codes,packed", GOLDEN, ids=lambda v: str(v)[:24])
def test_golden_vectors(bits, codes, packed):
    codes_t = torch.tensor(codes, dtype=U8)
    expect = torch.tensor([list(p) for p in packed], dtype=U8)
    got = pack(codes_t, bits)
    assert torch.equal(got, expect)
    assert torch.equal(unpack(got, bits, codes_t.shape[-1]), codes_t)
    for row, p in zip(codes, packed):
        assert reference_pack_row(row, bits) == p  # the document agrees with the slow path


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_matches_slow_reference(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 9, 23, 64):
        codes = torch.randint(0, 2**bits, (5, n), generator=gen, dtype=U8)
        got = pack(codes, bits)
        for row, packed_row in zip(codes.tolist(), got):
            assert bytes(packed_row.tolist()) == reference_pack_row(row, bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_random_shapes(bits):
    gen = torch.Generator().manual_seed(100 + bits)
    for _ in range(12):
        ndim = int(torch.randint(1, 4, (1,), generator=gen))
        shape = tuple(int(s) for s in torch.randint(1, 12, (ndim,), generator=gen))
        shape = shape[:-1] + (int(torch.randint(0, 70, (1,), generator=gen)),)
        codes = torch.randint(0, 2**bits, shape, generator=gen, dtype=U8)
        packed = pack(codes, bits)
        assert packed.dtype == U8
        assert packed.shape == shape[:-1] + (packed_nbytes(shape[-1], bits),)
        assert torch.equal(unpack(packed, bits, shape[-1]), codes)


def test_non_contiguous_input():
    codes = torch.randint(0, 4, (16, 10), dtype=U8).T  # [10, 16], packed along the 16
    assert torch.equal(pack(codes, 2), pack(codes.contiguous(), 2))
    assert torch.equal(unpack(pack(codes, 2), 2, 16), codes)


def test_padding_bits_are_zero():
    packed = pack(torch.full((3,), 7, dtype=U8), 3)
    assert packed.tolist() == [0xFF, 0x01, 0x00]


def test_packed_nbytes():
    assert packed_nbytes(8, 3) == 3
    assert packed_nbytes(9, 3) == 6
    assert packed_nbytes(128, 2) == 32
    assert packed_nbytes(0, 4) == 0
    assert packed_nbytes(5, 8) == 8
    with pytest.raises(ValueError):
        packed_nbytes(-1, 2)
    with pytest.raises(ValueError):
        packed_nbytes(8, 5)


def test_validation():
    with pytest.raises(ValueError):
        pack(torch.tensor([0, 4], dtype=U8), 2)  # code out of range
    with pytest.raises(ValueError):
        pack(torch.tensor([0, 8], dtype=U8), 3)
    with pytest.raises(ValueError):
        pack(torch.tensor([0, 1], dtype=torch.int64), 2)  # wrong dtype
    with pytest.raises(ValueError):
        pack(torch.tensor([0.0, 1.0]), 2)
    with pytest.raises(ValueError):
        pack(torch.tensor([0, 1], dtype=U8), 5)  # bad width
    with pytest.raises(ValueError):
        pack(torch.tensor(1, dtype=U8), 2)  # no axis to pack
    with pytest.raises(ValueError):
        unpack(torch.zeros(3, dtype=U8), 2, 8)  # 8 codes at 2 bits need 2 bytes
    with pytest.raises(ValueError):
        unpack(torch.zeros(2, dtype=torch.int32), 2, 8)
