"""A standalone reader of `kv-recipe` files (recipes/FORMAT.md), for other runtimes to copy.

It needs only `json`, `struct`, `numpy` and `safetensors` (numpy API), not torch and not the
`calibrate` package, and shows how little a foreign runtime must implement to load a recipe and
dequantize stored frames: the metadata checks, the sub-byte unpacking, and the affine and
codebook reconstructions. `tests/test_reader.py` holds it to `calibrate`'s own loader and codec.

    metadata, tensors = read_recipe("recipe.safetensors")
    spec = metadata["scheme"]["layers"][0]["k"]          # a TensorSpec as a dict
    scale = tensors["layers.0.k.scale"]                   # [H, D] float32 (static per-channel)
    var = tensors.get("layers.0.k.logit_bias")             # [H, D] or None: key-noise logit correction

Format 1.1 to 1.3 kinds (FORMAT.md): `dequantize_prq` (Quant VideoGen), `dequantize_nvfp4`, `dequantize_turbo` and
`dequantize_turbo_prod` (TurboQuant), and `jensen_correction` for specs with `jensen`.

Bit-exact encoding and decoding of the per-frame kinds (FORMAT.md "Arithmetic"): the runtime's
stored bytes and decoded floats, reproduced from the document alone. Per head of one frame:

    spec = spec_of(metadata, layer, "k")                       # defaults filled in
    bits = held_bits(metadata["scheme"]["policy"], spec, head, f, n)   # its token class
    p = head_params(spec, tensors, layer, "k", head, bits)     # roles, re-cut for `bits`
    stored = encode_head(x_BTD, spec, p)                        # == calibrate.codec.encode
    x_hat = decode_head(stored, spec, p, head_dim)              # == calibrate.codec.decode

(kind "prq" with stages also takes the span's centroids, `span_state`: `prq_span_state` fits them as
the reference encoder does). Predictive tensors: `predictive_encode` (modes, codes, states of a
frame), `predictive_store` / `predictive_anchor` (their stored bytes), `predictive_states` and
`predictive_values` (decoding; values within `predictive_values_bound` of any runtime's); format
1.3's sink code: `predictive_sink` (stored bytes), `predictive_states` (the chain's states after
it) and `predictive_sink_values`. `plan_of(metadata)` gives
the memory plan, if any (window, sinks, host tier, recall by pose). Sums go through
`tree_sum` (the halving tree), never `@`. `tests/test_reader_exact.py` runs recipes that use
every role through the runtime and this reader side by side and compares every byte.
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
    version = raw["format_version"].split(".")
    if len(version) != 2 or not all(v.isascii() and v.isdigit() and (v == "0" or v[0] != "0") for v in version):
        raise ValueError(f"{path}: metadata field 'format_version' is {raw['format_version']!r}, not MAJOR.MINOR")
    major = version[0]
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

    `stored` is the frame's stored form: {"anchor"}, {"sink"} or {"modes", "codes"} (uint8 arrays,
    chain.py; with the sink hold also {"holds"}, which states ignore); `v_prev` the previous frame's states (None if it is not held: then every token is intra).
    """
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    bits, anchor = t("channel_bits"), t("anchor_bits")
    if "sink" in stored:  # format 1.3: clamp(rne((z_unit * w) / unit), -V, V), 0 where uncoded
        w = predictive_sink_code(stored, tensors, layer, kind, head)
        V = _field_limit(anchor)
        v = np.rint((t("sink_unit").astype(F32) * w.astype(F32)) / t("unit").astype(F32))
        return np.clip(v, -V, V).astype(np.int64)
    if "anchor" in stored:
        offset = _field_offset(anchor)
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
    """x̂ = (unit * v) @ R^T + mean, float32 (keys: before the rotary encoding if `rotary_coords`).
    The product's sum order is not pinned: runtimes agree within `predictive_values_bound`."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head], dtype=np.float32)
    return (t("unit") * np.asarray(v, dtype=np.float32)) @ t("rotation").T + t("mean")


def predictive_sink_code(stored, tensors, layer, kind, head):
    """A sink frame's code w [B, T, D] int64 from its stored form {"sink"} (format 1.3): fields
    w + 2^(z - 1) of widths `sink_bits`; or a sink refresh's reference from {"reference"} (format
    1.5): the same on the uncoded components only (widths z * [channel_bits = 0]), 0 elsewhere."""
    z = np.asarray(tensors[f"layers.{layer}.{kind}.sink_bits"][head])
    if "reference" in stored:
        z = z * (np.asarray(tensors[f"layers.{layer}.{kind}.channel_bits"][head]) == 0)
    return unpack_fields(stored.get("sink", stored.get("reference")), z) - _field_offset(z)


def predictive_sink_values(stored, tensors, layer, kind, head):
    """A sink frame's values (z_unit * w) @ R^T + mean, float32 (the product's order as in `predictive_values`)."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head], dtype=np.float32)
    w = predictive_sink_code(stored, tensors, layer, kind, head)
    return (t("sink_unit") * w.astype(np.float32)) @ t("rotation").T + t("mean")


def predictive_sink(x, tensors, layer, kind, head):
    """A sink frame's stored form {"sink"} (format 1.3): w = clamp(rne(((x - mean) @ R) / z_unit),
    -Z, Z), Z = 2^(z - 1) - 1, packed as offset-binary fields of widths `sink_bits`; x [B, T, D]
    float32 as for `predictive_encode`. The product is not pinned (numpy's order here)."""
    z = np.asarray(tensors[f"layers.{layer}.{kind}.sink_bits"][head])
    return {"sink": pack_fields(_sink_w(x, tensors, layer, kind, head) + _field_offset(z), z)}


def predictive_reference(x, tensors, layer, kind, head):
    """A refresh frame's reference {"reference"} (format 1.5): the sink code of x (`predictive_sink`)
    on the uncoded components only, packed at widths z * [channel_bits = 0]."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    z = t("sink_bits") * (t("channel_bits") == 0)
    w = _sink_w(x, tensors, layer, kind, head) * (z > 0)
    return {"reference": pack_fields(w + _field_offset(z), z)}


def _field_offset(bits):
    """2^(b - 1) per field of width b (0 for b = 0): the offset of an offset-binary field."""
    bits = np.asarray(bits)
    return np.where(bits > 0, 1 << np.maximum(bits - 1, 0), 0)


def _field_limit(bits):
    """2^(b - 1) - 1 per field of width b (0 for b = 0): the largest |value| a signed field holds."""
    return np.maximum(_field_offset(bits) - 1, 0)


def _sink_w(x, tensors, layer, kind, head):
    """The sink code w [B, T, D] int64 of x (`predictive_sink`), before packing."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    mean, R, z_unit = (np.asarray(t(r), dtype=F32) for r in ("mean", "rotation", "sink_unit"))
    z = t("sink_bits")
    Z = _field_limit(z)
    return np.clip(np.rint(((np.asarray(x, dtype=F32) - mean) @ R) / z_unit), -Z, Z).astype(np.int64)


def predictive_hold(x, sink_stored, tensors, layer, kind, head):
    """The sink hold's bits (format 1.4), hold [B, T] bool of one frame of one head: sum over the
    uncoded components d (channel_bits 0) of g_d (g_d - 2 u_d) < 0, g = z_unit * w of the reference's
    token (`sink_stored`: the sink frame's stored form {"sink"}, or with a sink refresh the current
    reference {"reference"}, `predictive_reference`), u = (x - mean) @ R; x as for `predictive_encode`.
    float32; the product and the sum are not pinned (numpy's order here): a near-tie may differ."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    mean, R, z_unit = (np.asarray(t(r), dtype=F32) for r in ("mean", "rotation", "sink_unit"))
    w = predictive_sink_code(sink_stored, tensors, layer, kind, head)
    g = z_unit * w.astype(F32) * (t("channel_bits") == 0).astype(F32)
    u = (np.asarray(x, dtype=F32) - mean) @ R
    return (g * (g - F32(2) * u)).sum(-1, dtype=F32) < 0


def predictive_held_values(x_hat, stored, sink_stored, tensors, layer, kind, head):
    """A delta or anchor frame's values with the sink hold (format 1.4): x̂ + h on the tokens whose
    hold bit is set, h = (z_unit * w * [channel_bits = 0]) @ R^T of the reference's same token
    (`sink_stored`, as for `predictive_hold`: with a sink refresh the *current* reference, whatever
    frame the holds belong to); x̂ from `predictive_values`. Without holds in `stored`, x̂ itself."""
    if "holds" not in stored:
        return x_hat
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    w = predictive_sink_code(sink_stored, tensors, layer, kind, head)
    uncoded = (t("channel_bits") == 0).astype(F32)
    h = (np.asarray(t("sink_unit"), dtype=F32) * w.astype(F32) * uncoded) @ np.asarray(t("rotation"), dtype=F32).T
    hold = unpack_fields(stored["holds"], [1] * np.shape(x_hat)[-2]).astype(bool)
    return np.where(hold[..., None], x_hat + h, x_hat)


def predictive_values_bound(v, tensors, layer, kind, head):
    """How far two runtimes' x̂ may lie apart, per element (FORMAT.md): 4 (D + 2) 2^-24 (sum_d |unit_d
    v_d R[j, d]| + |mean_j|), in float64. Absolute: near 0 it is many ulps of x̂."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head], dtype=np.float64)
    R = t("rotation")
    mag = np.abs(t("unit") * np.asarray(v, dtype=np.float64)) @ np.abs(R).T + np.abs(t("mean"))
    return 4 * (R.shape[-1] + 2) * 2.0**-24 * mag


def pack_fields(values, widths):
    """int [..., n] -> uint8 [..., ceil(sum(widths)/8)]: mixed-width fields, LSB-first bit stream."""
    values, widths = np.asarray(values, dtype=np.int64), [int(w) for w in widths]
    bits = [(values[..., i : i + 1] >> np.arange(w)) & 1 for i, w in enumerate(widths) if w]
    stream = np.concatenate(bits, axis=-1) if bits else np.zeros((*values.shape[:-1], 0), dtype=np.int64)
    stream = np.concatenate([stream, np.zeros((*stream.shape[:-1], -stream.shape[-1] % 8), dtype=np.int64)], axis=-1)
    return np.packbits(stream.astype(np.uint8), axis=-1, bitorder="little")


def predictive_encode(x, tensors, layer, kind, head, v_prev=None):
    """(inter [B, T] bool, codes [B, T, D] int64, states [B, T, D] int64) of one frame of one head
    (FORMAT.md "Encoding"), x [B, T, D] float32 as the frame is coded (keys before the rotary
    encoding if `rotary_coords`); `v_prev` the previous frame's states, or None: every token intra.

    float32 throughout; the two products and the mode's two sums are not pinned (numpy's order
    here), so a code or mode may differ from another runtime's only at a near-tie (FORMAT.md)."""
    t = lambda role: np.asarray(tensors[f"layers.{layer}.{kind}.{role}"][head])
    unit, mean, R = (np.asarray(t(r), dtype=F32) for r in ("unit", "mean", "rotation"))
    b, s_i, s_p, a = t("channel_bits"), t("intra_step"), t("inter_step"), t("anchor_bits")
    n = (1 << b) - 1
    V = _field_limit(a)
    tau = ((np.asarray(x, dtype=F32) - mean) @ R) / unit

    def code(target, step, lo, hi):
        return np.clip(np.rint((target / step.astype(F32) + n.astype(F32)) / F32(2)), lo, hi).astype(np.int64)

    c_i = code(tau, s_i, 0, n)
    v_i = s_i * (2 * c_i - n)
    if v_prev is None:
        return np.zeros(tau.shape[:-1], dtype=bool), c_i, v_i
    v_prev = np.asarray(v_prev, dtype=np.int64)
    lo = np.maximum(0, -((v_prev + V - n * s_p) // (2 * s_p)))  # ceil((n s - V - v') / 2s)
    hi = np.minimum(n, (n * s_p + V - v_prev) // (2 * s_p))
    c_p = code(tau - v_prev.astype(F32), s_p, lo, hi)
    v_p = v_prev + s_p * (2 * c_p - n)
    w = unit * unit
    err_i = (np.square(tau - v_i.astype(F32)) * w).sum(-1, dtype=F32)
    err_p = (np.square(tau - v_p.astype(F32)) * w).sum(-1, dtype=F32)
    inter = err_p <= err_i  # ties: inter
    return inter, np.where(inter[..., None], c_p, c_i), np.where(inter[..., None], v_p, v_i)


def predictive_store(inter, codes, tensors, layer, kind, head, hold=None):
    """A delta frame's stored form {"modes", "codes"} (uint8) from `predictive_encode`'s modes and
    codes, with {"holds"} packed like the modes when `hold` (`predictive_hold`) is given."""
    bits = np.asarray(tensors[f"layers.{layer}.{kind}.channel_bits"][head])
    one_bit = [1] * np.shape(inter)[-1]
    return {"modes": pack_fields(np.asarray(inter, dtype=np.int64), one_bit), "codes": pack_fields(codes, bits),
            **({"holds": pack_fields(np.asarray(hold, dtype=np.int64), one_bit)} if hold is not None else {})}


def predictive_anchor(v, tensors, layer, kind, head, holds=None):
    """An anchor's stored form {"anchor"}: fields v + 2^(a - 1) of widths `anchor_bits` (offset
    binary), and the re-stored frame's packed `holds` as they were (sink hold)."""
    a = np.asarray(tensors[f"layers.{layer}.{kind}.anchor_bits"][head])
    out = {"anchor": pack_fields(np.asarray(v, dtype=np.int64) + _field_offset(a), a)}
    return {**out, "holds": holds} if holds is not None else out


# ---- format 1.1 -----------------------------------------------------------------------------------
KINDS = ("uniform", "codebook", "prq", "turbo", "turbo_prod", "nvfp4", "predictive")  # a kind outside this list: refuse the recipe


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


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)  # kind "nvfp4": magnitudes by index


def e2m1_index(a):
    """Kind "nvfp4": E2M1 magnitude index of a = |u| >= 0: nearest magnitude, a tie to the even
    index, >= 6 -> 7 (the 7 midpoints crossed; from an even index only above the midpoint)."""
    a = np.asarray(a, dtype=F32)
    m = np.zeros(a.shape, dtype=np.uint8)
    for k in range(7):
        mid = (E2M1[k] + E2M1[k + 1]) / F32(2)
        m += (a >= mid) if k % 2 else (a > mid)
    return m


def dequantize_nvfp4(codes, scale_fp8, tensor_scale):
    """Kind "nvfp4": codes [B, T, D] (unpacked), scale_fp8 [B, T, D/16, 1] (uint8 E4M3 bit
    patterns), tensor_scale [B, 1, 1] float32: (-1)^[code >= 8] E2M1[code mod 8] * (s_b * s_t)."""
    codes = np.asarray(codes)
    g = codes.reshape(*codes.shape[:-1], -1, 16)
    v = E2M1[g & 7]
    v = np.where(g >= 8, -v, v)
    p = fp8_e4m3(scale_fp8) * np.asarray(tensor_scale, dtype=F32)[..., None]
    return (v * p).reshape(codes.shape)


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
    return y if rotation is None else matmul(y, np.asarray(rotation, dtype=np.float32).T)


def dequantize_turbo_prod(codes, norm, gamma, levels, qjl, bits, rotation=None):
    """Kind "turbo_prod": code = i + 2^(b-1) z; u = levels[i] + sqrt(pi/2)/m * gamma * (2z - 1) @ S;
    x = (u * norm) @ R^T. codes [..., D]; norm, gamma [..., 1] (float16); levels [2^(b-1)]; S [m, D]."""
    codes = np.asarray(codes).astype(np.int64)
    top = bits - 1
    S = np.asarray(qjl, dtype=np.float32)
    z = 2.0 * (codes >> top) - 1.0
    u = np.asarray(levels, dtype=np.float32)[codes & ((1 << top) - 1)]
    u = u + np.float32(np.sqrt(np.pi / 2) / S.shape[0]) * np.asarray(gamma, dtype=np.float32) * matmul(z.astype(np.float32), S)
    y = u * np.asarray(norm, dtype=np.float32)
    return y if rotation is None else matmul(y, np.asarray(rotation, dtype=np.float32).T)


def jensen_correction(q, steps, rotation=None):
    """Amount to subtract from logits (`jensen` specs): c[t, n] = sum_d (q R)_td^2 steps_nd^2 / (24 D).

    q [T, D] queries of one head; steps [N, D] the grid step of every element of the N keys it
    attends to (a frame's stored scale per group or channel, 0 for exact keys); rotation [D, D] or None.
    """
    q = np.asarray(q, dtype=np.float32)
    if rotation is not None:
        q = q @ np.asarray(rotation, dtype=np.float32)
    return (q * q) @ (np.asarray(steps, dtype=np.float32) ** 2).T / (24 * q.shape[-1])


# ---- exact arithmetic (FORMAT.md "Arithmetic"): everything below reproduces the runtime bit for bit --
# float32 throughout, every operation rounded once and in the written order; numpy's elementwise
# float32 operations are IEEE operations without fused multiply-add, which is what the format needs.
F32 = np.float32
FLOOR = F32(2.0**-24)  # smallest positive float16: no stored dynamic scale is 0


def tree_sum(t):
    """Sum over the last axis by the halving tree: t_i += t_{i+ceil(n/2)} until one term is left."""
    t = np.asarray(t, dtype=F32)
    n = t.shape[-1]
    while n > 1:
        m = (n + 1) // 2
        t = np.concatenate([t[..., : n - m] + t[..., m:n], t[..., n - m : m]], axis=-1)
        n = m
    return t[..., 0]


def matmul(x, m):
    """x [..., D] @ m [D, K] with every output the tree sum of its float32 products."""
    x, m = np.asarray(x, dtype=F32), np.asarray(m, dtype=F32)
    return tree_sum(x[..., None, :] * m.T)


def sum_squares(x):
    """Tree sum of x_d * x_d over the last axis, kept as a size-1 axis."""
    x = np.asarray(x, dtype=F32)
    return tree_sum(x * x)[..., None]


def fp16(v):
    """Rounded to float16 (ties to even) and back to float32."""
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def round_half_away(v):
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= F32(0.5), np.sign(v), F32(0)).astype(F32)


def nearest(u, levels):
    """Index (uint8) of the level of least |u - level|, ties to the lower index."""
    levels = np.asarray(levels, dtype=F32)
    return np.argmin(np.abs(np.asarray(u, dtype=F32)[..., None] - levels), axis=-1).astype(np.uint8)


def uniform_levels(bits):
    """(2i - (n - 1)) / (n - 1), n = 2^bits: one float32 division each (correctly rounded)."""
    n = 2**bits
    return (F32(2) * np.arange(n, dtype=F32) - F32(n - 1)) / F32(n - 1)


def levels_for_bits(row, bits):
    """The codebook row used at `bits`: itself, a subsample at the nearest indices, or uniform levels."""
    row, n = np.asarray(row, dtype=F32), 2**bits
    if row.shape[-1] == n:
        return row
    if row.shape[-1] > n:
        i = np.arange(n, dtype=np.int64)
        return row[(2 * i * (row.shape[-1] - 1) + (n - 1)) // (2 * (n - 1))]
    return uniform_levels(bits)


def recut_scale(scale, native_bits, bits, symmetric):
    """A static uniform scale fitted at `native_bits` re-cut for `bits` (product, then quotient)."""
    scale = np.asarray(scale, dtype=F32)
    if bits == native_bits:
        return scale
    if symmetric:
        return scale * F32(2.0 ** (native_bits - 1)) / F32(2.0 ** (bits - 1))
    return scale * F32(2**native_bits - 1) / F32(2**bits - 1)


def e4m3(v):
    """(value float32, bit pattern uint8) of positive v in [2^-9, 448] rounded to FP8 E4M3, ties to even."""
    v = np.asarray(v, dtype=F32)
    _, e = np.frexp(v)
    step = np.exp2(np.maximum(e - 1, -6) - 3).astype(F32)  # normal: 2^(E-3); subnormal: 2^-9
    q = (np.rint(v / step) * step).astype(F32)
    _, e = np.frexp(q)
    normal = q >= F32(2.0**-6)
    exp_field = np.where(normal, e - 1 + 7, 0)
    man = np.where(normal, q / np.exp2(e - 1).astype(F32) * 8 - 8, q / F32(2.0**-9))
    return q, (exp_field * 8 + man).astype(np.uint8)


def pack(codes, bits):
    """Codes [..., n] (each < 2^bits) -> uint8 [..., ceil(n/8) * bits]: the LSB-first bit stream."""
    codes = np.asarray(codes, dtype=np.uint8)
    n = codes.shape[-1]
    padded = np.zeros((*codes.shape[:-1], -(-n // 8) * 8), dtype=np.uint8)
    padded[..., :n] = codes
    bits_ = (padded[..., None] >> np.arange(bits, dtype=np.uint8)) & 1  # [..., n8, bits]
    return np.packbits(bits_.reshape(*codes.shape[:-1], -1), axis=-1, bitorder="little")


# ---- one head of one frame, per-frame kinds: parameters, encoding, decoding ------------------------
SPEC_DEFAULTS = {"bits": 16, "head_bits": None, "kind": "uniform", "symmetric": False, "axis": "token", "group_size": 0,
                 "static": False, "clip": 1.0, "rotation": "none", "outliers": 0, "sparse_fraction": 0.0, "centroids": 0,
                 "comp_rank": 0, "prq_stages": 0, "prq_centroids": 0, "prq_span_frames": 1, "prq_deferred": False}


def spec_of(meta, layer, kind):
    """The TensorSpec of `kind` ("k"/"v") in `layer` as a dict with every default filled in."""
    return {**SPEC_DEFAULTS, **meta["scheme"]["layers"][layer][kind]}


def bits_of(spec, head):
    return spec["head_bits"][head] if spec["head_bits"] else spec["bits"]


PLAN_DEFAULTS = {"window": 16, "sink_frames": 1, "recall_slots": 0, "host_frames": 0, "recall": "pose",
                 "yaw_radius": 1.0, "reuse": "resident"}


def plan_of(meta):
    """The memory plan (FORMAT.md "Memory plan") with defaults filled in, or None. A runtime that
    does not implement the tiers must refuse a recipe that has one, never run it with its own window."""
    plan = meta["scheme"].get("policy", {}).get("plan")
    return None if plan is None else {**PLAN_DEFAULTS, **plan}


def held_bits(policy, spec, head, f, n):
    """Width frame f of one head is held at after n appends (FORMAT.md "Token classes")."""
    p = {"sink_frames": 1, "sink_bits": 16, "recent_frames": 0, "recent_bits": 16, "keyframe_interval": 0,
         "keyframe_bits": 8, **policy}
    if p["recent_frames"] > 0 and f >= n - p["recent_frames"]:
        return p["recent_bits"]
    S = spec["prq_span_frames"]
    if spec["prq_deferred"] and (f // S + 1) * S > n:  # its span is not complete yet
        return 16
    if f < p["sink_frames"]:
        return p["sink_bits"]
    if p["keyframe_interval"] > 0 and f % p["keyframe_interval"] == 0:
        return p["keyframe_bits"]
    return bits_of(spec, head)


def head_params(spec, tensors, layer, kind, head, bits):
    """The parameters of one head held at `bits` (roles of `layers.{layer}.{kind}.*`, re-cut for `bits`)."""
    def role(name):
        t = tensors.get(f"layers.{layer}.{kind}.{name}")
        return None if t is None else np.asarray(t)[head]

    native = bits_of(spec, head)
    p = {name: role(name) for name in ("rotation", "scale", "zero_point", "codebook", "outlier_channels", "centroids",
                                       "lloyd_max", "qjl")}
    p["bits"] = bits
    clip = role("clip")
    p["clip"] = F32(spec["clip"]) if clip is None else F32(clip)
    if p["codebook"] is not None and bits < 16:
        p["codebook"] = levels_for_bits(p["codebook"], bits)
    if p["scale"] is not None and spec["kind"] == "uniform" and bits < 16:
        p["scale"] = recut_scale(p["scale"], native, bits, spec["symmetric"])
    same = bits == native  # the compensator applies to frames held at the spec's own width only
    p["comp_down"], p["comp_up"] = (role("comp_down"), role("comp_up")) if same else (None, None)
    return p


def _static(spec, p):
    return spec["axis"] == "channel" and spec["static"] and p["scale"] is not None


def _center(spec, p):
    """What outlier and sparse entries are replaced by: the middle of a static grid, else 0."""
    if not _static(spec, p):
        return F32(0)
    half = F32((2 ** p["bits"] - 1) / 2) if spec["kind"] == "uniform" and not spec["symmetric"] else F32(0)
    return np.asarray(p["zero_point"], dtype=F32) + np.asarray(p["scale"], dtype=F32) * half


def _groups(x, G):
    return x.reshape(*x.shape[:-1], x.shape[-1] // G, G)


def _affine_params(g, bits, symmetric, clip, axis):
    """(scale, zero or None), float16-rounded, reduced over `axis` (kept)."""
    if symmetric:
        absmax = np.abs(g).max(axis=axis, keepdims=True)
        return fp16(np.maximum(clip * absmax / F32(2 ** (bits - 1)), FLOOR)), None
    lo, hi = g.min(axis=axis, keepdims=True), g.max(axis=axis, keepdims=True)
    s = (F32(1) - clip) * (hi - lo) / F32(2)
    lo, hi = lo + s, hi - s
    return fp16(np.maximum((hi - lo) / F32(2**bits - 1), FLOOR)), fp16(lo)


def _affine_codes(y, scale, zero, bits, symmetric):
    qmin = _qmin(bits, symmetric)
    v = y if zero is None else y - zero
    return (np.clip(np.rint(v / scale), qmin, qmin + 2**bits - 1) - qmin).astype(np.uint8)


def _prq_assign(r, c):
    """Index of each token's nearest centroid (the package's distance, tree sums), ties lowest."""
    dot = tree_sum(r[:, :, None, :] * c[:, None, :, :])
    d = np.maximum(sum_squares(r) + np.swapaxes(sum_squares(c), 1, 2) - F32(2) * dot, F32(0))
    return np.argmin(d, axis=-1)


def mt19937(seed, n):
    """The first n 32-bit outputs of MT19937 seeded by init_genrand(seed) (as torch.Generator and
    numpy's RandomState seed it): seed 0 gives 2357136044, 2546248239, 3071714933, 3626093760, ..."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    out, i = [], 624
    for _ in range(n):
        if i == 624:
            for k in range(624):
                y = (mt[k] & 0x80000000) | (mt[(k + 1) % 624] & 0x7FFFFFFF)
                mt[k] = mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            i = 0
        y = mt[i]
        i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        out.append(y ^ (y >> 18))
    return out


def prq_start_indices(T, C):
    """The tokens k-means starts from: i_k = w_k mod T, w the MT19937 outputs of seed 0 (may repeat)."""
    return [w % T for w in mt19937(0, C)]


def prq_kmeans(r, C, iters, tol=1e-4):
    """The reference encoder's k-means on r [B, T, D] (float32): (assignments [B, T], centroids [B, C, D]).
    The means' sums are in numpy's order (not pinned: FORMAT.md)."""
    r = np.asarray(r, dtype=F32)
    B, T, _ = r.shape
    c = r[:, prq_start_indices(T, C)].copy()
    prev = None
    for _ in range(iters):
        a = _prq_assign(r, c)
        if prev is not None and F32(np.count_nonzero(a != prev)) / F32(B * T) < F32(tol):
            break  # stop with the centroids the tokens were just assigned to
        new = c.copy()
        for b in range(B):
            for k in range(C):
                members = r[b, a[b] == k]
                if len(members):  # an empty cluster keeps its centroid
                    new[b, k] = members.sum(axis=0, dtype=F32) / F32(len(members))
        prev, c = a, new
    return a, c


def prq_span_state(y, stages, C, iters):
    """A span's state [B, S, C, D] (float16) fitted on one frame's y [B, T, D] (after steps 1-4), or
    on a deferred span's frames concatenated in frame order [B, n T, D] (`prq_deferred`):
    per stage k-means on the residual, the centroids rounded to float16, then the residual less
    each token's nearest stored centroid."""
    r = np.asarray(y, dtype=F32)
    out = []
    for _ in range(stages):
        _, c = prq_kmeans(r, C, iters)
        c16 = c.astype(np.float16)
        a = _prq_assign(r, c16.astype(F32))
        r = r - np.take_along_axis(c16.astype(F32), a[..., None], axis=1)
        out.append(c16)
    return np.stack(out, axis=1)


def encode_head(x, spec, p, span_state=None):
    """The stored form of one head of one frame, x [B, T, D]: the arrays `calibrate.codec.encode`
    returns (codes packed; float16 parameters; kind "prq" scales as E4M3 bit patterns, uint8).
    `span_state` [B, S, C, D] (float16) is the span's centroids for kind "prq" with stages."""
    x = np.asarray(x, dtype=F32)
    if p["bits"] >= 16:
        return {"fp16": x.astype(np.float16)}
    B, T, D = x.shape
    bits, y, side = p["bits"], x, {}
    if p["rotation"] is not None:
        y = matmul(y, p["rotation"])
    if p["centroids"] is not None:
        diff = y[..., None, :] - np.asarray(p["centroids"], dtype=F32)
        a = np.argmin(tree_sum(diff * diff), axis=-1)
        side["assign"] = a.astype(np.uint8)
        y = y - np.asarray(p["centroids"], dtype=F32)[a]
    center = np.broadcast_to(_center(spec, p), y.shape)
    if p["outlier_channels"] is not None:
        o = np.asarray(p["outlier_channels"])
        side["outliers"] = y[..., o].astype(np.float16)
        y = y.copy()
        y[..., o] = center[..., o]
    if spec["sparse_fraction"] > 0:
        k = max(1, round(spec["sparse_fraction"] * T * D))  # float64, ties to even
        flat, cflat = y.reshape(B, T * D).copy(), center.reshape(B, T * D)
        order = np.argsort(-np.abs(flat - cflat), axis=-1, kind="stable")  # ties: lowest position first
        idx = np.sort(order[:, :k], axis=-1)
        side["sparse_idx"] = idx.astype(np.int16 if T * D < 2**15 else np.int32)
        side["sparse_val"] = np.take_along_axis(flat, idx, -1).astype(np.float16)
        np.put_along_axis(flat, idx, np.take_along_axis(cflat, idx, -1), -1)
        y = flat.reshape(B, T, D)
    codes, dyn = _quantize(y, spec, p, span_state)
    stored = {"codes": pack(codes, bits), **{f"p_{k}": v for k, v in dyn.items()}}
    stored.update(side)
    return stored


def _quantize(y, spec, p, span_state):
    bits, kind, D = p["bits"], spec["kind"], y.shape[-1]
    G = spec["group_size"] or D
    if kind == "uniform":
        if _static(spec, p):
            return _affine_codes(y, p["scale"], p["zero_point"], bits, spec["symmetric"]), {}
        if spec["axis"] == "channel":
            scale, zero = _affine_params(y, bits, spec["symmetric"], p["clip"], -2)
            codes = _affine_codes(y, scale, zero, bits, spec["symmetric"])
        else:
            g = _groups(y, G)
            scale, zero = _affine_params(g, bits, spec["symmetric"], p["clip"], -1)
            codes = _affine_codes(g, scale, zero, bits, spec["symmetric"]).reshape(y.shape)
        dyn = {"scale": scale.astype(np.float16)}
        if zero is not None:
            dyn["zero"] = zero.astype(np.float16)
        return codes, dyn
    if kind == "codebook":
        if _static(spec, p):
            u = np.clip((y - p["zero_point"]) / p["scale"], F32(-1), F32(1))
            return nearest(u, p["codebook"]), {}
        g = _groups(y, G)
        scale = fp16(np.maximum(np.abs(g).max(axis=-1, keepdims=True) * p["clip"], FLOOR))
        return nearest(np.clip(g / scale, F32(-1), F32(1)), p["codebook"]).reshape(y.shape), {"scale": scale.astype(np.float16)}
    if kind == "prq":
        dyn, r = {}, y
        if spec["prq_stages"]:
            cents = np.asarray(span_state, dtype=F32)
            ids = []
            for s in range(cents.shape[1]):
                a = _prq_assign(r, cents[:, s])
                r = r - np.take_along_axis(cents[:, s], a[..., None], axis=1)
                ids.append(a)
            if spec["prq_centroids"] > 1:
                dyn["assign"] = pack(np.stack(ids, axis=1), index_bits(spec["prq_centroids"]))
        g = _groups(r, G)
        qmax = 2 ** (bits - 1) - 1
        scale, scale_bits = e4m3(np.clip(np.abs(g).max(axis=-1, keepdims=True) / F32(qmax), F32(2.0**-9), F32(448)))
        dyn["scale"] = scale_bits
        q = np.clip(round_half_away(g / scale), -qmax, qmax)
        return (q + qmax).astype(np.uint8).reshape(y.shape), dyn
    if kind in ("turbo", "turbo_prod"):
        norm = fp16(np.clip(np.sqrt(sum_squares(y)), FLOOR, F32(65504)))
        u = y / norm
        levels = np.asarray(p["lloyd_max"], dtype=F32)
        idx = nearest(u, levels)
        if kind == "turbo":
            return idx, {"norm": norm.astype(np.float16)}
        r = u - levels[idx]
        gamma = fp16(np.minimum(np.sqrt(sum_squares(r)), F32(65504)))
        z = (matmul(r, np.asarray(p["qjl"], dtype=F32).T) >= 0).astype(np.uint8)
        return idx + (z << (bits - 1)), {"norm": norm.astype(np.float16), "gamma": gamma.astype(np.float16)}
    if kind == "nvfp4":
        s_t = np.maximum(np.abs(y).max(axis=(-2, -1), keepdims=True) / F32(6 * 448), F32(2.0**-126))
        g = _groups(y, 16)
        s_b, s_b_bits = e4m3(np.clip(np.abs(g).max(axis=-1, keepdims=True) / F32(6) / s_t[..., None],
                                     F32(2.0**-9), F32(448)))
        u = g / (s_b * s_t[..., None])
        codes = e2m1_index(np.abs(u)) + (u < 0).astype(np.uint8) * np.uint8(8)
        return codes.reshape(y.shape), {"scale": s_b_bits, "tensor": s_t.astype(F32)}
    raise ValueError(f"kind {kind!r} is not a per-frame kind")


def decode_head(stored, spec, p, head_dim, span_state=None):
    """Decoded values [B, T, D] (float32) of one head of one stored frame (`encode_head`'s form,
    or the runtime's with kind "prq" scales given as uint8 E4M3 bit patterns)."""
    if "fp16" in stored:
        return np.asarray(stored["fp16"]).astype(F32)
    bits, kind = p["bits"], spec["kind"]
    codes = unpack(stored["codes"], bits, head_dim)
    G = spec["group_size"] or head_dim
    if kind == "uniform":
        if _static(spec, p):
            y = (codes.astype(F32) + F32(_qmin(bits, spec["symmetric"]))) * p["scale"] + p["zero_point"]
        elif spec["axis"] == "channel":
            zero = None if "p_zero" not in stored else np.asarray(stored["p_zero"]).astype(F32)
            y = dequantize_static_channel(codes, np.asarray(stored["p_scale"]).astype(F32), zero, bits, spec["symmetric"])
        else:
            zero = None if "p_zero" not in stored else stored["p_zero"]
            y = dequantize_uniform_token(codes, stored["p_scale"], zero, bits, spec["symmetric"], G)
    elif kind == "codebook":
        if _static(spec, p):
            y = dequantize_codebook(codes, p["codebook"], p["scale"], p["zero_point"])
        else:
            y = dequantize_codebook(codes, p["codebook"], stored["p_scale"], group_size=G)
    elif kind == "prq":
        y = dequantize_prq(codes, stored["p_scale"], bits, G, span_state if spec["prq_stages"] else None,
                           stored.get("p_assign"), spec["prq_centroids"])
    elif kind == "turbo":
        y = dequantize_turbo(codes, stored["p_norm"], p["lloyd_max"])
    elif kind == "turbo_prod":
        y = dequantize_turbo_prod(codes, stored["p_norm"], stored["p_gamma"], p["lloyd_max"], p["qjl"], bits)
    elif kind == "nvfp4":
        y = dequantize_nvfp4(codes, stored["p_scale"], stored["p_tensor"])
    else:
        raise ValueError(f"kind {kind!r} is not a per-frame kind")
    return _finish(np.asarray(y, dtype=F32), stored, p, kind)


def _finish(y, stored, p, kind):
    """Steps 4-1 backwards: sparse values, outlier channels, centroids, compensator, rotation."""
    B, T, D = y.shape
    if "sparse_val" in stored:
        flat = y.reshape(B, T * D).copy()
        np.put_along_axis(flat, np.asarray(stored["sparse_idx"]).astype(np.int64),
                          np.asarray(stored["sparse_val"]).astype(F32), -1)
        y = flat.reshape(B, T, D)
    if "outliers" in stored:
        y = y.copy()
        y[..., np.asarray(p["outlier_channels"])] = np.asarray(stored["outliers"]).astype(F32)
    if "assign" in stored:
        y = y + np.asarray(p["centroids"], dtype=F32)[np.asarray(stored["assign"]).astype(np.int64)]
    if p["comp_down"] is not None:
        y = y + matmul(matmul(y, p["comp_down"]), p["comp_up"])
    if p["rotation"] is not None:
        y = matmul(y, np.asarray(p["rotation"], dtype=F32).T)
    return y
