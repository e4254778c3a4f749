"""The recipe roles of a `kind="predictive"` tensor: shapes, dtypes, invariants, and the head's params.

Per layer and K or V (H heads, D = head_dim), all [H, D] except `rotation` [H, D, D]:

    rotation     float32  orthogonal: u = (x - mean) @ R
    mean         float32  finite
    unit         float32  finite, > 0 (1.0 for uncoded components)
    channel_bits int64    in [0, 8]; per head they sum to the spec's `token_bits[h]`
    intra_step   int64    >= 1
    inter_step   int64    >= 1
    anchor_bits  int64    0 where channel_bits == 0, else in [2, 16]; per head they sum to the
                          spec's `anchor_token_bits[h]`; every intra level and inter step fits:
                          intra_step * (2^b - 1) <= 2^(a-1) - 1 and inter_step <= 2^(a-1) - 1

and, with the spec's `sink_token_bits` (the sink code, quant/predictive.py), also [H, D]:

    sink_unit    float32  finite, > 0
    sink_bits    int64    in [0, 16]; per head they sum to the spec's `sink_token_bits[h]`

`check` raises `ValueError` naming the tensor; the recipe loader turns it into a `RecipeError`
with the file name. `head_params` builds one head's `PredictiveParams` from those tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from calibrate.quant.predictive import MAX_ANCHOR_BITS, MAX_BITS, PredictiveParams, field_limit, reference_bits

FLOAT_ROLES = ("mean", "unit")
INT_ROLES = ("channel_bits", "intra_step", "inter_step", "anchor_bits")
ROLES = ("rotation",) + FLOAT_ROLES + INT_ROLES
SINK_ROLES = ("sink_unit", "sink_bits")


def shapes(H: int, D: int, sink: bool = False) -> dict[str, tuple[int, ...]]:
    return {"rotation": (H, D, D), **{role: (H, D) for role in FLOAT_ROLES + INT_ROLES + (SINK_ROLES if sink else ())}}


def check(tensors: Mapping[str, Tensor], token_bits: list[int], anchor_token_bits: list[int], prefix: str,
          sink_token_bits: list[int] | None = None, refresh_token_bits: list[int] | None = None) -> None:
    """Invariants of one layer's K or V roles (shapes are checked by the loader before)."""
    if sink_token_bits is not None:
        check_sink(tensors, sink_token_bits, prefix)
    if refresh_token_bits is not None and (got := reference_token_bits(tensors)) != list(refresh_token_bits):
        raise ValueError(f"tensors '{prefix}.sink_bits' where channel_bits is 0 sum to {got} "
                         f"per head, the spec's refresh_token_bits says {list(refresh_token_bits)}")
    for role in FLOAT_ROLES:
        t = tensors[role]
        if t.dtype != torch.float32 or not torch.isfinite(t).all():
            raise ValueError(f"tensor '{prefix}.{role}' must be finite float32")
    if not (tensors["unit"] > 0).all():
        raise ValueError(f"tensor '{prefix}.unit' has non-positive values")
    for role in INT_ROLES:
        if tensors[role].dtype != torch.int64:
            raise ValueError(f"tensor '{prefix}.{role}' must be int64, got {tensors[role].dtype}")
    bits, anchor = tensors["channel_bits"], tensors["anchor_bits"]
    if ((bits < 0) | (bits > MAX_BITS)).any():
        raise ValueError(f"tensor '{prefix}.channel_bits' must lie in [0, {MAX_BITS}]")
    coded = bits > 0
    if (anchor[~coded] != 0).any() or ((anchor[coded] < 2) | (anchor[coded] > MAX_ANCHOR_BITS)).any():
        raise ValueError(f"tensor '{prefix}.anchor_bits' must be 0 where channel_bits is 0, else in [2, {MAX_ANCHOR_BITS}]")
    for role in ("intra_step", "inter_step"):
        if (tensors[role] < 1).any():
            raise ValueError(f"tensor '{prefix}.{role}' must be >= 1")
    limit = field_limit(anchor)  # 0 where uncoded: anchor_bits is 0 there (checked above)
    if (tensors["intra_step"] * ((1 << bits) - 1) > limit).any():
        raise ValueError(f"tensor '{prefix}.intra_step': an intra level lies outside the anchor range")
    if (torch.where(coded, tensors["inter_step"], 0) > limit).any():
        raise ValueError(f"tensor '{prefix}.inter_step': an inter step lies outside the anchor range")
    if bits.sum(-1).tolist() != list(token_bits):
        raise ValueError(f"tensor '{prefix}.channel_bits' sums to {bits.sum(-1).tolist()} per head, "
                         f"the spec's token_bits says {list(token_bits)}")
    if anchor.sum(-1).tolist() != list(anchor_token_bits):
        raise ValueError(f"tensor '{prefix}.anchor_bits' sums to {anchor.sum(-1).tolist()} per head, "
                         f"the spec's anchor_token_bits says {list(anchor_token_bits)}")


def reference_token_bits(tensors: Mapping[str, Tensor]) -> list[int]:
    """The sink refresh's reference bits per token of each head (format 1.5), summed over components."""
    return reference_bits(tensors["sink_bits"], tensors["channel_bits"]).sum(-1).tolist()


def check_sink(tensors: Mapping[str, Tensor], sink_token_bits: list[int], prefix: str) -> None:
    unit, bits = tensors["sink_unit"], tensors["sink_bits"]
    if unit.dtype != torch.float32 or not torch.isfinite(unit).all() or not (unit > 0).all():
        raise ValueError(f"tensor '{prefix}.sink_unit' must be finite float32 > 0")
    if bits.dtype != torch.int64 or ((bits < 0) | (bits > MAX_ANCHOR_BITS)).any():
        raise ValueError(f"tensor '{prefix}.sink_bits' must be int64 in [0, {MAX_ANCHOR_BITS}]")
    if bits.sum(-1).tolist() != list(sink_token_bits):
        raise ValueError(f"tensor '{prefix}.sink_bits' sums to {bits.sum(-1).tolist()} per head, "
                         f"the spec's sink_token_bits says {list(sink_token_bits)}")


def head_params(tensors: Mapping[str, Tensor], head: int) -> PredictiveParams:
    sink = "sink_unit" in tensors
    return PredictiveParams(tensors["mean"][head], tensors["rotation"][head], tensors["unit"][head],
                            tensors["channel_bits"][head], tensors["intra_step"][head], tensors["inter_step"][head],
                            tensors["anchor_bits"][head], tensors["sink_unit"][head] if sink else None,
                            tensors["sink_bits"][head] if sink else None)


def stack_heads(params: list[PredictiveParams]) -> dict[str, Tensor]:
    """Role tensors [H, ...] of a list of per-head params (the fitter's output)."""
    return {"rotation": torch.stack([p.rotation_DD for p in params]), "mean": torch.stack([p.mean_D for p in params]),
            "unit": torch.stack([p.unit_D for p in params]), "channel_bits": torch.stack([p.bits_D for p in params]),
            "intra_step": torch.stack([p.intra_step_D for p in params]),
            "inter_step": torch.stack([p.inter_step_D for p in params]),
            "anchor_bits": torch.stack([p.anchor_bits_D for p in params]),
            **({"sink_unit": torch.stack([p.sink_unit_D for p in params]),
                "sink_bits": torch.stack([p.sink_bits_D for p in params])} if params[0].has_sink else {})}
