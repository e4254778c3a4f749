"""Low-rank residual compensation: a static linear correction of dequantized K or V.

After the best scales and rotations, 2-bit error is not pure noise: clipping saturates the
largest values toward the range ends, and per-token scales shrink some directions more than
others, so part of the residual r = y - y^ is predictable from y^ itself. The compensator is
the best rank-r linear map C = down @ up with

    y  ~  y^ + y^ C          (y the rotated original, y^ its dequantized value, per head)

fitted in closed form as a reduced-rank ridge regression on calibration tokens:

    W  = (Y^T Y^ + lambda I)^-1 Y^T R                 (ridge: full D x D map)
    F  = Y^ W = U S V^T                               (the fitted corrections)
    C  = W V_r V_r^T   ->   down = W V_r, up = V_r^T  (keep the r directions that explain most
                                                       of the correction on the data)

Ridge (lambda relative to the mean eigenvalue of Y^T Y^) keeps the map small where y^ carries
no information; the reduced-rank truncation is optimal in the data metric, unlike truncating
W itself. Rank 0 means no tensors at all, so it is exactly the identity. The runtime applies
the map on read (`codec._finish`), before the inverse rotation; its parameters are static
recipe tensors (2 x D x r floats per head), not per-frame bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fit_compensator(y_ND: Tensor, y_hat_ND: Tensor, rank: int, ridge: float = 1e-2) -> tuple[Tensor, Tensor]:
    """(down [D, r], up [r, D]) minimizing ||y_hat + y_hat @ down @ up - y||^2 + ridge penalty."""
    D = y_ND.shape[-1]
    if not 0 <= rank <= D:
        raise ValueError(f"compensator rank must be in [0, head_dim={D}], got {rank}")
    if rank == 0:
        return y_ND.new_zeros(D, 0), y_ND.new_zeros(0, D)
    yh, r = y_hat_ND.double(), (y_ND - y_hat_ND).double()
    gram = yh.T @ yh
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    W = torch.linalg.solve(gram + lam * torch.eye(D, dtype=gram.dtype), yh.T @ r)
    _, _, Vh = torch.linalg.svd(yh @ W, full_matrices=False)
    V_r = Vh[:rank].T  # [D, r]
    return (W @ V_r).float(), V_r.T.float().contiguous()


def residual_mse(y_ND: Tensor, y_hat_ND: Tensor, down: Tensor | None = None, up: Tensor | None = None) -> float:
    corrected = y_hat_ND if down is None or down.shape[1] == 0 else y_hat_ND + (y_hat_ND @ down) @ up
    return float((corrected - y_ND).pow(2).mean())
