"""The packed runtime against its reference: codec.encode/decode == codec.fake_quant, and the
ReferenceCache's token policy, storage (no full-precision shadow) and byte accounting.

Toy sizes throughout (tests/toys.py): H = 2 heads, D = 16 channels, T = 4 tokens per frame, B = 2.
"""

import pytest
import torch

from calibrate.cache import KVCache, kept_frames
from calibrate.codec import decode, encode, fake_quant, frame_nbytes, head_params, stored_nbytes
from calibrate.quant.packing import unpack
from calibrate.recipe import RecipeError, TensorSpec, TokenPolicy, save_recipe
from reference_runtime import ReferenceCache

from toys import B, D, H, INFO, T, frame, frame_bits, kv_frames, toy_recipe

SPECS = {
    "token_asym_g8": TensorSpec(bits=2, group_size=8),
    "token_sym_g4": TensorSpec(bits=3, symmetric=True, group_size=4),
    "token_asym_4bit": TensorSpec(bits=4),
    "token_sym_8bit": TensorSpec(bits=8, symmetric=True, group_size=8),
    "channel_dynamic_asym": TensorSpec(bits=2, axis="channel"),
    "channel_dynamic_sym": TensorSpec(bits=4, axis="channel", symmetric=True),
    "channel_static_asym": TensorSpec(bits=2, axis="channel", static=True),
    "channel_static_sym": TensorSpec(bits=3, axis="channel", static=True, symmetric=True),
    "codebook_static": TensorSpec(bits=2, kind="codebook", axis="channel", static=True),
    "codebook_token": TensorSpec(bits=3, kind="codebook", group_size=8),
    "rotation": TensorSpec(bits=2, rotation="hadamard"),
    "rotation_learned_channel": TensorSpec(bits=2, axis="channel", rotation="learned"),
    "outliers_static": TensorSpec(bits=2, axis="channel", static=True, outliers=2),
    "outliers_token": TensorSpec(bits=2, group_size=8, outliers=3),
    "sparse_token": TensorSpec(bits=2, sparse_fraction=0.05),
    "sparse_codebook_static": TensorSpec(bits=2, kind="codebook", axis="channel", static=True, sparse_fraction=0.02),
    "sparse_static_asym": TensorSpec(bits=3, axis="channel", static=True, sparse_fraction=0.03),
    "centroids": TensorSpec(bits=2, group_size=8, centroids=4),
    "compensator": TensorSpec(bits=2, comp_rank=3),
    "head_bits_mixed": TensorSpec(bits=2, head_bits=[2, 8], group_size=8),
    "head_bits_codebook": TensorSpec(bits=2, head_bits=[2, 4], kind="codebook"),
    "head_bits_fp16_head": TensorSpec(bits=2, head_bits=[16, 3], axis="channel"),
    "everything": TensorSpec(bits=4, rotation="hadamard", centroids=3, outliers=2, sparse_fraction=0.04, comp_rank=2,
                             clip=0.9, group_size=8),
}


@pytest.mark.parametrize("name", SPECS)
def test_packed_encode_decode_equals_fake_quant(name):
    spec = SPECS[name]
    recipe = toy_recipe(spec, clip=[0.95, 0.85] if name == "everything" else None)
    x = frame(1)
    for h in range(H):
        p = head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), h)
        stored = encode(x, spec, p)
        ref, codes = fake_quant(x, spec, p)
        torch.testing.assert_close(decode(stored, spec, p, D), ref, atol=1e-6, rtol=0)
        assert stored_nbytes(stored) == frame_nbytes(spec, p.bits, B, T, D)
        if p.bits == 16:
            assert codes is None and set(stored) == {"fp16"}
            continue
        assert codes.dtype == torch.uint8 and codes.shape == (B, T, D) and int(codes.max()) < 2**p.bits
        assert torch.equal(unpack(stored["codes"], p.bits, D), codes)
        assert all(t.dtype != torch.float32 for t in stored.values())  # nothing stored at full precision


def test_more_bits_less_error():
    x = frame(2)
    errs = []
    for b in (2, 3, 4, 8):
        spec = TensorSpec(bits=b, group_size=8)
        ref, _ = fake_quant(x, spec, head_params(spec, toy_recipe(spec).layer_tensors(0, "k"), 0))
        errs.append((ref - x).pow(2).mean().item())
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-4 * x.pow(2).mean().item()


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("value", [0.0, 2.5, -1e-9])
def test_zero_and_constant_frames_are_finite(name, value):
    spec = SPECS[name]
    recipe = toy_recipe(spec)
    x = torch.full((B, T, D), value)
    for h in range(H):
        p = head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), h)
        out = decode(encode(x, spec, p), spec, p, D)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, fake_quant(x, spec, p)[0], atol=1e-6, rtol=0)
        plain = not (spec.centroids or spec.outliers or spec.sparse_fraction or spec.comp_rank or spec.rotation != "none")
        if spec.kind == "uniform" and not (spec.static or spec.symmetric) and plain and p.bits < 16:
            # asymmetric dynamic: a constant group is reproduced (zero point = the value, in float16)
            assert torch.equal(out, x.half().float())


@pytest.mark.parametrize("spec", [TensorSpec(bits=2), TensorSpec(bits=2, symmetric=True), TensorSpec(bits=2, kind="codebook")],
                         ids=["asym", "sym", "codebook"])
def test_zero_frame_stores_a_positive_scale(spec):
    p = head_params(spec, toy_recipe(spec).layer_tensors(0, "k"), 0)
    stored = encode(torch.zeros(B, T, D), spec, p)
    assert (stored["p_scale"].float() > 0).all()


def test_dynamic_channel_codebook_is_rejected(tmp_path):
    # dynamic codebooks are per token; a per-channel codebook must have static ranges
    with pytest.raises(RecipeError, match="static"):
        save_recipe(toy_recipe(TensorSpec(bits=2, kind="codebook", axis="channel")), tmp_path / "r.safetensors")


@pytest.mark.parametrize("symmetric", [False, True])
def test_static_scale_is_recut_for_other_widths(symmetric):
    # a sink/key frame stored at 8 bits keeps the calibrated 2-bit range, split into 256 steps
    recipe = toy_recipe(TensorSpec(bits=2, axis="channel", static=True, symmetric=symmetric))
    scale2 = recipe.tensor(0, "k", "scale")[1]
    p8 = head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), 1, bits=8)
    if symmetric:  # range [-2 scale, 2 scale) -> [-128 s8, 128 s8)
        torch.testing.assert_close(p8.scale_D * 128, scale2 * 2)
    else:  # range [zero, zero + 3 scale] -> [zero, zero + 255 s8]
        torch.testing.assert_close(p8.scale_D * 255, scale2 * 3)
    assert torch.equal(p8.zero_D, recipe.tensor(0, "k", "zero_point")[1])
    x = frame(4)
    err2 = (fake_quant(x, recipe.scheme.layers[0].k, head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), 1))[0] - x).abs().mean()
    err8 = (fake_quant(x, recipe.scheme.layers[0].k, p8)[0] - x).abs().mean()
    assert err8 < err2 / 4


def test_codebook_rows_for_other_widths():
    recipe = toy_recipe(TensorSpec(bits=3, kind="codebook"))
    row = recipe.tensor(0, "k", "codebook")[0]
    assert torch.equal(head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), 0).levels_L, row)
    assert torch.equal(head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), 0, bits=2).levels_L, row[[0, 2, 5, 7]])  # rne(0, 2.33, 4.67, 7)
    assert torch.equal(head_params(recipe.spec(0, "k"), recipe.layer_tensors(0, "k"), 0, bits=4).levels_L,
                       (torch.arange(16.0) * 2 - 15) / 15)  # correctly rounded, not float32 linspace


# ---- ReferenceCache --------------------------------------------------------------------------------
def decoded_frame(cache: ReferenceCache, layer: int, f: int):
    """Decoded K, V [B, H, T, D] of kept frame f, via the public read()."""
    k, v = cache.read(layer)
    pos = cache.frame_indices(layer).index(f)
    return k[:, :, pos * T : (pos + 1) * T], v[:, :, pos * T : (pos + 1) * T]


KIVI_LIKE = (TensorSpec(bits=2, axis="channel"), TensorSpec(bits=2, group_size=8))
POLICY = TokenPolicy(sink_frames=1, sink_bits=8, recent_frames=2, recent_bits=16, keyframe_interval=3, keyframe_bits=4)


def expected_bits(f: int, n: int, head: int) -> int:
    """POLICY by hand, with head_bits [2, 3]: recent, then sink, then keyframe, then the head's own."""
    if f >= n - 2:
        return 16
    if f < 1:
        return 8
    if f % 3 == 0:
        return 4
    return (2, 3)[head]


def test_token_policy_classes_and_re_encoding():
    spec = TensorSpec(bits=2, head_bits=[2, 3], group_size=8)
    recipe = toy_recipe(spec, TensorSpec(bits=2, head_bits=[2, 3], axis="channel"), POLICY)
    cache = ReferenceCache.from_recipe(recipe, window=100, sink_frames=1)
    frames = kv_frames(10)
    for n, (q, k, v, rope) in enumerate(frames, start=1):
        for layer in range(INFO.num_layers):
            cache.attend(layer, q, k, v, rope)
        for layer in range(INFO.num_layers):
            for f in cache.frame_indices(layer):
                record = cache._frames[layer][f]
                for kind in ("k", "v"):
                    got = [frame_bits(record[kind][h]) for h in range(H)]
                    assert got == [expected_bits(f, n, h) for h in range(H)], (n, f, kind)
    # a frame that left the recent window holds the encoding of its float16 copy at its final width
    n = len(frames)
    for f in (0, 3, 5):  # sink (8 bits), keyframe (4 bits), other (head_bits)
        _, k, v, rope = frames[f]
        got_k, got_v = decoded_frame(cache, 1, f)
        for h in range(H):
            for kind, x, got in (("k", rope.apply(k), got_k), ("v", v, got_v)):
                layer_spec = getattr(recipe.scheme.layers[1], kind)
                p = head_params(recipe.spec(1, kind), recipe.layer_tensors(1, kind), h, expected_bits(f, n, h))
                want, _ = fake_quant(x[:, h].half().float(), layer_spec, p)
                torch.testing.assert_close(got[:, h], want, atol=1e-6, rtol=0)


def test_no_full_precision_copy_of_quantized_history():
    recipe = toy_recipe(*KIVI_LIKE, policy=TokenPolicy(sink_frames=0, recent_frames=3, recent_bits=16))
    cache = ReferenceCache.from_recipe(recipe, window=8, sink_frames=1)
    for n, (q, k, v, rope) in enumerate(kv_frames(7), start=1):
        for layer in range(INFO.num_layers):
            cache.attend(layer, q, k, v, rope)
            for f in cache.frame_indices(layer):
                for kind in ("k", "v"):
                    keys = {key for head in cache._frames[layer][f][kind] for key in head}
                    if f >= n - 3:
                        assert keys == {"fp16"}
                    else:
                        assert "fp16" not in keys and "codes" in keys
                        assert all(t.dtype in (torch.uint8, torch.float16)
                                   for head in cache._frames[layer][f][kind] for t in head.values())


CACHE_RECIPES = {
    "kivi_like": lambda: toy_recipe(*KIVI_LIKE, policy=TokenPolicy(sink_frames=0, recent_frames=2)),
    "policy_mixed": lambda: toy_recipe(TensorSpec(bits=2, head_bits=[2, 3], group_size=8),
                                       TensorSpec(bits=3, axis="channel", static=True, outliers=2), POLICY),
    "centroids_sparse": lambda: toy_recipe(TensorSpec(bits=2, centroids=4, sparse_fraction=0.05),
                                           TensorSpec(bits=2, kind="codebook", group_size=8),
                                           TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=1)),
    "fp16": lambda: toy_recipe(TensorSpec(bits=16), policy=TokenPolicy(sink_frames=0)),
}


@pytest.mark.parametrize("name", CACHE_RECIPES)
@pytest.mark.parametrize("window,sink", [(3, 1), (4, 0), (2, 2)])
def test_measured_bytes_equal_predicted_and_eviction(name, window, sink):
    recipe = CACHE_RECIPES[name]()
    cache = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    for n, (q, k, v, rope) in enumerate(kv_frames(9), start=1):
        for layer in range(INFO.num_layers):
            cache.attend(layer, q, k, v, rope)
            assert cache.frame_indices(layer) == kept_frames(n, window, sink)
        assert len(cache.frame_indices(0)) == min(n, window + min(sink, max(n - window, 0)))
        assert cache.nbytes() == cache.predicted_nbytes(n, batch=B), n


def test_sixteen_bit_scheme_matches_the_fp_cache():
    recipe = CACHE_RECIPES["fp16"]()
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=1)
    ref = KVCache(INFO.num_layers, window=4, sink_frames=1)
    for q, k, v, rope in kv_frames(8):
        for layer in range(INFO.num_layers):
            got = cache.attend(layer, q, k, v, rope)
            want = ref.attend(layer, q, k, v, rope)
            torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)  # history held in float16
        assert cache.frame_indices(0) == ref.frame_indices(0)


def test_newest_frame_attends_to_its_own_fresh_kv():
    # with only the first frame cached, the 2-bit cache's output is exactly full precision
    recipe = toy_recipe(TensorSpec(bits=2), policy=TokenPolicy(sink_frames=0))
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=1)
    ref = KVCache(INFO.num_layers, window=4, sink_frames=1)
    q, k, v, rope = kv_frames(1)[0]
    assert torch.equal(cache.attend(0, q, k, v, rope), ref.attend(0, q, k, v, rope))
    # ...while what it stored for later frames is quantized
    stored_k, _ = cache.read(0)
    assert not torch.allclose(stored_k, rope.apply(k), atol=1e-3)
