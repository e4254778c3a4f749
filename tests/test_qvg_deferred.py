"""Quant VideoGen's own schedule (`prq_deferred`, the `qvg2` preset): a span's frames are held in
float16 until its last frame is appended, then its centroids are fitted on all of them and every
frame is coded. Checked against the pure functions of quant/qvg.py applied to the whole span by
hand, and against the memory model's byte count at every step."""

from dataclasses import replace

import pytest
import torch

from toys import B, D, H, INFO, T, kv_frames

from calibrate.cache import kept_frames
from calibrate.codec import span_pending
from calibrate.memory import held_bits
from calibrate.quant import affine, qvg
from calibrate.recipe import Recipe, RecipeError, TensorSpec, TokenPolicy, load_recipe, save_recipe, uniform_scheme, validate
from reference_runtime import ReferenceCache

SPAN, G = 3, 8
DEFERRED = TensorSpec(bits=2, kind="prq", group_size=G, prq_stages=1, prq_centroids=2, prq_span_frames=SPAN, prq_deferred=True)


def _recipe(spec=DEFERRED, policy=TokenPolicy(sink_frames=0)) -> Recipe:
    r = Recipe(INFO, uniform_scheme("deferred", INFO.num_layers, spec, spec, policy), {})
    validate(r, "toy")
    return r


def _by_hand(frames_BTD: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each frame of one complete span decoded as QVG codes it: k-means on all the span's tokens
    (one stage), then every frame smoothed and its INT2 residual coded per token and group."""
    cents = qvg.fit_centroids(torch.cat(frames_BTD, dim=1), 1, DEFERRED.prq_centroids, DEFERRED.prq_kmeans_iters)
    out = []
    for x in frames_BTD:
        r, ids = qvg.smooth(x, cents)
        g = affine.group_view(r, G)
        rq = affine.ungroup(qvg.residual_values(qvg.residual_codes(g, qvg.residual_scale(g, 2), 2), qvg.residual_scale(g, 2), 2))
        out.append(qvg.unsmooth(rq, cents, ids))
    return out


def test_span_pending_rule():
    assert [span_pending(DEFERRED, f, 4) for f in range(4)] == [False, False, False, True]
    assert not span_pending(replace(DEFERRED, prq_deferred=False), 3, 4)
    assert held_bits(TokenPolicy(sink_frames=0), DEFERRED, 0, 3, 4) == 16
    assert held_bits(TokenPolicy(sink_frames=0), DEFERRED, 0, 2, 4) == 2


def test_pending_frames_are_float16_then_the_span_is_coded_on_all_its_frames():
    cache = ReferenceCache.from_recipe(_recipe(), window=8, sink_frames=0)
    frames = kv_frames(2 * SPAN)
    for n, (q, k, v, rope) in enumerate(frames, start=1):
        cache.attend(0, q, k, v, rope)
        keys, values = cache.read(0)
        for f in kept_frames(n, 8, 0):
            got_v = values[:, :, f * T:(f + 1) * T]
            if span_pending(DEFERRED, f, n):
                assert torch.equal(got_v, frames[f][2].half().float())
        if n % SPAN == 0:  # a span just completed: its frames as coded by hand from their float16 copies
            span = range(n - SPAN, n)
            for h in range(H):
                want = _by_hand([frames[f][2][:, h].half().float() for f in span])
                for f, w in zip(span, want):
                    assert torch.equal(values[:, h, f * T:(f + 1) * T], w)
                want_k = _by_hand([rope_f.apply(frames[f][1])[:, h].half().float()
                                   for f, rope_f in ((f, frames[f][3]) for f in span)])
                for f, w in zip(span, want_k):
                    assert torch.equal(keys[:, h, f * T:(f + 1) * T], w)


@pytest.mark.parametrize("window,sink", [(4, 1), (2, 1), (5, 0)])
@pytest.mark.parametrize("policy", [TokenPolicy(sink_frames=0), TokenPolicy(sink_frames=1, sink_bits=16),
                                    TokenPolicy(sink_frames=0, keyframe_interval=4, keyframe_bits=4)])
def test_measured_bytes_equal_predicted_at_every_step(window, sink, policy):
    """Pending frames at 16 bits, span states only of coded spans, a window shorter than a span
    (frames evicted before their span completes), float16 sinks and key frames in a span."""
    recipe = _recipe(replace(DEFERRED, head_bits=[2, 3]), policy)
    cache = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    for n, (q, k, v, rope) in enumerate(kv_frames(11), start=1):
        for layer in range(INFO.num_layers):
            assert torch.isfinite(cache.attend(layer, q, k, v, rope)).all()
        assert cache.nbytes() == cache.predicted_nbytes(n, batch=B), n


def test_recipe_field_round_trips_and_is_checked(tmp_path):
    path = tmp_path / "r.safetensors"
    save_recipe(_recipe(), path)
    assert load_recipe(path).scheme.layers[0].k.prq_deferred is True
    with pytest.raises(RecipeError, match="recent_frames must be 0"):
        _recipe(policy=TokenPolicy(sink_frames=0, recent_frames=2))
    with pytest.raises(RecipeError, match="prq_deferred: needs prq_stages"):
        _recipe(replace(DEFERRED, prq_stages=0, prq_centroids=0))
    with pytest.raises(RecipeError, match="applies to kind 'prq' only"):
        _recipe(TensorSpec(bits=2, prq_deferred=True))


def test_the_numpy_reader_codes_a_deferred_span_bit_identically(tmp_path):
    """recipes/reader.py, written from FORMAT.md: 16 bits while the span is pending, then the state
    fitted on the span's float16 frames in frame order and every frame coded against it, byte for
    byte as the runtime stores them."""
    import numpy as np

    from recipes import reader

    path = tmp_path / "deferred.safetensors"
    save_recipe(_recipe(), path)
    meta, tensors = reader.read_recipe(path)
    spec = reader.spec_of(meta, 0, "v")
    cache = ReferenceCache.from_recipe(load_recipe(path, model=INFO), window=8, sink_frames=0)
    frames = kv_frames(2 * SPAN + 1)
    for n, (q, k, v, rope) in enumerate(frames, start=1):
        cache.append(0, k, v, rope)
        held = cache.frame_indices(0)
        assert [reader.held_bits(meta["scheme"]["policy"], spec, 0, f, n) for f in held] == \
               [cache.stored_bits(0, "v", 0, f) for f in held]
    for span in range(2):
        members = range(span * SPAN, (span + 1) * SPAN)
        for h in range(H):
            x16 = [frames[f][2][:, h].half().float().numpy() for f in members]
            state = reader.prq_span_state(np.concatenate(x16, axis=1), 1, 2, 2)
            assert state.tobytes() == cache._span_states[0][("v", h, span)].numpy().tobytes()
            p = reader.head_params(spec, tensors, 0, "v", h, 2)
            for f, x in zip(members, x16):
                mine = reader.encode_head(x, spec, p, state)
                theirs = cache._frames[0][f]["v"][h]
                assert sorted(mine) == sorted(theirs)
                for key in mine:
                    t = theirs[key]
                    t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                    assert np.asarray(mine[key]).tobytes() == t.numpy().tobytes(), (span, h, f, key)
