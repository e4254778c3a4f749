"""A standalone reader of `kv-recipe` files (recipes/FORMAT.md), for other runtimes to copy.

It needs only `json`, `struct`, `numpy` and `safetensors` (numpy API), not torch and not the
`calibrate` package, and shows how little a foreign runtime must implement to load a recipe and
dequantize stored frames: the metadata checks, the sub-byte unpacking, and the affine and
codebook reconstructions. `tests/test_reader.py` holds it to `calibrate`'s own loader and codec.

    metadata, tensors = read_recipe("recipe.safetensors")
    spec = metadata["scheme"]["layers"][0]["k"]          # a TensorSpec as a dict
    scale = tensors["layers.0.k.scale"]                   # [H, D] float32 (static per-channel)
    var = tensors.get("layers.0.k.logit_bias")             # [H, D] or None: key-noise logit correction
"""

import json
import struct

import numpy as np
from safetensors import safe_open

FORMAT = "kv-recipe"
MAJOR = 1  # the format major version this reader understands
REQUIRED = ("format", "format_version", "producer", "model", "scheme")
JSON_FIELDS = ("model", "scheme", "calibration", "metrics", "memory", "fit")


def _check_header(path):
    """A safetensors file starts with a little-endian u64 header length and a JSON header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        header = f.read(n) if n < 100_000_000 else b""
    if len(header) != n or not header.startswith(b"{"):
        raise ValueError(f"{path}: not a safetensors file (bad header of {n} bytes)")


def read_recipe(path):
    """(metadata with its JSON fields parsed, {tensor name: numpy array}); ValueError if unusable.

    Keys other than the known ones are returned as raw strings; a runtime should warn about them.
    """
    path = str(path)
    _check_header(path)
    with safe_open(path, framework="numpy") as f:
        raw = dict(f.metadata() or {})
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for key in REQUIRED:
        if key not in raw:
            raise ValueError(f"{path}: metadata field '{key}' is missing")
    if raw["format"] != FORMAT:
        raise ValueError(f"{path}: metadata field 'format' is {raw['format']!r}, expected {FORMAT!r}")
    major = raw["format_version"].split(".")[0]
    if major != str(MAJOR):
        raise ValueError(f"{path}: metadata field 'format_version' is {raw['format_version']}, this reader reads {MAJOR}.x")
    meta = dict(raw)
    for key in JSON_FIELDS:
        if key in raw:
            try:
                meta[key] = json.loads(raw[key])
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: metadata field '{key}' is not valid JSON ({e})") from None
    return meta, tensors


def unpack(packed, bits, n):
    """uint8 [..., ceil(n/8)*bits] -> codes uint8 [..., n]: LSB-first bit stream per row."""
    packed = np.asarray(packed, dtype=np.uint8)
    stream = np.unpackbits(packed, axis=-1, bitorder="little")  # [..., nbytes*8], bit j of the row
    per_code = stream.reshape(*packed.shape[:-1], -1, bits).astype(np.uint8)  # [..., codes, bits]
    codes = np.zeros(per_code.shape[:-1], dtype=np.uint8)
    for k in range(bits):
        codes |= per_code[..., k] << k
    return codes[..., :n]


def _qmin(bits, symmetric):
    return -(2 ** (bits - 1)) if symmetric else 0


def _per_group(x, params, group_size):
    """Apply float16-stored per-(token, group) parameters [..., D/G] or [..., D/G, 1] to x [..., D]."""
    D = x.shape[-1]
    g = x.reshape(*x.shape[:-1], D // group_size, group_size)
    return g, np.asarray(params, dtype=np.float32).reshape(*g.shape[:-1], 1)


def dequantize_uniform_token(codes, scale, zero, bits, symmetric, group_size):
    """Per-token dynamic groups: codes [..., D]; scale, zero (None if symmetric) [..., D/G] or [..., D/G, 1].

    x = (code + qmin) * scale + zero, each group of `group_size` channels with its own float16
    scale/zero, computed in float32.
    """
    codes = np.asarray(codes)
    g, s = _per_group(codes.astype(np.float32), scale, group_size)
    x = (g + _qmin(bits, symmetric)) * s
    if zero is not None:
        x = x + _per_group(codes, zero, group_size)[1]
    return x.reshape(codes.shape)


def dequantize_static_channel(codes, scale, zero, bits, symmetric):
    """Per-channel parameters broadcast over tokens: codes [..., T, D]; scale, zero [D].

    Static recipes pass roles `scale`[h] / `zero_point`[h] (zero is added for symmetric too; a
    frame stored at another width than the spec's uses the re-cut scale of FORMAT.md);
    the same formula decodes the dynamic per-channel case with the frame's stored [..., 1, D]
    parameters (zero None when symmetric).
    """
    x = (np.asarray(codes).astype(np.float32) + _qmin(bits, symmetric)) * np.asarray(scale, dtype=np.float32)
    return x if zero is None else x + np.asarray(zero, dtype=np.float32)


def dequantize_codebook(codes, levels, scale, zero=None, group_size=None):
    """Codebook: level[code] * scale (+ zero). Static per-channel: scale, zero [D], group_size None;
    dynamic: scale [..., D/G(, 1)] per token and group of `group_size` channels, zero None."""
    codes = np.asarray(codes)
    vals = np.asarray(levels, dtype=np.float32)[codes.astype(np.int64)]
    if group_size is None:
        x = vals * np.asarray(scale, dtype=np.float32)
        return x if zero is None else x + np.asarray(zero, dtype=np.float32)
    g, s = _per_group(vals, scale, group_size)
    return (g * s).reshape(codes.shape)


def logit_correction(q, logit_bias, rotation=None):
    """Amount to subtract from the logits of one head's keys held at the spec's own bits.

    q [..., D] (post-rotary queries of that head), logit_bias [D] (role `logit_bias`[h]),
    rotation [D, D] (role `rotation`[h]) or None: c = sum_c ((q @ R)_c)^2 * logit_bias_c / (2 D),
    one value per query token [...], the same for every corrected key (FORMAT.md).
    """
    q = np.asarray(q, dtype=np.float32)
    if rotation is not None:
        q = q @ np.asarray(rotation, dtype=np.float32)
    return (q * q) @ np.asarray(logit_bias, dtype=np.float32) / (2 * q.shape[-1])


# ---- format 1.1: predictive tensors (FORMAT.md "Predictive tensors") -----------------------------
def unpack_fields(packed, widths):
    """uint8 [..., ceil(sum(widths)/8)] -> int64 [..., n]: mixed-width fields, LSB-first bit stream."""
    widths = np.asarray(widths, dtype=np.int64)
    stream = np.unpackbits(np.asarray(packed, dtype=np.uint8), axis=-1, bitorder="little").astype(np.int64)
    out = np.zeros((*stream.shape[:-1], len(widths)), dtype=np.int64)
    offset = 0
    for i, w in enumerate(widths):
        for k in range(w):
            out[..., i] |= stream[..., offset + k] << k
        offset += w
    return out


def predictive_states(stored, tensors, layer, kind, head, v_prev=None):
    """Integer states [B, T, D] of one head of one held frame of a predictive tensor.

    `stored` is the frame's stored form: {"anchor"} or {"modes", "codes"} (uint8 arrays, chain.py);
    `v_prev` the previous frame's states (None if it is not held: then every token is intra).
    """
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    bits, anchor = t("channel_bits"), t("anchor_bits")
    if "anchor" in stored:
        offset = np.where(anchor > 0, 1 << np.maximum(anchor - 1, 0), 0)
        return unpack_fields(stored["anchor"], anchor) - offset
    codes = unpack_fields(stored["codes"], bits)
    T = codes.shape[-2]
    inter = unpack_fields(stored["modes"], [1] * T).astype(bool)
    n = (1 << bits) - 1
    v = t("intra_step") * (2 * codes - n)
    if inter.any():
        if v_prev is None:
            raise ValueError("a frame with inter-coded tokens needs the previous frame's states")
        v = np.where(inter[..., None], v_prev + t("inter_step") * (2 * codes - n), v)
    return v


def predictive_values(v, tensors, layer, kind, head):
    """x̂ = (unit * v) @ R^T + mean, float32 (keys: before the rotary encoding if `rotary_coords`)."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head], dtype=np.float32)
    return (t("unit") * np.asarray(v, dtype=np.float32)) @ t("rotation").T + t("mean")
