"""Quant VideoGen's progressive residual quantization (PRQ): k-means smoothing, then an INT-b residual.

Transcribed from the formulas of the `quant-videogen` 0.1.0 package (Xi et al., 2026, "Quant
VideoGen"; `real/prq.py`, `kmeans/kmeans_euclid.py`, `real/quant_pack.py`,
`real/accumulate.py`); no code of the package is used. For one head and one *span* of tokens
X [N, D]:

1. **Semantic-aware smoothing, progressive.** R_0 = X; for stage s = 1..n: k-means with C
   centroids on R_{s-1}, a_s = index of each token's centroid, R_s = R_{s-1} - C_s[a_s]. Stage 1
   removes what tokens of one semantic cluster share; later stages refine the residual.
2. **Residual.** Per token and block of G consecutive channels, symmetric with
   q_max = 2^(b-1) - 1 (1 for INT2: levels {-1, 0, +1}, 3 of the 4 codes):

       s = fp8_e4m3(clamp(max|r| / q_max, 2^-9, 448))
       q = clamp(round_half_away(r / s), -q_max, q_max)        stored code u = q + q_max

3. **Decode.** x^ = sum_s C_s[a_s] + q s.

k-means (`kmeans`), exactly the package's loop:

- init: C token indices drawn uniformly *with replacement* (duplicates possible);
- assign: a_i = argmin_k max(0, |r_i|^2 + |c_k|^2 - 2 r_i.c_k), ties to the lowest k;
- update: c_k = mean of the tokens assigned to k; an empty cluster keeps its centroid;
- loop: for it < max_iters: assign to the current centroids, compute the new means; if a
  previous assignment exists and the share of changed ids is < tol, stop and return the
  centroids the ids were assigned to (not the new means); else keep the ids and move to the
  new means. Stopped by max_iters, it returns the means of the last assignment.

Where this differs from the package (numerically; stated again in `schemes.py`):

- the package computes in the model's dtype (bf16); TinyWorld runs in float32, so k-means and
  the residual are float32 and only the stored centroids are rounded (to float16, the
  project's 16-bit storage type, like bf16 16 bits);
- tokens are assigned to the nearest *stored* (float16) centroid, by the same distance and
  tie rule (the package returns k-means' last ids, which equal the nearest ones once
  converged), so every frame of a span is coded the same way;
- the init indices are drawn from a fixed seed and shared by the batch rows (the package
  draws per row from the global RNG), so where a trajectory's k-means starts does not depend on its batch;
- the FP8 scale is clamped to [2^-9, 448] before rounding, as the package's simulated path
  does: its real path rounds a block max below ~2^-10 to scale 0 and divides by it (NaN);
- codes are packed in the project's bit order (recipes/FORMAT.md), not the package's
  first-element-in-the-high-bits order; centroid indices are packed too, at the fewest bits
  of {1, 2, 3, 4, 8} that hold C (`index_bits`: 1 bit for C = 2), where the package stores a
  uint8 per token: storage only, the numerics are the same.

Shapes: x [B, N, D] (B independent rows: trajectories of a batch), centroids [B, C, D].
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.quant import ordered, packing

FP8 = torch.float8_e4m3fn
FP8_MIN = 2.0**-9  # smallest subnormal of E4M3: a zero block still gets a positive scale
FP8_MAX = 448.0  # largest finite E4M3
KMEANS_SEED = 0
KMEANS_TOL = 1e-4


def round_half_away(x: Tensor) -> Tensor:
    """Round to nearest, ties away from zero (CUDA `roundf`, the package's real path).

    Exactly: t = trunc(x), then one step away from zero if the (exact) remainder |x - t| is at
    least 1/2. `floor(|x| + 0.5)` is not exact in float32: 0.49999997 + 0.5 rounds to 1.
    """
    t = torch.trunc(x)
    return t + torch.where((x - t).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def fp8_e4m3(x: Tensor) -> Tensor:
    """x clamped to [2^-9, 448] and rounded to FP8 E4M3 (nearest, ties to even), dtype float8_e4m3fn."""
    return x.float().clamp(FP8_MIN, FP8_MAX).to(FP8)


def qmax(bits: int) -> int:
    """Largest |q| of the symmetric b-bit residual grid: 2^(b-1) - 1."""
    return 2 ** (bits - 1) - 1


def residual_scale(r_G: Tensor, bits: int) -> Tensor:
    """FP8 scale [..., 1] of each block r [..., G]: fp8(clamp(max|r| / q_max, 2^-9, 448))."""
    return fp8_e4m3(r_G.abs().amax(-1, keepdim=True) / qmax(bits))


def residual_codes(r_G: Tensor, scale: Tensor, bits: int) -> Tensor:
    """Stored codes u = q + q_max in [0, 2 q_max] (uint8) of blocks r [..., G] with scale [..., 1]."""
    m = qmax(bits)
    q = round_half_away(r_G.float() / scale.float()).clamp(-m, m)
    return (q + m).to(torch.uint8)


def residual_values(codes: Tensor, scale: Tensor, bits: int) -> Tensor:
    """(u - q_max) s: the dequantized residual blocks."""
    return (codes.float() - qmax(bits)) * scale.float()


def expanded_sq_distances(x_BND: Tensor, c_BCD: Tensor) -> Tensor:
    """max(0, (|x|^2 + |c|^2) - 2 x.c) [B, N, C]: the package's assignment distance, each of the
    three sums in the fixed order of recipes/FORMAT.md (`ordered`), so that codes are exact. Not
    `ordered.sq_distances`, which sums (x - c)^2: the two round differently."""
    x, c = x_BND.float(), c_BCD.float()
    d = ordered.sum_squares(x) + ordered.sum_squares(c).transpose(1, 2) - 2 * ordered.batched_dot(x, c)
    return d.clamp_min(0)


def assign(x_BND: Tensor, c_BCD: Tensor) -> Tensor:
    """Index [B, N] (int64) of each token's nearest centroid; ties to the lowest index."""
    return expanded_sq_distances(x_BND.float(), c_BCD.float()).argmin(-1)


def gather_centroids(c_BCD: Tensor, ids_BN: Tensor) -> Tensor:
    """c[b, ids[b, n]] [B, N, D]."""
    return torch.gather(c_BCD, 1, ids_BN.unsqueeze(-1).expand(-1, -1, c_BCD.shape[-1]))


def init_indices(num_tokens: int, num_centroids: int, seed: int = KMEANS_SEED) -> Tensor:
    """C token indices drawn uniformly with replacement from a fixed seed (shared by the rows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_tokens, (num_centroids,), generator=g)


def kmeans(x_BND: Tensor, num_centroids: int, max_iters: int, init_idx_C: Tensor,
           tol: float = KMEANS_TOL) -> tuple[Tensor, Tensor]:
    """The package's batched k-means: (ids [B, N] int64, centroids [B, C, D] float32).

    The convergence test pools the rows, like the package's batch: the share of changed ids over
    all B x N tokens (float32, against float32(tol)). Up to 10^4 tokens only an unchanged
    assignment stops, and the centroids of a row whose ids repeat are a fixed point of the update,
    so each row gets its own result; beyond, a row can stop while a few of its ids still change
    (its centroids then depend on the rows batched with it).
    """
    if max_iters < 1:
        raise ValueError(f"k-means needs max_iters >= 1, got {max_iters}")
    x = x_BND.float()
    centroids = x[:, init_idx_C.to(x.device)].clone()
    prev = None
    ids = None
    for _ in range(max_iters):
        ids = assign(x, centroids)
        onehot = torch.nn.functional.one_hot(ids, num_centroids).to(x.dtype)  # [B, N, C]
        counts = onehot.sum(1)  # [B, C]
        sums = onehot.transpose(1, 2) @ x  # [B, C, D]
        new = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1).unsqueeze(-1), centroids)
        if prev is not None and (ids != prev).float().mean() < tol:
            break
        prev, centroids = ids, new
    return ids, centroids


def fit_centroids(x_BND: Tensor, stages: int, num_centroids: int, max_iters: int,
                  seed: int = KMEANS_SEED) -> Tensor:
    """Centroids [B, stages, C, D] (float16, as stored) of the progressive stages, fitted on x.

    Stage s runs k-means on the residual left by stages 1..s-1, each stage having taken every
    token's nearest *stored* (float16) centroid off (`smooth`).
    """
    r = x_BND.float()
    out = []
    for _ in range(stages):
        _, c = kmeans(r, num_centroids, max_iters, init_indices(r.shape[1], num_centroids, seed))
        c16 = c.to(torch.float16)
        out.append(c16)
        r = r - gather_centroids(c16.float(), assign(r, c16.float()))
    return torch.stack(out, dim=1)


def smooth(x_BND: Tensor, centroids_BSCD: Tensor) -> tuple[Tensor, Tensor]:
    """(residual [B, N, D], ids [B, N, stages] int64): each stage takes the nearest centroid off."""
    r = x_BND.float()
    ids = []
    for s in range(centroids_BSCD.shape[1]):
        c = centroids_BSCD[:, s].float()
        a = assign(r, c)
        r = r - gather_centroids(c, a)
        ids.append(a)
    return r, torch.stack(ids, dim=-1)


def unsmooth(r_BND: Tensor, centroids_BSCD: Tensor, ids_BNS: Tensor) -> Tensor:
    """r + sum_s C_s[a_s]: adds the stages' centroids back."""
    out = r_BND.float()
    for s in range(centroids_BSCD.shape[1]):
        out = out + gather_centroids(centroids_BSCD[:, s].float(), ids_BNS[..., s].long())
    return out


def index_bits(num_centroids: int) -> int:
    """Width of a stored centroid index: the fewest of 1, 2, 3, 4, 8 bits that hold C values (0 if C = 1)."""
    if num_centroids <= 1:
        return 0
    return next(w for w in (1, 2, 3, 4, 8) if 2**w >= num_centroids)


def pack_ids(ids: Tensor, num_centroids: int) -> Tensor:
    """Indices uint8 [..., n] packed along the last axis at `index_bits(C)` bits (the bit stream
    of recipes/FORMAT.md; 1 bit: element i at bit i % 8 of byte i // 8) -> [..., ceil(n/8) w]."""
    w = index_bits(num_centroids)
    ids = ids.to(torch.uint8)
    if w != 1:
        return packing.pack(ids, w)
    ids = torch.nn.functional.pad(ids, (0, -ids.shape[-1] % 8)).reshape(*ids.shape[:-1], -1, 8)
    return (ids << torch.arange(8, dtype=torch.uint8, device=ids.device)).sum(-1, dtype=torch.uint8)


def unpack_ids(packed: Tensor, num_centroids: int, n: int) -> Tensor:
    """Inverse of `pack_ids`: uint8 [..., n]."""
    w = index_bits(num_centroids)
    if w != 1:
        return packing.unpack(packed, w, n)
    bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


def ids_nbytes(num_tokens: int, num_centroids: int) -> int:
    """Bytes of one packed row of `num_tokens` indices: ceil(n / 8) * index_bits(C)."""
    return -(-num_tokens // 8) * index_bits(num_centroids)
