import pytest
import torch

from calibrate.cache import KVCache, Rope, kept_frames, rotate_pairs, rotate_pairs_complex, softmax_attention


def _frame(value: float, B=1, H=2, T=3, D=4):
    return torch.full((B, H, T, D), value)


def _no_rope(B=1, T=3, D=4):
    return Rope(torch.zeros(B, T, D // 2))


@pytest.mark.parametrize(
    "n, window, sink, expected",
    [
        (1, 16, 1, [0]),
        (5, 3, 1, [0, 2, 3, 4]),
        (5, 3, 0, [2, 3, 4]),
        (5, 3, 2, [0, 1, 2, 3, 4]),
        (10, 3, 2, [0, 1, 7, 8, 9]),
        (10, 1, 0, [9]),
    ],
)
def test_kept_frames(n, window, sink, expected):
    assert kept_frames(n, window, sink) == expected


def test_cache_keeps_exactly_sink_and_window_frames():
    cache = KVCache(num_layers=2, window=3, sink_frames=1)
    for i in range(7):
        for layer in range(2):
            cache.append(layer, _frame(float(i)), _frame(float(-i)), _no_rope())
    assert cache.frame_indices(0) == [0, 4, 5, 6]
    k, v = cache.read(1)
    # each frame's tokens carry its index as value: order is oldest first
    assert k[0, 0, :, 0].tolist() == [0.0] * 3 + [4.0] * 3 + [5.0] * 3 + [6.0] * 3
    assert v[0, 0, :, 0].tolist() == [-x for x in k[0, 0, :, 0].tolist()]
    assert cache.nbytes() == 2 * 4 * 2 * (1 * 2 * 3 * 4) * 4  # layers * frames * (k, v) * elems * fp32


def test_attend_equals_plain_attention_over_history():
    torch.manual_seed(0)
    cache = KVCache(num_layers=1, window=16, sink_frames=1)
    ks, vs = [], []
    for _ in range(4):
        k, v, q = torch.randn(3, 1, 2, 3, 4).unbind(0)
        angles = torch.randn(1, 3, 2)
        out = cache.attend(0, q, k, v, Rope(angles))
        ks.append(Rope(angles).apply(k))
        vs.append(v)
    ref = softmax_attention(q, torch.cat(ks, 2), torch.cat(vs, 2))
    torch.testing.assert_close(out, ref)


def test_rope_is_a_rotation_and_relative():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 5, 8).unbind(0)
    a = torch.randn(1, 5, 4)
    shift = torch.randn(1, 1, 4)
    torch.testing.assert_close(Rope(a).apply(q).norm(dim=-1), q.norm(dim=-1))
    dot1 = (Rope(a).apply(q) * Rope(a * 0).apply(k)).sum(-1)
    dot2 = (Rope(a + shift).apply(q) * Rope(shift.expand_as(a)).apply(k)).sum(-1)
    torch.testing.assert_close(dot1, dot2)


def test_complex_rotation_is_the_pair_rotation_within_rounding():
    # a hand-computed pair: (1, 2) by 90 degrees is (-2, 1); then random blocks against rotate_pairs
    x = torch.tensor([[1.0, 2.0]])
    got = rotate_pairs_complex(x, torch.zeros(1, 1), torch.ones(1, 1))
    assert got.tolist() == [[-2.0, 1.0]]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, 16, generator=g)
    a = torch.randn(2, 1, 5, 7, 8, generator=g) * 10
    want = rotate_pairs(x, a.cos(), a.sin())
    torch.testing.assert_close(rotate_pairs_complex(x, a.cos(), a.sin()), want, rtol=0, atol=4 * 2 ** -23 * x.abs().max().item())
    swapped = rotate_pairs_complex(x, a.sin(), a.cos())  # a wrong convention is far off
    assert (swapped - want).abs().max() > 0.5


def test_bad_window_rejected():
    with pytest.raises(ValueError, match="window"):
        KVCache(num_layers=1, window=0)
    with pytest.raises(ValueError, match="sink_frames"):
        KVCache(num_layers=1, window=4, sink_frames=-1)


# ---- attend_uncommitted: what a denoising pass sees, with nothing stored ----------------------
def _frames(n: int, B=2, H=2, T=4, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g),
             torch.randn(B, H, T, D, generator=g), Rope(torch.randn(B, T, D // 2, generator=g))) for _ in range(n)]


def _uncommitted_equals_commit(make_cache):
    """attend_uncommitted == what attend would return, and the cache is left exactly as it was."""
    frames = _frames(7)
    for n in range(1, 7):
        cache = make_cache()
        for q, k, v, rope in frames[:n]:
            cache.attend(0, q, k, v, rope)
        q, k, v, rope = frames[n]
        before = cache.num_frames_seen, cache.frame_indices(0), cache.nbytes()
        peek = cache.attend_uncommitted(0, q, k, v, rope)
        assert (cache.num_frames_seen, cache.frame_indices(0), cache.nbytes()) == before
        torch.testing.assert_close(peek, cache.attend(0, q, k, v, rope), atol=1e-6, rtol=0)


def test_attend_uncommitted_full_precision():
    _uncommitted_equals_commit(lambda: KVCache(1, window=3, sink_frames=1))


def test_attend_uncommitted_quantized_with_logit_correction():
    from calibrate.recipe import ModelInfo, Recipe, TensorSpec, TokenPolicy, uniform_scheme
    from reference_runtime import ReferenceCache

    info = ModelInfo("toy", num_layers=1, num_kv_heads=2, head_dim=16, tokens_per_frame=4, fingerprint="toy")
    spec = TensorSpec(bits=2, group_size=8)
    # no recent fp16 window: the frame a commit would push out of it is then stored the same either way
    policy = TokenPolicy(sink_frames=1, sink_bits=8, recent_frames=0)
    var = torch.rand(2, 16, generator=torch.Generator().manual_seed(1))
    recipe = Recipe(info, uniform_scheme("toy", 1, spec, spec, policy), {"layers.0.k.logit_bias": var})
    _uncommitted_equals_commit(lambda: ReferenceCache.from_recipe(recipe, window=3, sink_frames=1))
