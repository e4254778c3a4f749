"""The JSON types and ranges of a recipe's metadata fields, and a strict parser for them.

recipes/FORMAT.md gives every field of `model`, `scheme.policy` and a `TensorSpec` a JSON type;
this module is that table as code (`MODEL_FIELDS`, `POLICY_FIELDS`, `SPEC_FIELDS`) and the parser
that holds a decoded JSON value to it. Strict means what a JSON reader in another language would
see: an *int* is a JSON number written without fraction or exponent (`2`, never `2.0` and never
`true`: Python's `json` gives `bool` for `true`, and `bool` is an `int` subclass), a *number* is
any finite JSON number (an int is one), a *bool* is `true`/`false` (never `"no"`, never `0`), a
*str* is a JSON string. A value of the wrong type is an error naming the field, never coerced:
`"symmetric": "no"` read as truthy would change every code.

Ranges that need nothing but the value are checked here (bits in {2, 3, 4, 8, 16}, clip in
(0, 1], ...); those that need the model or other fields (head_bits has H entries, group_size
divides D, the kind's own rules) are checked by `recipe.validate`.

Errors are `FieldError` ("<where>.<field>: <problem>, got <value>"); the loader adds the file.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calibrate.codes import NAMES
from calibrate.plan import RECALL_KEYS, REUSE_RULES

ALLOWED_BITS = (2, 3, 4, 8, 16)
CODE_KINDS = NAMES  # calibrate/codes/: the registry of kinds
ROTATIONS = ("none", "hadamard", "learned", "random")
AXES = ("token", "channel")
VERSION_RE = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")  # MAJOR.MINOR, decimal, no leading zeros
TENSOR_NAME_RE = re.compile(r"layers\.(0|[1-9][0-9]*)\.(k|v)\.([a-z_]+)")


class FieldError(ValueError):
    """A metadata value of the wrong JSON type or out of its range; the message names the field."""


def _show(v: Any) -> str:
    """The value as JSON would spell it (so 2.0 stays 2.0 and True shows as true)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'the string "{v}"'
    if v is None:
        return "null"
    return repr(v)


def is_int(v: Any) -> bool:
    return type(v) is int


def is_number(v: Any) -> bool:
    return (type(v) is int) or (type(v) is float and math.isfinite(v))


@dataclass(frozen=True)
class Field:
    """One metadata field: its JSON type (`int`, `number`, `bool`, `str`, `int list or null`) and
    a range check returning what is wrong with an accepted-type value, or None."""

    type: str
    check: Callable[[Any], str | None] | None = None


def _one_of(choices) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(map(_json_choice, choices))}"


def _json_choice(c) -> str:
    return f'"{c}"' if isinstance(c, str) else str(c)


def _at_least(lo: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= lo else f"must be >= {lo}"


def _between(lo: int, hi: int) -> Callable[[Any], str | None]:
    return lambda v: None if lo <= v <= hi else f"must lie in [{lo}, {hi}]"


def float32(v: float) -> float:
    """`v` rounded to the nearest float32 (ties to even), as the codec uses a JSON number."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _clip(v) -> str | None:
    if not 0 < v <= 1:
        return "must lie in (0, 1]"
    if not float32(v) > 0:
        return "must lie in (0, 1] after rounding to float32 (it rounds to 0)"
    return None


def _fraction(v) -> str | None:
    return None if 0 <= v < 1 else "must lie in [0, 1)"


MODEL_FIELDS = {
    "name": Field("str"),
    "num_layers": Field("int", _at_least(1)),
    "num_kv_heads": Field("int", _at_least(1)),
    "head_dim": Field("int", _at_least(1)),
    "tokens_per_frame": Field("int", _at_least(1)),
    "fingerprint": Field("str"),
}

POLICY_FIELDS = {
    "sink_frames": Field("int", _at_least(0)),
    "sink_bits": Field("int", _one_of(ALLOWED_BITS)),
    "recent_frames": Field("int", _at_least(0)),
    "recent_bits": Field("int", _one_of(ALLOWED_BITS)),
    "keyframe_interval": Field("int", _at_least(0)),
    "keyframe_bits": Field("int", _one_of(ALLOWED_BITS)),
}

SPEC_FIELDS = {
    "bits": Field("int", _one_of(ALLOWED_BITS)),
    "head_bits": Field("int list or null", _one_of(ALLOWED_BITS)),
    "kind": Field("str", _one_of(CODE_KINDS)),
    "symmetric": Field("bool"),
    "axis": Field("str", _one_of(AXES)),
    "group_size": Field("int", _at_least(0)),
    "static": Field("bool"),
    "clip": Field("number", _clip),
    "rotation": Field("str", _one_of(ROTATIONS)),
    "outliers": Field("int", _at_least(0)),
    "sparse_fraction": Field("number", _fraction),
    "centroids": Field("int", _between(0, 256)),
    "comp_rank": Field("int", _at_least(0)),
    "rotary_coords": Field("int", _at_least(0)),
    "token_bits": Field("int list or null", _at_least(0)),
    "anchor_token_bits": Field("int list or null", _at_least(0)),
    "sink_token_bits": Field("int list or null", _at_least(0)),
    "sink_hold": Field("bool"),
    "sink_refresh": Field("int", _at_least(0)),
    "refresh_token_bits": Field("int list or null", _at_least(0)),
    "temporal": Field("bool"),
    "prq_stages": Field("int", _at_least(0)),
    "prq_centroids": Field("int", _between(0, 256)),
    "prq_span_frames": Field("int", _at_least(1)),
    "prq_kmeans_iters": Field("int", _at_least(1)),
    "prq_deferred": Field("bool"),
    "jensen": Field("bool"),
}

# scheme.policy.plan (format 1.1, calibrate/plan.py); cross-field rules: MemoryPlan.check
PLAN_FIELDS = {
    "device_budget_bytes": Field("int", _at_least(1)),
    "window": Field("int", _at_least(1)),
    "sink_frames": Field("int", _at_least(0)),
    "recall_slots": Field("int", _at_least(0)),
    "host_frames": Field("int", _at_least(0)),
    "recall": Field("str", _one_of(RECALL_KEYS)),
    "yaw_radius": Field("number", _at_least(0)),
    "reuse": Field("str", _one_of(REUSE_RULES)),
}

TYPE_PROBLEMS = {
    "int": "must be a JSON integer (no fraction or exponent, not true/false)",
    "number": "must be a finite JSON number",
    "bool": "must be true or false",
    "str": "must be a JSON string",
    "int list or null": "must be null or a list of JSON integers",
}


def check_value(f: Field, v: Any, where: str) -> None:
    """Raise FieldError unless `v` has the field's JSON type and range."""
    if f.type == "int list or null":
        if v is None:
            return
        if not isinstance(v, list) or not all(is_int(x) for x in v):
            raise FieldError(f"{where}: {TYPE_PROBLEMS[f.type]}, got {_show(v)}")
        for i, x in enumerate(v):
            problem = f.check(x) if f.check else None
            if problem:
                raise FieldError(f"{where}[{i}]: {problem}, got {_show(x)}")
        return
    ok = {"int": is_int, "number": is_number, "bool": lambda x: type(x) is bool, "str": lambda x: type(x) is str}[f.type]
    if not ok(v):
        raise FieldError(f"{where}: {TYPE_PROBLEMS[f.type]}, got {_show(v)}")
    problem = f.check(v) if f.check else None
    if problem:
        raise FieldError(f"{where}: {problem}, got {_show(v)}")


def parse_object(d: Any, table: dict[str, Field], where: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of JSON object `d`, each checked against `table`; unknown or missing fields are errors."""
    if not isinstance(d, dict):
        raise FieldError(f"{where}: must be a JSON object, got {_show(d) if not isinstance(d, (list, dict)) else type(d).__name__}")
    unknown = sorted(set(d) - set(table))
    if unknown:
        raise FieldError(f"{where}: unknown field(s) {unknown}")
    missing = [name for name in required if name not in d]
    if missing:
        raise FieldError(f"{where}: missing field(s) {missing}")
    for name, value in d.items():
        check_value(table[name], value, f"{where}.{name}")
    return dict(d)


def check_version(found: str, major: int) -> str | None:
    """What is wrong with a `format_version` value for a reader of `major`.x, or None."""
    m = VERSION_RE.fullmatch(found) if isinstance(found, str) else None
    if m is None:
        return f"must be MAJOR.MINOR (decimal digits, no leading zeros), got {found!r}"
    if int(m.group(1)) != major:
        return f"is {found!r}, this reader reads {major}.x"
    return None


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """(layer, "k" | "v", role) of `layers.{i}.{k|v}.{role}` (i decimal, no leading zeros), else None."""
    m = TENSOR_NAME_RE.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2), m.group(3))
