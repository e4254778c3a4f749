"""The Jensen-bias correction of "Quantized Keys Steal Attention" (Tuncer, Becker, Pfeil, 2026).

Only the paper's abstract was readable; the formula is the reconstruction of the research spec
(/tmp/research/peers.md section 4), which matches every statement of the abstract: a
per-attention-score correction that removes the bias "in expectation", computed "on the fly
from the quantization step sizes of the cached keys and the query norm" by a "second-order
Taylor approximation", with no additional memory.

Derivation. A key rounded to a grid of step Delta is k^ = k + e with e_d uniform on
[-Delta_d/2, Delta_d/2], independent over channels. The logit of query q is
l^ = tau <q, k^> with tau = 1/sqrt(D), and softmax weighs keys by exp(l^). Over the noise

    E[exp(l^)] = exp(l) prod_d sinh(a_d) / a_d,      a_d = tau q_d Delta_d / 2,

larger than exp(l) (Jensen: exp is convex), so quantized keys take attention from exact ones
(the fresh frame). Subtracting log(sinh a / a) = a^2/6 - a^4/180 + ... from the logit removes
the bias in expectation; to second order

    c(q, key) = tau^2 / 24 * sum_d q_d^2 Delta_d^2 = sum_d q_d^2 Delta_d^2 / (24 D).

With one step per key (per-token groups covering the head) this is |q|^2 Delta^2 / (24 D): the
abstract's "query norm". Exact keys (Delta = 0: the fresh frame, float16 frames) get 0.

How it differs from the project's key-noise correction (quant/logit_noise.py,
fit/logit_correction.py), which subtracts alpha * sum_d (q R)_d^2 sigma_d^2 / (2 D):

- same functional form: half the logit-noise variance, with Var(e_d) = Delta_d^2 / 12 for
  uniform rounding noise; with sigma^2 = Delta^2/12, alpha = 1 and the same basis they agree;
- statistics: Jensen reads each cached key's *own* step sizes at run time (they are already
  stored as the frame's scales), so the correction differs per key and per frame: a frame
  coded with a wide range gets a larger correction than a narrow one. The project's uses one
  per-channel error variance fitted offline on calibration keys, the same for every quantized
  key of a query: it shifts quantized history as a block against exact keys but cannot
  re-rank quantized keys among themselves;
- noise model: Jensen assumes uniform rounding noise inside the grid (clipping, codebooks and
  the data's own error statistics are ignored); the project measures the real error variance,
  clipping included;
- strength: Jensen is alpha = 1 by its expectation argument (no tuning); the project fits
  alpha per head on its objective (0 included), because quantizers that clip also shrink the
  largest logits, which the expectation argument ignores;
- cost: both need no stored bytes per frame; Jensen reads the stored scales at attention time,
  the project's stores one [H, D] vector per layer in the recipe.

Pure functions; shapes [B, H, T, D] queries, [B, H, N, D] per-element key steps (0 = exact).
"""

from __future__ import annotations

import torch
from torch import Tensor


def code_basis_queries(q_BHTD: Tensor, rotation_HDD: Tensor | None) -> Tensor:
    """q @ R per head (R the keys' code-basis rotation; identity if None): steps live in that basis."""
    q = q_BHTD.float()
    return q if rotation_HDD is None else torch.einsum("bhtd,hde->bhte", q, rotation_HDD.float())


def jensen_bias(q_BHTD: Tensor, step_BHND: Tensor, rotation_HDD: Tensor | None = None) -> Tensor:
    """Second-order correction c [B, H, T, N] = sum_d (q R)_d^2 Delta_nd^2 / (24 D), to subtract from logits."""
    D = q_BHTD.shape[-1]
    q = code_basis_queries(q_BHTD, rotation_HDD)
    return torch.einsum("bhtd,bhnd->bhtn", q.pow(2), step_BHND.float().pow(2)) / (24 * D)


def jensen_bias_exact(q_BHTD: Tensor, step_BHND: Tensor, rotation_HDD: Tensor | None = None) -> Tensor:
    """The exact correction sum_d log(sinh(a) / a), a = (q R)_d Delta_nd / (2 sqrt(D)) (reference for tests)."""
    D = q_BHTD.shape[-1]
    q = code_basis_queries(q_BHTD, rotation_HDD).double()
    a = q.unsqueeze(3) * step_BHND.double().unsqueeze(2) / (2 * D**0.5)  # [B, H, T, N, D]
    small = a.abs() < 1e-4
    safe = torch.where(small, torch.ones_like(a), a)
    log_ratio = torch.where(small, a * a / 6, torch.log(torch.sinh(safe) / safe))
    return log_ratio.sum(-1).float()
