"""Float32 sums in one fixed order, so that every runtime computes the same bits.

A float32 sum of n terms depends on the order its additions are done in, and a matrix product
`x @ M` leaves that order to the BLAS (blocking, vector width, fused multiply-add). One ulp of
difference in a rotated value is enough to move it across a rounding boundary and flip a code,
and a frame re-encoded from its decoded copy (the recent window) carries the flip on. So the
recipe format (recipes/FORMAT.md, "Fixed-order sums") pins the order of every sum that reaches
a code or a decoded value of the per-frame kinds, and this module is that order:

    tree_sum(t_0 .. t_{n-1}):  while n > 1:  m = ceil(n / 2);
                                             t_i = t_i + t_{i+m}  for i = 0 .. n-m-1
                                             (t_i for n-m <= i < m, the middle term when n
                                             is odd, is kept);  n = m
                               the result is t_0

Every term is a float32 value (a product `a_d * b_d` is rounded to float32 first; no fused
multiply-add) and every addition is rounded to float32. For n = 64 that is 32, 16, 8, 4, 2 and 1
elementwise additions of halves: the reduction a GPU warp does with shuffles, and log2(n) vector
additions here. The predictive kind keeps plain matrix products (its states decode in integers;
FORMAT.md says where its float products are not pinned).

Functions take the summed axis last and return float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24  # products held at once by `matmul` (64 MiB of float32)


def tree_sum(t: Tensor) -> Tensor:
    """Sum over the last axis by the halving tree above: [..., n] -> [...]."""
    t = t.float()
    n = t.shape[-1]
    if n == 0:
        return t.sum(-1)
    while n > 1:
        m = (n + 1) // 2
        head = t[..., : n - m] + t[..., m:n]
        t = head if m == n - m else torch.cat([head, t[..., n - m : m]], dim=-1)
        n = m
    return t[..., 0]


def _tree_sum_first(t: Tensor) -> Tensor:
    """`tree_sum` over the first axis of a tensor this module owns, in place: [n, ...] -> [...].

    The halves t[:n-m] and t[m:n] never overlap, so each level is one in-place addition of
    contiguous slabs (the same additions, in the same order, as `tree_sum`)."""
    n = t.shape[0]
    while n > 1:
        m = (n + 1) // 2
        t[: n - m].add_(t[m:n])
        n = m
    return t[0]


def matmul(x: Tensor, m_DK: Tensor) -> Tensor:
    """`x @ M` [..., D] x [D, K] -> [..., K]: output k is tree_sum over d of x_d * M_dk."""
    D, K = m_DK.shape
    return matmul_heads(x.reshape(1, 1, -1, D), m_DK[None]).reshape(*x.shape[:-1], K)


def matmul_heads(x_BHND: Tensor, m_HDK: Tensor) -> Tensor:
    """`matmul` with one matrix per head: x[:, h] @ M[h], [B, H, N, D] x [H, D, K] -> [B, H, N, K]
    (`matmul` is its one-head case: the same products and the same tree)."""
    x, m = x_BHND.float(), m_HDK.float()
    B, H, N, D = x.shape
    K = m.shape[-1]
    xt = x.permute(3, 0, 1, 2)  # [D, B, H, N]: the summed axis first
    mt = m.permute(1, 0, 2)[:, None, :, None, :]  # [D, 1, H, 1, K]
    step = max(1, CHUNK_ELEMENTS // max(1, D * B * H * K))
    out = [_tree_sum_first(xt[..., i : i + step, None] * mt) for i in range(0, N, step)]
    return torch.cat(out, dim=2) if out else x.new_zeros(B, H, 0, K)


def sq_distances_heads(x_BHND: Tensor, c_HCD: Tensor) -> Tensor:
    """`sq_distances` with one set of rows per head: [B, H, N, D] x [H, C, D] -> [B, H, N, C]
    (`sq_distances` is its one-head case)."""
    x, c = x_BHND.float(), c_HCD.float()
    B, H, N, D = x.shape
    C = c.shape[1]
    step = max(1, CHUNK_ELEMENTS // max(1, B * H * C * D))
    out = []
    for i in range(0, N, step):
        diff = x[:, :, i : i + step, None, :] - c[None, :, None]
        out.append(tree_sum(diff * diff))
    return torch.cat(out, dim=2) if out else x.new_zeros(B, H, 0, C)


def sum_squares(x: Tensor) -> Tensor:
    """tree_sum of x_d * x_d over the last axis, [..., D] -> [..., 1] (a squared L2 norm)."""
    x = x.float()
    return tree_sum(x * x).unsqueeze(-1)


def sqrt(x: Tensor) -> Tensor:
    """IEEE's correctly rounded float32 square root (FORMAT.md "Arithmetic").

    torch's float32 CPU sqrt is MKL's vmsSqrt, 1 ulp off on 17% of float32 inputs. The float64
    root of a float32 value, rounded once to float32, is the correctly rounded root even from a
    faithful float64 sqrt: the root lies at least 2^-50 (relative) from every float32 midpoint,
    beyond one float64 ulp (2^-52)."""
    return x.double().sqrt().float()


def sq_distances(x: Tensor, c_CD: Tensor) -> Tensor:
    """tree_sum over d of (x_d - c_d)^2 for every row c of C: [..., D] x [C, D] -> [..., C]."""
    C, D = c_CD.shape
    return sq_distances_heads(x.reshape(1, 1, -1, D), c_CD[None]).reshape(*x.shape[:-1], C)


def batched_dot(x_BND: Tensor, c_BCD: Tensor) -> Tensor:
    """tree_sum over d of x[b, n, d] * c[b, k, d]: [B, N, D] x [B, C, D] -> [B, N, C]."""
    x, c = x_BND.float(), c_BCD.float()
    B, N, D = x.shape
    step = max(1, CHUNK_ELEMENTS // max(1, B * c.shape[1] * D))
    out = [tree_sum(x[:, i : i + step, None, :] * c[:, None]) for i in range(0, N, step)]
    return torch.cat(out, dim=1) if out else x.new_zeros(B, 0, c.shape[1])
