"""TurboQuant (Zandieh et al., 2025): random rotation, Lloyd-Max codes per coordinate, QJL residual.

Transcribed from the paper's Algorithms 1-2, Lemma 1 and Definition 1 (no package code is used).

**TQ_mse** (Algorithm 1), for a vector x in R^d: n = |x|, u = x / n, y = u Pi (Pi a Haar-random
orthogonal matrix; x @ Pi here, rows as vectors). After a random rotation every coordinate of a
unit vector follows the same law (Lemma 1)

    f(t) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - t^2)^((d-3)/2),   t in [-1, 1],

so one scalar codebook serves every coordinate: the Lloyd-Max quantizer of f with 2^b levels
(`beta_lloyd_max`). Code_j = index of the level nearest y_j; decode y^ = n c[code] (then x^ = y^ Pi^T).

**TQ_prod** (Algorithm 2, for keys: attention needs inner products, not values): TQ_mse at b - 1
bits, then a 1-bit QJL sketch of what it left: r = u - c[code], gamma = |r|, z = sign(S r) with
S in R^{m x d} i.i.d. N(0, 1) (sign(0) = +1). Decode

    u^ = c[code] + sqrt(pi/2) / m * gamma * S^T z

For a fixed query q, E_S[<q, S^T z>] sqrt(pi/2)/m gamma = <q, r> (QJL, Definition 1 / Lemma 4: each
row s gives E[<s, q> sign(<s, r>)] = sqrt(2/pi) <q, r>/|r|), so <q, x^> is an unbiased estimate
of <q, x> and ordinary attention over the dequantized key x^ is the paper's estimator. The MSE
part alone is biased at low widths (for b - 1 = 1 the inner product shrinks by ~2/pi).

Here the sketch acts on the residual in the rotated basis (S r_y with r_y = r Pi): S Pi^T has
i.i.d. N(0, 1) entries too, so the estimator and its variance are the same as the paper's.

Shapes: the last axis is d; levels are 1-D and sorted ascending.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy import special
from torch import Tensor

from calibrate.quant import codebook, ordered

QJL_SCALE = math.sqrt(math.pi / 2)  # E|g| = sqrt(2/pi) for g ~ N(0, 1): the sketch's gain


def _beta_mass(d: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """P(a <= t <= b) under f: t = 2B - 1 with B ~ Beta((d-1)/2, (d-1)/2)."""
    alpha = (d - 1) / 2
    return special.betainc(alpha, alpha, (1 + b) / 2) - special.betainc(alpha, alpha, (1 + a) / 2)


def _beta_first_moment(d: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integral of t f(t) over [a, b], in closed form: K/(d-1) ((1-a^2)^((d-1)/2) - (1-b^2)^((d-1)/2))."""
    log_k = special.gammaln(d / 2) - 0.5 * math.log(math.pi) - special.gammaln((d - 1) / 2)
    p = (d - 1) / 2
    return math.exp(log_k) / (d - 1) * ((1 - a * a) ** p - (1 - b * b) ** p)


def beta_lloyd_max(d: int, bits: int, iters: int = 10_000, tol: float = 1e-13) -> Tensor:
    """The 2^bits Lloyd-Max levels (ascending, float32) of a coordinate of a random unit vector in R^d.

    Lloyd's iteration: thresholds at midpoints of adjacent levels, each level the conditional
    mean of its cell (closed forms above, float64), until no level moves by more than `tol`.
    f is log-concave for d >= 3, so the fixed point is the unique optimum.
    """
    if d < 3:
        raise ValueError(f"the coordinate law of Lemma 1 needs d >= 3, got d={d}")
    n = 2**bits
    spread = min(3.0 / math.sqrt(d), 0.9)
    levels = np.linspace(-spread, spread, n)
    for _ in range(iters):
        edges = np.concatenate(([-1.0], (levels[:-1] + levels[1:]) / 2, [1.0]))
        mass = _beta_mass(d, edges[:-1], edges[1:])
        new = np.where(mass > 0, _beta_first_moment(d, edges[:-1], edges[1:]) / np.maximum(mass, 1e-300), levels)
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            break
    return torch.tensor(levels, dtype=torch.float32)


def qjl_matrix(m: int, d: int, seed: int) -> Tensor:
    """S [m, d] with i.i.d. N(0, 1) entries (float32), from `seed`."""
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


@dataclass(frozen=True)
class Steps:
    """The per-head steps of kinds turbo and turbo_prod (codec.py): one head's (`head_steps`), or a
    head axis' (quant/headcodec.py), the same arithmetic either way."""

    nearest: Callable[[Tensor], Tensor]  # u -> indices of the nearest Lloyd-Max levels
    levels: Callable[[Tensor], Tensor]  # indices -> levels
    signs: Callable[[Tensor], Tensor]  # r -> QJL signs
    qjl: Callable[[Tensor, Tensor], Tensor]  # (signs, gamma) -> the QJL term


def head_steps(levels_L: Tensor, sketch_MD: Tensor | None) -> Steps:
    """`Steps` of one head: its Lloyd-Max levels and QJL sketch (None for kind turbo)."""
    return Steps(lambda u: mse_codes(u, levels_L), lambda c: codebook.decode(c, levels_L),
                 lambda r: qjl_signs(r, sketch_MD), lambda z, g: qjl_values(z, g, sketch_MD))


def mse_codes(u: Tensor, levels: Tensor) -> Tensor:
    """Index (uint8) of the level nearest each coordinate of u; ties to the lower index."""
    return codebook.nearest_level(u, levels)


def qjl_signs(r: Tensor, sketch_MD: Tensor, matmul=ordered.matmul) -> Tensor:
    """z = sign(S r) as {0, 1} (1 = +1, sign(0) = +1), uint8 [..., m].

    S r is summed in the fixed order of recipes/FORMAT.md (`ordered.matmul`; quant/headcodec.py passes
    its per-head form with one S per head): its sign is a code.
    """
    return (matmul(r, sketch_MD.transpose(-1, -2)) >= 0).to(torch.uint8)


def qjl_values(signs: Tensor, gamma: Tensor, sketch_MD: Tensor, matmul=ordered.matmul) -> Tensor:
    """(k gamma) (S^T z), k = float32(sqrt(pi/2) / m), z = 2 signs - 1: the QJL term of the
    reconstruction (S^T z summed over the m rows in the fixed order of `ordered`)."""
    z = 2.0 * signs.float() - 1.0
    k = torch.tensor(QJL_SCALE / sketch_MD.shape[-2], dtype=torch.float32)
    return (k * gamma.float()) * matmul(z, sketch_MD)
