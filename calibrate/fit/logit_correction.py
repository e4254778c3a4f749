"""Fit the key-noise logit correction (quant/logit_noise.py): per layer, head and key channel.

1. Measure: fake-quantize the traced calibration keys (post-rotary, whole frames, so per-frame
   parameters are what the runtime computes) with the final spec at each head's own bits
   (outlier channels, sparse values and the compensator included), and take the per-channel
   variance of the error in the code basis (after the spec's rotation, where the noise lives).
   Only frames held at the head's own bits are corrected by the runtime: key frames, sink and
   recent frames are stored at other widths, with other (much smaller, or no) noise, and a
   variance measured at 2 bits would over-correct them.
2. Scale: the expected-inflation argument assumes key errors independent of the keys. A 2-bit
   quantizer that clips or whose static ranges sit off-center also shrinks the largest
   logits and shifts their mean (measured on TinyWorld: with the fitted recipe, quantized
   history *loses* attention to the fresh frame, while with unbiased quantizers such as
   quarot2 and kivi2 it gains it, as the argument predicts). So the fitter chooses a strength
   alpha per head from ALPHAS on the teacher-forced objective (alpha = 0, no correction, is a
   candidate; ties go to the smaller alpha) and stores alpha * sigma^2 as the role
   `logit_bias` [H, D]. A layer whose heads all choose 0 gets no tensor.

The choice and the objective at every alpha are recorded in the recipe's `fit` metadata.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from calibrate.quant.logit_noise import key_noise_variance, logit_inflation

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def key_error_variance(k_BHFTD: Tensor, k_hat_BHFTD: Tensor, rotation_HDD: Tensor | None) -> Tensor:
    """sigma^2 [H, D]: variance of the key error per channel in the code basis, over all tokens."""
    D = k_BHFTD.shape[-1]
    return torch.stack([key_noise_variance(k_BHFTD[:, h].reshape(-1, D), k_hat_BHFTD[:, h].reshape(-1, D),
                                           None if rotation_HDD is None else rotation_HDD[h])
                        for h in range(k_BHFTD.shape[1])])


def logit_shift(q_BHFTD: Tensor, var_HD: Tensor | None, rotation_HDD: Tensor | None, head_bits: list[int],
                class_bits: dict[str, int]) -> dict[str, Tensor] | None:
    """The correction as the objective applies it (objective.attention_outputs' `shift`):
    {class: c [B, H, F, T]} on the classes held at each head's own bits (`other` always, a
    token-policy class when its bits equal the head's), zero for the other heads."""
    if var_HD is None:
        return None
    B, H, F, T, D = q_BHFTD.shape
    c = logit_inflation(q_BHFTD.reshape(B, H, F * T, D), var_HD, rotation_HDD).reshape(B, H, F, T)
    native = torch.tensor(head_bits)
    on = lambda heads: c * heads.to(c.dtype).reshape(1, H, 1, 1)
    shift = {"other": on(native < 16)}
    shift.update({name: on((native == bits) & (native < 16)) for name, bits in class_bits.items()})
    return shift


def fit_logit_correction(traces, k_states, scores: Callable[[int], list[float]]) -> list[dict]:
    """Fit alpha per (layer, head) on `scores(layer)` (per-head objective with the layer's
    current states); sets each K state's `logit_var` and returns the record per layer."""
    record = []
    for layer, (trace, state) in enumerate(zip(traces, k_states)):
        var_HD = key_error_variance(trace.k, state.hat(trace.k), state.choice.tensors.get("rotation"))
        per_alpha = []
        for alpha in ALPHAS:
            state.logit_var = alpha * var_HD if alpha > 0 else None
            per_alpha.append(scores(layer))
        table = torch.tensor(per_alpha)  # [alphas, H]
        best_H = table.argmin(0)  # first minimum: ties go to the smaller alpha
        alpha_H = torch.tensor([ALPHAS[i] for i in best_H.tolist()])
        state.logit_var = alpha_H.unsqueeze(1) * var_HD if (alpha_H > 0).any() else None
        record.append({"layer": layer, "alpha": alpha_H.tolist(),
                       "objective": {str(a): round(float(row.sum()), 6) for a, row in zip(ALPHAS, table)},
                       "chosen_objective": round(float(table.gather(0, best_H.unsqueeze(0)).sum()), 6),
                       "mean_sigma2": [round(float(v), 6) for v in var_HD.mean(1)]})
    return record
