"""Key frames: every N-th frame is stored at `keyframe_bits` (read off the stored codes), N <= 0 is
refused where N is chosen (config) and a negative N where it is read (recipe, runtime), the
budget counts the worst phase of the sliding window, and the fitter's allocator offers them."""

from dataclasses import replace

import pytest

from calibrate.config import Config, FitConfig, validate
from calibrate.fastcache import FastKVCache
from calibrate.fit.allocate import KEYFRAME_BITS, _policy_candidates
from calibrate.memory import bits_per_element, fp16_cache_bytes
from calibrate.recipe import Recipe, TensorSpec, TokenPolicy, uniform_scheme
from reference_runtime import ReferenceCache

from toys import B, INFO, frame_bits, kv_frames


def recipe_with(policy: TokenPolicy) -> Recipe:
    return Recipe(INFO, uniform_scheme("kf", INFO.num_layers, TensorSpec(bits=2, group_size=8),
                                       TensorSpec(bits=2, axis="channel"), policy), {})


def stored_bits(cache: ReferenceCache, layer: int) -> dict[int, set[int]]:
    """Frame index -> widths its K and V heads are stored at (from the stored records)."""
    return {f: {frame_bits(h) for kind in ("k", "v") for h in cache._frames[layer][f][kind]}
            for f in cache.frame_indices(layer)}


@pytest.mark.parametrize("interval,bits", [(4, 8), (3, 4), (1, 8)])
def test_key_frames_are_exactly_every_nth_frame(interval, bits):
    cache = ReferenceCache.from_recipe(recipe_with(TokenPolicy(sink_frames=0, keyframe_interval=interval,
                                                                 keyframe_bits=bits)), window=100, sink_frames=0)
    frames = kv_frames(13)
    for q, k, v, rope in frames:
        for layer in range(INFO.num_layers):
            cache.attend(layer, q, k, v, rope)
    for layer in range(INFO.num_layers):
        held = stored_bits(cache, layer)
        assert sorted(held) == list(range(13))
        assert [f for f, b in held.items() if b == {bits}] == list(range(0, 13, interval))
        assert all(b == {2} for f, b in held.items() if f % interval)


def test_a_key_frame_in_the_recent_window_is_re_encoded_at_key_frame_bits():
    policy = TokenPolicy(sink_frames=0, recent_frames=2, keyframe_interval=5, keyframe_bits=8)
    cache = ReferenceCache.from_recipe(recipe_with(policy), window=100, sink_frames=0)
    history = []
    for n, (q, k, v, rope) in enumerate(kv_frames(12), start=1):
        for layer in range(INFO.num_layers):
            cache.attend(layer, q, k, v, rope)
        history.append(stored_bits(cache, 0))
    assert history[5][5] == {16} and history[6][5] == {16} and history[7][5] == {8}  # frame 5: recent, then key
    assert history[11] == {f: ({16} if f >= 10 else {8} if f % 5 == 0 else {2}) for f in range(12)}


def test_negative_interval_is_refused_by_the_runtime():
    with pytest.raises(ValueError, match="keyframe_interval"):
        FastKVCache.from_recipe(recipe_with(TokenPolicy(keyframe_interval=-3)))


@pytest.mark.parametrize("intervals", [[0], [8, -2]])
def test_config_refuses_intervals_below_one(intervals):
    cfg = Config()
    cfg.fit = replace(FitConfig(), keyframes=True, keyframe_intervals=intervals)
    with pytest.raises(ValueError, match="fit.keyframe_intervals"):
        validate(cfg)


def test_budget_counts_the_worst_phase_of_the_window():
    """With N = 5 and a 16-frame window the window holds 3 or 4 key frames as it slides: the
    budget figure is the larger, so the measured cache never exceeds it; without the max the
    first phase alone would be below it at some frames."""
    recipe = recipe_with(TokenPolicy(sink_frames=0, keyframe_interval=5, keyframe_bits=8))
    budget = bits_per_element(recipe.model, recipe.scheme, 16, 1)
    cache = ReferenceCache.from_recipe(recipe, window=16, sink_frames=1)
    measured = []
    for n, (q, k, v, rope) in enumerate(kv_frames(60), start=1):
        for layer in range(INFO.num_layers):
            cache.attend(layer, q, k, v, rope)
        if n >= 17:
            measured.append(16.0 * cache.nbytes() / fp16_cache_bytes(recipe.model, n, 16, 1, batch=B))
    assert max(measured) == pytest.approx(budget, abs=1e-9)
    assert min(measured) < budget - 0.1


def test_allocator_offers_every_interval_and_width_once():
    cfg = replace(FitConfig(), keyframes=True, keyframe_intervals=[4, 8])
    policy = TokenPolicy(sink_frames=0, recent_frames=4)  # no recent-window candidate left
    got = {(p.keyframe_interval, p.keyframe_bits) for p in _policy_candidates(policy, cfg)}
    assert got == {(n, b) for n in (4, 8) for b in KEYFRAME_BITS}
    current = replace(policy, keyframe_interval=4, keyframe_bits=4)
    assert (4, 4) not in {(p.keyframe_interval, p.keyframe_bits) for p in _policy_candidates(current, cfg)}
    assert _policy_candidates(policy, replace(cfg, keyframes=False)) == []
