"""Orthogonal rotations that spread outlier channels before quantization (QuaRot, SpinQuant).

Convention: a rotation is an ``n x n`` orthogonal matrix ``Q`` applied on the LAST axis as
``y = x @ Q`` (row vectors); the inverse is ``x = y @ Q.T``. Because ``Q @ Q.T = I``,
rotating both queries and keys (after RoPE) leaves every attention logit unchanged::

    (q @ Q) . (k @ Q) = q @ Q @ Q.T @ k = q . k

so keys can be quantized in the rotated basis for free. Values are rotated the same way,
``v' = v @ Q``; attention is linear in v, so ``P @ v' = (P @ v) @ Q`` and the output is
rotated back with ``@ Q.T``.

Why it helps: a channel with a huge magnitude dominates the absmax of every token, wasting
the grid on the other channels. A Hadamard matrix mixes every output channel from all input
channels with equal weight ``±1/sqrt(n)``, so one outlier is spread over all n channels and
the distribution becomes close to Gaussian with a much smaller absmax-to-RMS ratio.

* :func:`hadamard` is the Sylvester Hadamard matrix (entries ±1, ``H @ H.T = n I``; n a power
  of two), from ``scipy.linalg.hadamard``.
* :func:`random_hadamard` is ``Q = H / sqrt(n) @ diag(s)`` with random signs ``s in {±1}^n``
  (QuaRot's randomized Hadamard): column j of the normalized Hadamard is multiplied by s_j.
* :func:`random_orthogonal` is a Haar-random orthogonal matrix (QR of a Gaussian matrix with
  the signs of R's diagonal moved into Q), a starting point for learned rotations.

Randomness comes from a local ``torch.Generator`` seeded explicitly, never the global RNG; the
same ``(n, seed)`` gives the same matrix (drawn in float64 on CPU). Randomized Hadamard matrices
are exact (``±1/sqrt(n)``); a QR result may differ in the last bits across LAPACK builds, which
is one reason recipes store the rotation tensor rather than its seed.
"""

from __future__ import annotations

import math

import scipy.linalg
import torch


def _check_power_of_two(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a positive power of two, got {n!r}")


def _check_size(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"rotation size must be a positive integer, got {n!r}")


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n: entries ±1, ``H @ H.T = n * I`` (not normalized)."""
    _check_power_of_two(n)
    return torch.from_numpy(scipy.linalg.hadamard(n).astype("float64")).to(dtype)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """n random ±1 values (float64) from a local generator seeded with ``seed``."""
    _check_size(n)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64)
    return (2 * bits - 1).double()


def random_hadamard(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Randomized Hadamard rotation ``Q = H / sqrt(n) @ diag(s)``; apply as ``x @ Q``."""
    h = hadamard(n, dtype=torch.float64) / math.sqrt(n)
    return (h * random_signs(n, seed)).to(dtype)


def random_orthogonal(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Haar-random orthogonal matrix: ``Q R = G`` (G Gaussian), then ``Q @ diag(sign(diag R))``.

    Without the sign fix QR's sign convention would bias the distribution; a zero diagonal
    entry (probability zero) counts as positive.
    """
    _check_size(n)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)
    return (q * signs).to(dtype)


def orthogonality_error(q: torch.Tensor) -> float:
    """``max |Q.T @ Q - I|`` computed in float64 (0 for an exactly orthogonal matrix)."""
    if q.dim() != 2 or q.shape[0] != q.shape[1]:
        raise ValueError(f"a rotation must be a square matrix, got shape {tuple(q.shape)}")
    q64 = q.detach().to(torch.float64)
    eye = torch.eye(q.shape[0], dtype=torch.float64, device=q64.device)
    return (q64.T @ q64 - eye).abs().max().item()


def is_orthogonal(q: torch.Tensor, atol: float = 1e-5) -> bool:
    """Whether ``q`` is square, finite and ``max |Q.T @ Q - I| <= atol``."""
    if q.dim() != 2 or q.shape[0] != q.shape[1] or not bool(torch.isfinite(q).all()):
        return False
    return orthogonality_error(q) <= atol


def rotate(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x @ Q`` on the last axis."""
    return x @ q.to(x.dtype)


def unrotate(y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``y @ Q.T``: the inverse of :func:`rotate` for orthogonal Q."""
    return y @ q.to(y.dtype).T
