"""Quantization primitives: pure functions of tensors and explicit parameters.

Nothing here does I/O, keeps state, or imports the rest of the project.

* :mod:`~calibrate.quant.affine`: uniform affine quantization (symmetric / asymmetric),
  parameters with an explicit granularity, clipping, fake-quant with a straight-through
  gradient, group views.
* :mod:`~calibrate.quant.codebook`: non-uniform levels (nearest-level encoding, Lloyd-Max fit).
* :mod:`~calibrate.quant.rotation`: Hadamard and random orthogonal rotations (``y = x @ Q``).
* :mod:`~calibrate.quant.packing`: the exact sub-byte layout of ``recipes/FORMAT.md``.

Stored codes are ``uint8`` in ``[0, 2^b - 1]`` everywhere, so any of the quantizers feeds
:func:`~calibrate.quant.packing.pack` directly.
"""

from calibrate.quant import affine, codebook, packing, rotation

__all__ = ["affine", "codebook", "packing", "rotation"]
