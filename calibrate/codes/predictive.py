"""Kind "predictive": a transform code across frames (quant/predictive.py; the runtimes' chain.py
and fast_chain.py), its roles in predictive_roles.py. It has no per-frame quantize."""

from __future__ import annotations

from calibrate import predictive_roles
from calibrate.codes.base import Kind

FIELDS = ("bits", "rotation", "rotary_coords", "token_bits", "anchor_token_bits", "sink_token_bits", "sink_hold",
          "sink_refresh", "refresh_token_bits", "temporal")


def check(s, where: str) -> str | None:
    from calibrate.scheme_spec import TensorSpec  # the fields' defaults

    plain = TensorSpec(kind="predictive", **{name: getattr(s, name) for name in FIELDS})
    if s != plain:
        return (f"{where}: a predictive spec sets only {', '.join(FIELDS[:-1])} and {FIELDS[-1]} (the other fields "
                "belong to per-frame codes)")
    if s.rotation == "none" or s.token_bits is None or s.anchor_token_bits is None:
        return f"{where}: a predictive spec needs a rotation, token_bits and anchor_token_bits"
    if s.sink_hold and s.sink_token_bits is None:
        return f"{where}.sink_hold: holds the sink code's values, so it needs sink_token_bits"
    if (s.sink_refresh > 0) != (s.refresh_token_bits is not None):
        return f"{where}.sink_refresh: a refreshed reference (sink_refresh > 0) goes with refresh_token_bits, and only with it"
    if s.sink_refresh and not s.sink_hold:
        return f"{where}.sink_refresh: refreshes the sink hold's reference, so it needs sink_hold"
    return None


KIND = Kind("predictive", roles=lambda spec, H, D: predictive_roles.shapes(H, D, spec.sink_token_bits is not None),
            check=check)
