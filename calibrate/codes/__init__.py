"""The registry of code kinds: one module per kind, every list of kinds derived from `KINDS`.

A kind (`base.Kind`) says how values become codes and back (per-frame kinds), what its codes and
dynamic parameters take in bytes, its own tensor roles and spec rules, and a few properties the
runtimes and the recipe checks ask about (`uniform_step`, `per_token`, `own_width`, `frame_wide`,
`table`).
A new kind is one module here plus one entry below; the numpy reader (recipes/reader.py) and
recipes/FORMAT.md describe the same kinds independently, by design: a runtime written from the
spec alone.
"""

from calibrate.codes import codebook, nvfp4, predictive, prq, turbo, uniform
from calibrate.codes.base import FP, FP_EPS, Kind

KINDS: dict[str, Kind] = {k.name: k for k in (uniform.KIND, codebook.KIND, prq.KIND, turbo.MSE, turbo.PROD,
                                              nvfp4.KIND, predictive.KIND)}
NAMES = tuple(KINDS)
PER_FRAME = tuple(name for name, k in KINDS.items() if k.quantize is not None)

__all__ = ["FP", "FP_EPS", "KINDS", "Kind", "NAMES", "PER_FRAME"]
