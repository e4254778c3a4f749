"""Key-noise logit correction: quantized keys inflate the attention mass of quantized history.

A stored key k^ = k + e (e the quantization error) gives the logit of query q

    l^ = q.k^ / sqrt(D) = l + n,        n = q.e / sqrt(D).

Softmax weights are exp(l^). Over the noise, E[exp(n)] = exp(Var(n) / 2) for a roughly
Gaussian n (a sum of D per-channel rounding errors), so every quantized key gets on average
exp(Var(n)/2) times the weight its exact key would: quantized history "steals" attention from
the frames that are not quantized (the fresh frame being generated, float16 recent frames).
With independent per-channel errors of variance sigma_c^2,

    Var(n) = sum_c q_c^2 sigma_c^2 / D,     so subtract  c(q) = sum_c q_c^2 sigma_c^2 / (2 D)

from the logits of quantized keys (the same amount for every key of one precision class:
it depends on the query, not on the key).

Where the noise lives. Keys are stored post-rotary (the model's positional rotation already
applied) and, if the spec has an orthogonal rotation R, quantized as y = k @ R; the error is
made channel by channel in that basis: e = e_y @ R^T. Since q.e = (q @ R).e_y, the variances
are estimated and applied in the code basis (y), where channel errors are close to
independent (each channel is rounded on its own; in the model's basis a rotation mixes them,
and a diagonal there would miss the cross terms). Without a rotation the two bases agree.
Only the variance about the mean is used: a mean error shifts logits by q.mu / sqrt(D), which
can have either sign per query and is not an inflation.

Pure functions: shapes are [..., D]; `rotation_DD` None means identity.
"""

from __future__ import annotations

import torch
from torch import Tensor


def key_noise_variance(k_ND: Tensor, k_hat_ND: Tensor, rotation_DD: Tensor | None = None) -> Tensor:
    """Per-channel variance [D] of the key error k^ - k in the code basis (over the N tokens)."""
    e = (k_hat_ND - k_ND).double()
    if rotation_DD is not None:
        e = e @ rotation_DD.double()
    return e.var(dim=0, unbiased=False).float()


def logit_inflation(q_BHTD: Tensor, var_HD: Tensor, rotation_HDD: Tensor | None = None) -> Tensor:
    """Expected logit inflation c [B, H, T] = sum_c (q R)_c^2 var_c / (2 D) of each query token."""
    D = q_BHTD.shape[-1]
    q = q_BHTD.float()
    if rotation_HDD is not None:
        q = torch.einsum("bhtd,hde->bhte", q, rotation_HDD.float())
    return torch.einsum("bhtd,hd->bht", q.pow(2), var_HD.float()) / (2 * D)
