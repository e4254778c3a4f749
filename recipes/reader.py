"""A standalone reader of `kv-recipe` files (recipes/FORMAT.md), for other runtimes to copy.

It needs only `json`, `struct`, `numpy` and `safetensors` (numpy API), not torch and not the
`calibrate` package, and shows how little a foreign runtime must implement to load a recipe and
dequantize stored frames: the metadata checks, the sub-byte unpacking, and the affine and
codebook reconstructions. `tests/test_reader.py` holds it to `calibrate`'s own loader and codec.

    metadata, tensors = read_recipe("recipe.safetensors")
    spec = metadata["scheme"]["layers"][0]["k"]          # a TensorSpec as a dict
    scale = tensors["layers.0.k.scale"]                   # [H, D] float32 (static per-channel)
    var = tensors.get("layers.0.k.logit_bias")             # [H, D] or None: key-noise logit correction

Format 1.1 kinds (FORMAT.md): `dequantize_prq` (Quant VideoGen), `dequantize_turbo` and
`dequantize_turbo_prod` (TurboQuant), and `jensen_correction` for specs with `jensen`.
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
    check_kinds(path, meta)
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


# ---- format 1.1 -----------------------------------------------------------------------------------
KINDS = ("uniform", "codebook", "prq", "turbo", "turbo_prod", "predictive")  # a kind outside this list: refuse the recipe


def check_kinds(path, meta):
    """ValueError naming the field if a spec of `meta["scheme"]` has a kind this reader cannot decode."""
    for i, layer in enumerate(meta["scheme"]["layers"]):
        for kv in ("k", "v"):
            kind = layer[kv].get("kind", "uniform")
            if kind not in KINDS:
                raise ValueError(f"{path}: scheme.layers[{i}].{kv}.kind {kind!r} is not one this reader decodes ({', '.join(KINDS)})")


def fp8_e4m3(bits_u8):
    """FP8 E4M3 (float8_e4m3fn) bit patterns (uint8) -> float32: sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6); 0x7f / 0xff are NaN; no infinities."""
    b = np.asarray(bits_u8, dtype=np.uint8).astype(np.int32)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return (sign * val).astype(np.float32)


def index_bits(num_centroids):
    """Width of a stored centroid index: the fewest of 1, 2, 3, 4, 8 bits that hold C values (0 if C = 1)."""
    return 0 if num_centroids <= 1 else next(w for w in (1, 2, 3, 4, 8) if 2**w >= num_centroids)


def dequantize_prq(codes, scale_fp8, bits, group_size, centroids=None, assign=None, num_centroids=1):
    """Kind "prq": codes [B, T, D] (unpacked), scale_fp8 [B, T, D/G(, 1)] (uint8 E4M3 bit patterns),
    centroids [B, S, C, D] (float16, the span's state) or None when prq_stages = 0, assign
    [B, S, ceil(T/8) w] (packed indices, w = index_bits(C)) or None when C = 1.

    x = (u - q_max) * s + sum_s centroids[s][a_s], q_max = 2^(b-1) - 1.
    """
    codes = np.asarray(codes)
    B, T, D = codes.shape
    g, s = _per_group(codes.astype(np.float32), fp8_e4m3(scale_fp8), group_size)
    x = ((g - (2 ** (bits - 1) - 1)) * s).reshape(codes.shape)
    if centroids is None:
        return x
    cents = np.asarray(centroids, dtype=np.float32)
    S = cents.shape[1]
    ids = np.zeros((B, S, T), dtype=np.int64) if assign is None else unpack(assign, index_bits(num_centroids), T).astype(np.int64)
    for st in range(S):
        x = x + np.take_along_axis(cents[:, st], ids[:, st, :, None], axis=1)
    return x


def dequantize_turbo(codes, norm, levels, rotation=None):
    """Kind "turbo": x = (levels[code] * norm) @ R^T; codes [..., D], norm [..., 1] (float16), levels [2^b]."""
    y = np.asarray(levels, dtype=np.float32)[np.asarray(codes).astype(np.int64)] * np.asarray(norm, dtype=np.float32)
    return y if rotation is None else y @ np.asarray(rotation, dtype=np.float32).T


def dequantize_turbo_prod(codes, norm, gamma, levels, qjl, bits, rotation=None):
    """Kind "turbo_prod": code = i + 2^(b-1) z; u = levels[i] + sqrt(pi/2)/m * gamma * (2z - 1) @ S;
    x = (u * norm) @ R^T. codes [..., D]; norm, gamma [..., 1] (float16); levels [2^(b-1)]; S [m, D]."""
    codes = np.asarray(codes).astype(np.int64)
    top = bits - 1
    S = np.asarray(qjl, dtype=np.float32)
    z = 2.0 * (codes >> top) - 1.0
    u = np.asarray(levels, dtype=np.float32)[codes & ((1 << top) - 1)]
    u = u + np.float32(np.sqrt(np.pi / 2) / S.shape[0]) * np.asarray(gamma, dtype=np.float32) * (z.astype(np.float32) @ S)
    y = u * np.asarray(norm, dtype=np.float32)
    return y if rotation is None else y @ np.asarray(rotation, dtype=np.float32).T


def jensen_correction(q, steps, rotation=None):
    """Amount to subtract from logits (`jensen` specs): c[t, n] = sum_d (q R)_td^2 steps_nd^2 / (24 D).

    q [T, D] queries of one head; steps [N, D] the grid step of every element of the N keys it
    attends to (a frame's stored scale per group or channel, 0 for exact keys); rotation [D, D] or None.
    """
    q = np.asarray(q, dtype=np.float32)
    if rotation is not None:
        q = q @ np.asarray(rotation, dtype=np.float32)
    return (q * q) @ (np.asarray(steps, dtype=np.float32) ** 2).T / (24 * q.shape[-1])
