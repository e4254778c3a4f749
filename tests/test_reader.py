"""recipes/reader.py (the standalone numpy reader) agrees with calibrate's loader and codec."""

import ast
import importlib.util
import json
import re
import struct
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from calibrate.codec import HeadParams, decode, encode, head_params
from calibrate.recipe import FORMAT_VERSION, ModelInfo, TensorSpec, load_recipe, save_recipe
from calibrate.schemes import KVSample, build_baseline

ROOT = Path(__file__).resolve().parents[1]
READER_PY = ROOT / "recipes" / "reader.py"
FORMAT_MD = ROOT / "recipes" / "FORMAT.md"
INFO = ModelInfo(name="toy", num_layers=2, num_kv_heads=3, head_dim=16, tokens_per_frame=4, fingerprint="feedfacecafebeef")


def _load_reader():
    spec = importlib.util.spec_from_file_location("kv_recipe_reader", READER_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reader = _load_reader()


def test_reader_imports_only_json_struct_numpy_safetensors():
    tree = ast.parse(READER_PY.read_text(encoding="utf-8"))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"json", "struct", "numpy", "safetensors"}, names


def _sample(seed=0, n=64) -> KVSample:
    g = torch.Generator().manual_seed(seed)
    shape = (INFO.num_layers, INFO.num_kv_heads, n, INFO.head_dim)
    return KVSample(torch.randn(shape, generator=g) + 0.5, torch.randn(shape, generator=g))


@pytest.mark.parametrize("name", ["kivi2", "kvquant2", "quarot2"])
def test_metadata_and_tensors_equal_calibrates_load(tmp_path, name):
    path = tmp_path / f"{name}.safetensors"
    built = build_baseline(name, INFO, _sample())
    built.metadata["metrics"] = json.dumps({"psnr_ref_all": 31.5})
    save_recipe(built, path)
    recipe = load_recipe(path, model=INFO)
    meta, tensors = reader.read_recipe(path)
    assert meta["format"] == "kv-recipe" and meta["format_version"] == FORMAT_VERSION and meta["producer"]
    assert meta["model"] == asdict(recipe.model)
    assert meta["scheme"] == json.loads(recipe.scheme.to_json())
    assert meta["calibration"] == recipe.section("calibration") and meta["metrics"] == {"psnr_ref_all": 31.5}
    assert sorted(tensors) == sorted(recipe.tensors)
    for key, t in recipe.tensors.items():
        assert isinstance(tensors[key], np.ndarray) and np.array_equal(tensors[key], t.numpy()), key


def _rewrite_metadata(path, **changes):
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"].update(changes)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n :])


@pytest.mark.parametrize("change,field", [({"format": "other"}, "'format'"), ({"format_version": "2.0"}, "'format_version'")])
def test_reader_rejects_wrong_format_and_major_version(tmp_path, change, field):
    path = tmp_path / "r.safetensors"
    save_recipe(build_baseline("kivi2", INFO), path)
    _rewrite_metadata(path, **change)
    with pytest.raises(ValueError, match=re.escape(field)) as err:
        reader.read_recipe(path)
    assert str(path) in str(err.value)


def test_reader_reads_newer_minor_and_rejects_garbage(tmp_path):
    path = tmp_path / "r.safetensors"
    save_recipe(build_baseline("kivi2", INFO), path)
    _rewrite_metadata(path, format_version="1.9", colour="blue")
    meta, _ = reader.read_recipe(path)
    assert meta["format_version"] == "1.9" and meta["colour"] == "blue"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        reader.read_recipe(path)


# ---- dequantization: numpy reader vs calibrate.codec.decode --------------------------------------
def _frame(seed, B=2, T=4, D=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g) * (0.5 + torch.rand(D, generator=g)) + torch.randn(D, generator=g)


def _np(t):
    return t.numpy()  # float16 parameters stay float16: the reader widens them itself


@pytest.mark.parametrize("bits,symmetric,group", [(2, False, 8), (3, True, 4), (4, False, 16), (8, True, 8)])
def test_per_token_dynamic_decode_matches_codec(bits, symmetric, group):
    spec = TensorSpec(bits=bits, symmetric=symmetric, axis="token", group_size=group)
    p = HeadParams(bits=bits)
    x = _frame(bits)
    stored = encode(x, spec, p)
    assert stored["p_scale"].dtype == torch.float16
    codes = reader.unpack(_np(stored["codes"]), bits, 16)
    zero = None if symmetric else _np(stored["p_zero"])
    got = reader.dequantize_uniform_token(codes, _np(stored["p_scale"]), zero, bits, symmetric, group)
    np.testing.assert_allclose(got, decode(stored, spec, p, 16).numpy(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, True), (4, False)])
def test_static_per_channel_decode_matches_codec(bits, symmetric):
    spec = TensorSpec(bits=bits, symmetric=symmetric, axis="channel", static=True)
    sample = _frame(10, B=8)
    lo, hi = sample.amin((0, 1)), sample.amax((0, 1))
    if symmetric:
        scale, zero = torch.maximum(lo.abs(), hi.abs()) / 2 ** (bits - 1), torch.zeros(16)
    else:
        scale, zero = (hi - lo) / (2**bits - 1), lo
    p = HeadParams(bits=bits, scale_D=scale, zero_D=zero)
    stored = encode(_frame(11), spec, p)
    assert set(stored) == {"codes"}  # static: nothing but codes per frame
    codes = reader.unpack(_np(stored["codes"]), bits, 16)
    got = reader.dequantize_static_channel(codes, scale.numpy(), zero.numpy(), bits, symmetric)
    np.testing.assert_allclose(got, decode(stored, spec, p, 16).numpy(), atol=1e-6, rtol=0)


def test_dynamic_per_channel_decode_matches_codec():
    spec = TensorSpec(bits=2, axis="channel")  # KIVI keys: per channel over the frame's tokens
    p = HeadParams(bits=2)
    stored = encode(_frame(12), spec, p)
    codes = reader.unpack(_np(stored["codes"]), 2, 16)
    got = reader.dequantize_static_channel(codes, _np(stored["p_scale"]), _np(stored["p_zero"]), 2, False)
    np.testing.assert_allclose(got, decode(stored, spec, p, 16).numpy(), atol=1e-6, rtol=0)


def test_codebook_decode_matches_codec(tmp_path):
    path = tmp_path / "kvquant2.safetensors"
    save_recipe(build_baseline("kvquant2", INFO, _sample(1)), path)
    recipe = load_recipe(path)
    _, tensors = reader.read_recipe(path)
    x = _frame(13) + 0.5
    for kind in ("k", "v"):
        spec = getattr(recipe.scheme.layers[1], kind)
        spec_plain = TensorSpec(**{**asdict(spec), "sparse_fraction": 0.0})  # codes only, no sparse overlay
        for h in range(INFO.num_kv_heads):
            p = head_params(recipe.spec(1, kind), recipe.layer_tensors(1, kind), h)
            stored = encode(x, spec_plain, p)
            codes = reader.unpack(_np(stored["codes"]), 2, 16)
            levels = tensors[f"layers.1.{kind}.codebook"][h]
            if kind == "k":
                got = reader.dequantize_codebook(codes, levels, tensors["layers.1.k.scale"][h], tensors["layers.1.k.zero_point"][h])
            else:
                got = reader.dequantize_codebook(codes, levels, _np(stored["p_scale"]), group_size=spec.group_size or 16)
            np.testing.assert_allclose(got, decode(stored, spec_plain, p, 16).numpy(), atol=1e-6, rtol=0)


def test_the_roles_table_lists_every_role_the_loader_knows():
    """FORMAT.md "Tensors": a reader written from the table alone must accept every role a valid
    recipe can hold (the predictive roles were missing), with its dtype."""
    from calibrate.recipe import INT_ROLES, KNOWN_ROLES

    section = FORMAT_MD.read_text(encoding="utf-8").split("### Tensors\n", 1)[1].split("\n### ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", section, re.MULTILINE)}
    assert set(rows) == set(KNOWN_ROLES)
    assert {role for role, dtype in rows.items() if dtype.startswith("int64")} == set(INT_ROLES)


# ---- unpacking: FORMAT.md's golden vectors --------------------------------------------------------
def golden_vectors():
    section = FORMAT_MD.read_text(encoding="utf-8").split("### Golden vectors", 1)[1]
    rows = []
    for m in re.finditer(r"^\|\s*(\d+)\s*\|([^|]+)\|([^|]+)\|\s*$", section, re.MULTILINE):
        codes = [[int(c) for c in part.split()] for part in m.group(2).split(";")]
        packed = [list(bytes.fromhex(part.strip())) for part in m.group(3).split(";")]
        rows.append((int(m.group(1)), codes, packed))
    return rows


GOLDEN = golden_vectors()


def test_golden_table_found():
    assert len(GOLDEN) >= 8 and {b for b, _, _ in GOLDEN} == {2, 3, 4, 8}


@pytest.mark.parametrize("bits,codes,packed", GOLDEN, ids=lambda v: str(v)[:24])
def test_unpack_golden_vectors(bits, codes, packed):
    got = reader.unpack(np.array(packed, dtype=np.uint8), bits, len(codes[0]))
    assert got.dtype == np.uint8 and got.tolist() == codes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_matches_calibrate_packing(bits):
    from calibrate.quant.packing import pack

    codes = torch.randint(0, 2**bits, (3, 5, 21), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    assert np.array_equal(reader.unpack(pack(codes, bits).numpy(), bits, 21), codes.numpy())


def test_logit_correction_matches_the_runtimes():
    from calibrate.quant.logit_noise import logit_inflation
    from calibrate.quant.rotation import random_hadamard

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 5, 16, generator=g)
    var = torch.rand(3, 16, generator=g)
    R = torch.stack([random_hadamard(16, seed=h) for h in range(3)])
    want = logit_inflation(q, var, R)
    for h in range(3):
        got = reader.logit_correction(q[:, h].numpy(), var[h].numpy(), R[h].numpy())
        np.testing.assert_allclose(got, want[:, h].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reader.logit_correction(q[:, 0].numpy(), var[0].numpy()),
                               logit_inflation(q, var)[:, 0].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sink_bits,hold,refresh", [(0.0, False, 0), (6.0, False, 0), (6.0, True, 0), (6.0, True, 4)])
def test_predictive_frames_decode_bit_identically_in_the_reader(tmp_path, sink_bits, hold, refresh):
    """Every held frame of a predictive cache (deltas, anchors, the sink code) decodes to the
    runtime's states; the reader's sink code is the runtime's, byte for byte; with the sink hold
    (format 1.4) its hold bits are the runtime's and its values the runtime's within the bound;
    with the sink refresh (format 1.5) the held reference is the reader's, byte for byte, each
    frame's holds are chosen against the reference of its time and every frame decodes with the
    current one."""
    from reference_runtime import ReferenceCache
    from test_runtime_predictive import H, L, predictive_recipe, sequence

    recipe = predictive_recipe(recent=1, sink_bits=sink_bits, hold=hold, refresh=refresh)
    path = tmp_path / "pred.safetensors"
    save_recipe(recipe, path)
    meta, tensors = reader.read_recipe(path)
    assert meta["scheme"]["layers"][0]["k"]["rotary_coords"] == 2
    ks, vs, ropes = sequence(30)
    cache = ReferenceCache.from_recipe(load_recipe(path), window=6, sink_frames=1)
    for f in range(30):
        for layer in range(L):
            cache.append(layer, ks[f], vs[f], ropes[f])
    held_any = False
    recent_x = lambda kind, g, h: (ks if kind == "k" else vs)[g][:, h].half().float().numpy()  # coded from its recent copy
    for layer in range(L):
        for kind in "kv":
            states = cache._chain_states(layer, kind)
            assert any("anchor" in cache._frames[layer][g][kind][0] for g in states)
            for h in range(H):
                sink = {k: _np(t) for k, t in cache._frames[layer][0][kind][h].items()}
                # the reference frame g's holds were chosen against: the latest refresh frame (a multiple of 4) up to g
                reference = lambda g: reader.predictive_reference(recent_x(kind, g // refresh * refresh, h), tensors, layer,
                                                                  kind, h) if refresh and g >= refresh else sink
                current = sink
                if refresh:  # the runtime's held reference: the last frame coded (28: frame 29 is recent) refreshed it
                    current = reference(28)
                    assert np.array_equal(current["reference"], _np(cache._references[(layer, kind)][h]["reference"]))
                prev_frame, prev = None, None
                for g in sorted(states):
                    stored = {k: _np(t) for k, t in cache._frames[layer][g][kind][h].items()}
                    v = reader.predictive_states(stored, tensors, layer, kind, h, prev if prev_frame == g - 1 else None)
                    np.testing.assert_array_equal(v, _np(states[g][h]))
                    if "sink" in stored:
                        x = (ks if kind == "k" else vs)[g][:, h].half().float().numpy()  # via the recent copy
                        assert np.array_equal(reader.predictive_sink(x, tensors, layer, kind, h)["sink"], stored["sink"])
                        mine = reader.predictive_sink_values(stored, tensors, layer, kind, h).astype(np.float64)
                        theirs = _np(cache._load_kind(layer, kind, g, states)[:, h]).astype(np.float64)
                        assert np.abs(mine - theirs).max() <= 1e-5 * max(np.abs(theirs).max(), 1.0)
                    else:
                        bound = reader.predictive_values_bound(v, tensors, layer, kind, h)
                        mine = reader.predictive_values(v, tensors, layer, kind, h)
                        theirs = _np(cache._chains[(layer, kind)][h].values(states[g][h])).astype(np.float64)
                        assert (np.abs(mine.astype(np.float64) - theirs) <= bound).all()
                        assert ("holds" in stored) == hold
                        if hold:  # x̂ + h where held: the runtime's values within the bound (and h's rounding)
                            mine = reader.predictive_held_values(mine, stored, current, tensors, layer, kind, h)
                            theirs = _np(cache._load_kind(layer, kind, g, states)[:, h]).astype(np.float64)
                            assert np.abs(mine - theirs).max() <= bound.max() + 1e-6 * max(np.abs(theirs).max(), 1.0)
                            held_any |= bool(np.unpackbits(stored["holds"]).any())
                            hold_bits = reader.predictive_hold(recent_x(kind, g, h), reference(g), tensors, layer, kind, h)
                            packed = reader.pack_fields(hold_bits.astype(np.int64), [1] * hold_bits.shape[-1])
                            assert np.array_equal(packed, stored["holds"]), (layer, kind, h, g)
                    prev_frame, prev = g, v
    assert ("sink" in cache._frames[0][0]["k"][0]) == bool(sink_bits)
    assert held_any == hold  # the hold is exercised


def test_a_pre_rotary_keys_recent_copy_is_fp16_of_the_keys_before_the_rotation(tmp_path):
    """FORMAT.md "Keys before the rotary encoding": the recent copy holds fp16 of the pre-rotary
    keys, and the frame leaving the window is coded from it (reference and fast runtime, reader)."""
    from calibrate.fastcache import FastKVCache
    from reference_runtime import ReferenceCache
    from test_runtime_predictive import H, L, predictive_recipe, sequence

    path = tmp_path / "pred.safetensors"
    save_recipe(predictive_recipe(recent=1), path)
    meta, tensors = reader.read_recipe(path)
    ks, vs, ropes = sequence(3)
    ref = ReferenceCache.from_recipe(load_recipe(path), window=4, sink_frames=1)
    fast = FastKVCache.from_recipe(load_recipe(path), window=4, sink_frames=1)
    v_prev = [None] * H
    for f in range(3):
        for cache in (ref, fast):
            cache.append(0, ks[f], vs[f], ropes[f])
        recent = ref._frames[0][f]["k"]
        assert all(torch.equal(recent[h]["fp16"], ks[f][:, h].half()) for h in range(H))  # not ropes[f].apply(k)
        store = fast.stores[0]
        assert torch.equal(store.recent[:, :H, f % store.R], ks[f].half())
        if f == 0:
            continue
        for h in range(H):  # frame f - 1 left the recent window: coded from its float16 pre-rotary copy
            x = ks[f - 1][:, h].half().float().numpy()
            inter, codes, v = reader.predictive_encode(x, tensors, 0, "k", h, v_prev[h])
            mine = reader.predictive_store(inter, codes, tensors, 0, "k", h)
            theirs = ref._frames[0][f - 1]["k"][h]
            assert all(np.array_equal(mine[key], _np(theirs[key])) for key in ("modes", "codes"))
            v_prev[h] = v
    np.testing.assert_allclose(_np(ref.read(0)[0]), _np(fast.read(0)[0]), rtol=1e-5, atol=1e-5)  # both rotate


def test_predictive_values_differ_by_order_within_the_absolute_bound():
    """x̂'s product is summed in the runtime's order: far apart in ulps near 0, never beyond the
    bound of FORMAT.md (torch, numpy, the halving tree, left to right and the fast runtime's one
    product with unit R^T, on fitted roles)."""
    from calibrate.fast_chain_code import ChainCode
    from calibrate.predictive_roles import head_params
    from calibrate.quant import ordered
    from calibrate.quant import predictive as P
    from test_runtime_predictive import predictive_recipe

    recipe = predictive_recipe()
    tensors = {k: t.numpy() for k, t in recipe.tensors.items()}
    g = torch.Generator().manual_seed(0)
    worst_ulps = 0
    for layer in range(recipe.model.num_layers):
        for kind in "kv":
            fast = ChainCode([recipe.layer_tensors(layer, kind)], "cpu")
            for h in range(recipe.model.num_kv_heads):
                p = head_params(recipe.layer_tensors(layer, kind), h)
                v = (torch.randn(2, 64, p.unit_D.numel(), generator=g) * p.limit_D / 4).round().long()
                v = torch.minimum(torch.maximum(v, -p.limit_D), p.limit_D)
                uv = p.unit_D * v.float()
                left = torch.zeros(uv.shape)
                for d in range(uv.shape[-1]):
                    left = left + uv[..., d : d + 1] * p.rotation_DD[:, d]
                states = torch.zeros(*v.shape[:-1], fast.G, v.shape[-1], dtype=torch.int64)
                states[..., h, :] = v
                states = fast.compact(states).flatten(0, 1).transpose(0, 1)[None, :, None]  # [1, G, J = 1, Tb, Dc]
                runtime = fast.values(states)[0, h, 0].view(v.shape)
                outs = [P.values(v, p), torch.from_numpy(reader.predictive_values(v.numpy(), tensors, layer, kind, h)),
                        ordered.matmul(uv, p.rotation_DD.T.contiguous()) + p.mean_D, left + p.mean_D, runtime]
                bound = reader.predictive_values_bound(v.numpy(), tensors, layer, kind, h)
                for other in outs[1:]:
                    assert (np.abs(outs[0].double().numpy() - other.double().numpy()) <= bound).all()
                    ulps = (outs[0].view(torch.int32).long() - other.view(torch.int32).long()).abs().max().item()
                    worst_ulps = max(worst_ulps, ulps)
    assert worst_ulps > 100  # near 0 an absolute difference is many ulps: "1 ulp" would be false


# ---- format 1.1: prq, turbo, turbo_prod, the Jensen correction -----------------------------------
def test_fp8_bit_patterns():
    from calibrate.quant.qvg import fp8_e4m3

    x = torch.tensor([2.0**-9, 0.3, 1.0, 448.0, 0.0136, 3.5])
    bits = fp8_e4m3(x).view(torch.uint8).numpy()
    np.testing.assert_array_equal(reader.fp8_e4m3(bits), fp8_e4m3(x).float().numpy())
    assert np.isnan(reader.fp8_e4m3(np.array([0x7F], dtype=np.uint8)))[0]


@pytest.mark.parametrize("stages,C,block", [(1, 2, 16), (2, 5, 8), (1, 1, 16), (0, 0, 4)])
def test_prq_decode_matches_codec(stages, C, block):
    from calibrate.codec import fit_span_state, with_span_state

    spec = TensorSpec(bits=2, kind="prq", group_size=block, prq_stages=stages, prq_centroids=C)
    p = HeadParams(bits=2)
    x = _frame(20 + C)
    if stages:
        p = with_span_state(p, fit_span_state(x, spec, p))
    stored = encode(x, spec, p)
    codes = reader.unpack(_np(stored["codes"]), 2, 16)
    got = reader.dequantize_prq(codes, stored["p_scale"].view(torch.uint8).numpy(), 2, block,
                                None if not stages else p.span_centroids_BSCD.numpy(),
                                _np(stored["p_assign"]) if "p_assign" in stored else None, C)
    np.testing.assert_allclose(got, decode(stored, spec, p, 16).numpy(), atol=1e-5, rtol=0)


def test_prq_span_state_matches_codec():
    """The reader's k-means (FORMAT.md "PRQ k-means") against the runtime's, on dyadic inputs whose
    sums are exact in any order (the means' sum order is not pinned), ties and repeats included."""
    from calibrate.quant import qvg

    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        B, T, D = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 30, (1,), generator=g)), 4
        C, iters = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        y = torch.randint(-24, 25, (B, T, D), generator=g).float() / 8
        want = qvg.fit_centroids(y, 1, C, iters)  # one stage: a second one's residuals are not dyadic
        got = reader.prq_span_state(y.numpy(), 1, C, iters)
        assert np.array_equal(got.view(np.uint16), want.numpy().view(np.uint16)), (B, T, C, iters)


def test_turbo_decode_matches_codec(tmp_path):
    path = tmp_path / "turbo.safetensors"
    save_recipe(build_baseline("turbo2.5", INFO), path)
    recipe = load_recipe(path)
    _, tensors = reader.read_recipe(path)
    x = _frame(30)
    for kind in ("k", "v"):
        spec = recipe.spec(0, kind)
        for h in range(INFO.num_kv_heads):
            p = head_params(spec, recipe.layer_tensors(0, kind), h)
            stored = encode(x, spec, p)
            codes = reader.unpack(_np(stored["codes"]), 2, 16)
            R, L = tensors[f"layers.0.{kind}.rotation"][h], tensors[f"layers.0.{kind}.lloyd_max"][h]
            if kind == "k":
                got = reader.dequantize_turbo_prod(codes, _np(stored["p_norm"]), _np(stored["p_gamma"]), L,
                                                   tensors["layers.0.k.qjl"][h], 2, R)
            else:
                got = reader.dequantize_turbo(codes, _np(stored["p_norm"]), L, R)
            np.testing.assert_allclose(got, decode(stored, spec, p, 16).numpy(), atol=1e-5, rtol=0)


def test_jensen_correction_matches_the_runtimes():
    from calibrate.quant.jensen import jensen_bias

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 4, 16, generator=g)
    steps = torch.rand(1, 2, 12, 16, generator=g)
    R = torch.linalg.qr(torch.randn(2, 16, 16, generator=g))[0]
    want = jensen_bias(q, steps, R)
    for h in range(2):
        np.testing.assert_allclose(reader.jensen_correction(q[0, h].numpy(), steps[0, h].numpy(), R[h].numpy()),
                                   want[0, h].numpy(), rtol=1e-5, atol=1e-8)


def test_reader_refuses_an_unknown_kind(tmp_path):
    path = tmp_path / "r.safetensors"
    save_recipe(build_baseline("naive2", INFO), path)
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    scheme = json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["scheme"])
    scheme["layers"][1]["v"]["kind"] = "lattice"
    _rewrite_metadata(path, scheme=json.dumps(scheme))
    with pytest.raises(ValueError, match=re.escape("scheme.layers[1].v.kind 'lattice'")):
        reader.read_recipe(path)
