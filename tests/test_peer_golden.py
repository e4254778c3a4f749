"""Golden vectors of Quant VideoGen's own package, checked against our pure functions (issue 30).

tests/data/qvg_golden.safetensors was written by `python -m benchmarks.peer_oracle --write-golden`
from the `quant-videogen` 0.1.0 package's real path (`compress_kv_cache` "triton-nstages-kmeans-int2",
`uncompress_kv_cache`; its Triton kernels under the Triton interpreter): one head of TinyWorld's
layer 1 (orbit, held-out seed), two spans of 6 frames (96 tokens x 64) for K (post-rotary) and for
V, inputs rounded to float16, the package computing in float32. It holds the k-means init indices
the package drew (per row, from its `torch.randint`), its cluster ids and centroids, its packed
INT2 codes and FP8 scales, and its decoded output. These tests need neither the package nor Triton.

Tolerances, and why:
- ids, residual codes, FP8 scales: exact. They are integers; a formula error (init indexing, the
  assignment distance or tie rule, the k-means loop's return, the scale's rounding, the rounding
  of r / s, the clamp) changes some of them.
- centroids: rtol 1e-6. Float32 means of <= 96 tokens; the package sums per cluster in its own
  order, we sum by a matmul (equal to the bit on the machine that wrote the file).
- decoded, from the package's centroids: bitwise (x^ = c[id] + (u - 1) s in float32 both sides).
- decoded, through the codec's chain (our k-means, centroids stored in float16, `smooth`): the
  package keeps its centroids in its compute dtype (float32 here, bf16 in its video integrations);
  ours are stored in float16, so on tokens given the same centroid x^ moves by the centroid's
  float16 rounding, <= 2^-11 |c| (+ 2^-25 for float16 subnormals), plus one float32 rounding of
  each sum (2^-24 |x^| each). Tokens `smooth` gives another centroid are the package's stale ids:
  it returns k-means' last assignment, made to the previous iteration's centroids (2 iterations do
  not converge), where `smooth` takes the nearest stored centroid.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from calibrate.io import check_format, read_safetensors
from calibrate.quant import affine, qvg

GOLDEN = Path(__file__).parent / "data" / "qvg_golden.safetensors"
STAGES, CENTROIDS, ITERS, BLOCK, BITS = 1, 2, 2, 64, 2
CASES = [(kind, row) for kind in "kv" for row in range(2)]


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict]:
    meta, tensors = read_safetensors(GOLDEN, "golden vectors")
    check_format(GOLDEN, meta, "qvg-golden", "1.0")
    return meta, tensors


def case(golden, kind: str, row: int) -> dict:
    t = golden[1]
    return {"x": t[f"{kind}.x"][row].float().unsqueeze(0),  # [1, N, D]: what the package got, as float32
            "init": t[f"{kind}.init"][row],  # [C] token indices of this row's k-means start
            "ids": t[f"{kind}.ids"][row].long(),  # [N]
            "centroids": t[f"{kind}.centroids"][row],  # [C, D] float32
            "codes": unpack_package_codes(t[f"{kind}.codes_packed"][row]),  # [N, D] uint8 in {0, 1, 2}
            "scales": t[f"{kind}.scales_fp8"][row].view(torch.float8_e4m3fn),  # [N, D / 64]
            "decoded": t[f"{kind}.decoded"][row]}  # [N, D] float32


def unpack_package_codes(packed: torch.Tensor) -> torch.Tensor:
    """The package's INT2 packing (real/quant_pack.py): byte j = u[4j] << 6 | u[4j+1] << 4 | u[4j+2] << 2 | u[4j+3]."""
    shifts = torch.tensor([6, 4, 2, 0], dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 3).flatten(-2)


def residual(x_ND: torch.Tensor, centroids_CD: torch.Tensor, ids_N: torch.Tensor):
    """(scales [N, D/G, 1], codes [N, D/G, G]) of x - c[ids], our formulas."""
    g = affine.group_view(x_ND - centroids_CD[ids_N], BLOCK)
    scale = qvg.residual_scale(g, BITS)
    return scale, qvg.residual_codes(g, scale, BITS)


def test_settings_are_the_shipped_ones(golden):
    settings = json.loads(golden[0]["settings"])
    assert settings["quant_type"] == "triton-nstages-kmeans-int2"
    assert (settings["num_prq_stages"], settings["cache_num_k_centroids"], settings["cache_num_v_centroids"],
            settings["kmeans_max_iters"], settings["quant_block_size"]) == (STAGES, CENTROIDS, CENTROIDS, ITERS, BLOCK)
    assert settings["kmeans_tol"] == qvg.KMEANS_TOL
    assert json.loads(golden[0]["kmeans_iterations"]) == {"k": ITERS, "v": ITERS}  # both ran to max_iters


@pytest.mark.parametrize("kind,row", CASES)
def test_kmeans_from_package_init_reproduces_its_ids_and_centroids(golden, kind, row):
    c = case(golden, kind, row)
    ids, centroids = qvg.kmeans(c["x"], CENTROIDS, ITERS, c["init"])
    assert torch.equal(ids[0], c["ids"])
    torch.testing.assert_close(centroids[0], c["centroids"], rtol=1e-6, atol=1e-7)
    # the package's ids are its last assignment, to the centroids of the iteration before
    _, previous = qvg.kmeans(c["x"], CENTROIDS, ITERS - 1, c["init"])
    assert torch.equal(qvg.assign(c["x"], previous)[0], c["ids"])


def test_package_ids_are_stale_somewhere(golden):
    """The case tells the loop's return apart from a nearest-centroid assignment (else the test above could not)."""
    stale = 0
    for kind, row in CASES:
        c = case(golden, kind, row)
        stale += int((qvg.assign(c["x"], c["centroids"].unsqueeze(0))[0] != c["ids"]).sum())
    assert stale > 0


@pytest.mark.parametrize("kind,row", CASES)
def test_residual_scales_and_codes_are_exact(golden, kind, row):
    c = case(golden, kind, row)
    scale, codes = residual(c["x"][0], c["centroids"], c["ids"])
    assert torch.equal(scale.squeeze(-1).view(torch.uint8), c["scales"].view(torch.uint8))
    assert torch.equal(affine.ungroup(codes), c["codes"])
    assert set(c["codes"].unique().tolist()) == {0, 1, 2}  # levels -1, 0, +1; code 3 never used


@pytest.mark.parametrize("kind,row", CASES)
def test_decode_from_package_state_is_bitwise(golden, kind, row):
    c = case(golden, kind, row)
    g = affine.group_view(c["codes"], BLOCK)
    r = affine.ungroup(qvg.residual_values(g, c["scales"].unsqueeze(-1), BITS))
    x_hat = qvg.unsmooth(r.unsqueeze(0), c["centroids"][None, None], c["ids"][None, :, None])[0]
    assert torch.equal(x_hat, c["decoded"])


@pytest.mark.parametrize("kind,row", CASES)
def test_codec_chain_within_float16_centroid_rounding(golden, kind, row):
    """Our k-means from the package's init, centroids stored in float16, `smooth`, residual, decode."""
    c = case(golden, kind, row)
    _, centroids = qvg.kmeans(c["x"], CENTROIDS, ITERS, c["init"])
    stored = centroids.to(torch.float16).unsqueeze(1)  # [1, stages, C, D] as the codec stores them
    r, ids = qvg.smooth(c["x"], stored)
    g = affine.group_view(r, BLOCK)
    scale = qvg.residual_scale(g, BITS)
    codes = qvg.residual_codes(g, scale, BITS)
    x_hat = qvg.unsmooth(affine.ungroup(qvg.residual_values(codes, scale, BITS)), stored, ids)[0]
    ids = ids[0, :, 0]
    same = ids == c["ids"]
    assert same.float().mean() >= 0.9  # only the package's stale ids move
    assert torch.equal(affine.ungroup(codes)[0][same], c["codes"][same])
    assert torch.equal(scale[0, same].squeeze(-1).view(torch.uint8), c["scales"][same].view(torch.uint8))
    cent = c["centroids"][c["ids"]][same]
    bound = cent.abs() * 2**-11 + 2**-25 + (x_hat[same].abs() + c["decoded"][same].abs()) * 2**-24
    assert ((x_hat[same] - c["decoded"][same]).abs() <= bound).all()
    # where `smooth` chose another centroid, it is the nearer stored one
    d = qvg.expanded_sq_distances(c["x"], stored[:, 0])[0]  # [N, C]
    moved = ~same
    assert (d[moved, ids[moved]] <= d[moved, c["ids"][moved]]).all()
