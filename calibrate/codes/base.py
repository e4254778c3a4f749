"""What every code kind is (`Kind`) and what the per-frame kinds share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from calibrate.quant import packing

if TYPE_CHECKING:
    from calibrate.scheme_spec import TensorSpec

FP = torch.float16  # storage type of kept-in-full-precision values and dynamic parameters
FP_EPS = 2.0**-24  # smallest positive float16: dynamic scales never round to 0 when stored


def no_roles(spec: TensorSpec, H: int, D: int) -> dict[str, tuple[int, ...]]:
    return {}


def no_check(spec: TensorSpec, where: str) -> str | None:
    return None


@dataclass(frozen=True)
class Kind:
    """One way of turning values into codes, and everything the rest of the package asks of it.

    Per-frame kinds (`quantize` set) code the prepared y of one frame, [..., T, D] with any
    leading axes (codec.py's steps 1-4 come before, 4-1 after): `quantize(y, spec, p, steps=None)`
    -> (codes unpacked, dynamic parameters), `dequantize(codes, dyn, spec, p, steps=None)` -> y,
    `code_nbytes(spec, bits, B, T, D)` -> bytes of packed codes and dynamic parameters. `steps`
    (quant/turbo.Steps: nearest level, level of a code, QJL) lets quant/headcodec.py pass one
    table row per head; None takes the head's own row from `p`. A kind without `quantize`
    (predictive) codes across frames elsewhere (chain.py, fast_chain.py).
    """

    name: str
    quantize: Callable | None = None
    dequantize: Callable | None = None
    code_nbytes: Callable[[TensorSpec, int, int, int, int], int] | None = None
    roles: Callable[[TensorSpec, int, int], dict[str, tuple[int, ...]]] = no_roles  # the kind's own roles: shapes
    check: Callable[[TensorSpec, str], str | None] = no_check  # the kind's own rules on a spec: the problem, or None
    uniform_step: bool = False  # every coded element has a uniform grid step (the Jensen correction, codec.key_steps)
    per_token: bool = False  # codes per token: axis "token", not static
    own_width: bool = False  # levels for the spec's one width only: sink/recent/key frames at 16 bits or that width
    frame_wide: bool = False  # a dynamic parameter spans the frame's tokens: a runtime codes the frame whole
    table: str | None = None  # the role whose per-head rows `steps` looks codes up in (quant/headcodec.py)


def packed_nbytes(spec: TensorSpec, bits: int, B: int, T: int, D: int, params_per_group: int) -> int:
    """Packed b-bit codes plus `params_per_group` float16 parameters per group of dynamic ranges
    (per token and group on axis "token", per channel on a dynamic axis "channel", none if static)."""
    n = B * T * packing.packed_nbytes(D, bits)
    if not (spec.axis == "channel" and spec.static):
        groups = T * (D // (spec.group_size or D)) if spec.axis == "token" else D
        n += B * groups * params_per_group * 2
    return n
