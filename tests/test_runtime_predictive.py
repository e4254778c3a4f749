"""The packed runtime with predictive (cross-frame) tensors and keys stored before the rotation."""

import json

import pytest
import torch

from calibrate.cache import Rope, kept_frames
from calibrate.chain import frame_role
from calibrate.predictive_roles import head_params
from calibrate.quant import predictive as P
from calibrate.recipe import LayerSpec, Recipe, RecipeError, Scheme, TensorSpec, TokenPolicy, load_recipe, save_recipe
from calibrate.fastcache import FastKVCache
from calibrate.types import ModelInfo
from reference_runtime import ReferenceCache
from toys import predictive_roles, refresh_fields

L, H, T, D = 2, 2, 4, 16


def toy_rope(coords_BP):
    """Angles from two coordinates per frame, the same function every time (as a model's)."""
    freqs = torch.linspace(0.1, 2.0, D // 2)
    angles = coords_BP[:, None, 0:1] * freqs + coords_BP[:, None, 1:2] * torch.arange(T)[None, :, None] * 0.1
    return Rope(angles, coords_BP=coords_BP, at=toy_rope)


def sequence(num_frames=40, B=2, seed=0):
    """Slowly moving K/V (a random walk) with a moving camera's rotary coordinates."""
    g = torch.Generator().manual_seed(seed)
    base_k = torch.randn(B, H, T, D, generator=g)
    base_v = torch.randn(B, H, T, D, generator=g)
    ks, vs, ropes = [], [], []
    for f in range(num_frames):
        base_k = base_k + 0.05 * torch.randn(B, H, T, D, generator=g)
        base_v = base_v + 0.05 * torch.randn(B, H, T, D, generator=g)
        ks.append(base_k.clone())
        vs.append(base_v.clone())
        ropes.append(toy_rope(torch.stack([torch.full((B,), 0.3 * f), torch.full((B,), float(f % 5))], dim=1)))
    return ks, vs, ropes


def predictive_recipe(pre_rotary=True, recent=0, seed=0, name="toy-pred", sink_bits=0.0, hold=False, refresh=0):
    """A predictive recipe fitted to `sequence`-like data; `sink_bits` > 0: with a sink code, and
    `hold`: with the sink hold (format 1.4), `refresh` > 0 its reference refreshed (format 1.5)."""
    ks, vs, _ = sequence(60, seed=seed + 100)
    tensors, layers = {}, []
    for i in range(L):
        specs = {}
        for kind, xs in (("k", ks), ("v", vs)):
            x = torch.stack(xs, dim=2)  # B H F T D
            roles = predictive_roles(x, sink_bits=sink_bits)
            tensors.update({f"layers.{i}.{kind}.{r}": t for r, t in roles.items()})
            specs[kind] = TensorSpec(bits=2, kind="predictive", rotation="learned",
                                     rotary_coords=2 if (kind == "k" and pre_rotary) else 0,
                                     token_bits=roles["channel_bits"].sum(-1).tolist(),
                                     anchor_token_bits=roles["anchor_bits"].sum(-1).tolist(),
                                     sink_token_bits=roles["sink_bits"].sum(-1).tolist() if sink_bits else None,
                                     sink_hold=hold, **refresh_fields(roles, refresh))
        layers.append(LayerSpec(**specs))
    info = ModelInfo("toy", L, H, D, T, "f" * 16)
    return Recipe(info, Scheme(name, layers, TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=recent)), tensors)


def reference_frames(recipe, ks, vs, layer, kind, via_fp16=False, sink_frames=0):
    """Every frame's reconstruction by the sequential closed loop (no window at all); frames that
    passed through the float16 recent window are coded from their float16 copy."""
    x = torch.stack(ks if kind == "k" else vs, dim=2)
    x = x.half().float() if via_fp16 else x
    t = recipe.layer_tensors(layer, kind)
    return torch.stack([P.fake_quant_sequence(x[:, h], head_params(t, h), sink_frames=sink_frames)
                        for h in range(H)], dim=1)  # B H F T D


@pytest.mark.parametrize("window,sink,recent,sink_bits", [(6, 1, 0, 0), (6, 1, 2, 0), (3, 0, 0, 0), (1, 1, 0, 0),
                                                          (8, 2, 3, 0), (6, 1, 0, 6), (1, 1, 0, 6), (8, 2, 3, 5)])
def test_runtime_equals_the_closed_loop_reference_and_bytes_match(window, sink, recent, sink_bits):
    recipe = predictive_recipe(recent=recent, sink_bits=sink_bits)
    ks, vs, ropes = sequence(40)
    cache = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    refs = {(l, kind): reference_frames(recipe, ks, vs, l, kind, recent > 0, sink) for l in range(L) for kind in "kv"}
    for f in range(40):
        for layer in range(L):
            cache.append(layer, ks[f], vs[f], ropes[f])
            held = cache.frame_indices(layer)
            assert held == kept_frames(f + 1, window, sink)
            k_read, v_read = cache.read(layer)
            for j, g in enumerate(held):
                sl = slice(j * T, (j + 1) * T)
                if recent and g >= f + 1 - recent:  # float16 copy of the input
                    want_k, want_v = ks[g].half().float(), vs[g].half().float()
                else:
                    want_k, want_v = refs[(layer, "k")][:, :, g], refs[(layer, "v")][:, :, g]
                assert torch.allclose(v_read[:, :, sl], want_v, atol=1e-5), (f, layer, g)
                assert torch.allclose(k_read[:, :, sl], ropes[g].apply(want_k), atol=1e-5), (f, layer, g)
        assert cache.nbytes() == cache.predicted_nbytes(f + 1, batch=2)


def test_roles_anchor_exactly_when_the_predecessor_is_gone():
    kept = kept_frames(30, 6, 1)
    roles = {f: frame_role(f, 30, set(kept), 0) for f in kept}
    assert roles[0] == "delta" and roles[24] == "anchor"
    assert all(roles[f] == "delta" for f in range(25, 30))
    assert frame_role(29, 30, set(kept), 2) == "recent"


def test_static_input_never_drifts_over_1024_frames():
    recipe = predictive_recipe(pre_rotary=False)
    x_k, x_v = torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    rope = toy_rope(torch.zeros(1, 2))
    cache = ReferenceCache.from_recipe(recipe, window=16, sink_frames=1)
    errors = []
    for f in range(1024):
        cache.append(0, x_k, x_v, rope)
        _, v = cache.read(0)
        errors.append(float((v[:, :, -T:] - x_v).abs().max()))
    # after the chain settles the newest frame's error stops changing: no drift
    assert max(errors[100:]) <= max(errors[50:100]) + 1e-6


def test_recipe_round_trip_and_bad_roles(tmp_path):
    recipe = predictive_recipe()
    path = tmp_path / "r.safetensors"
    save_recipe(recipe, path)
    again = load_recipe(path)
    assert again.spec(0, "k").rotary_coords == 2 and again.spec(0, "v").kind == "predictive"
    bad = predictive_recipe()
    bad.tensors["layers.1.v.intra_step"] = bad.tensors["layers.1.v.intra_step"] * 1000
    with pytest.raises(RecipeError, match="intra_step"):
        save_recipe(bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    bad = predictive_recipe()
    bad.tensors["layers.0.k.channel_bits"] = bad.tensors["layers.0.k.channel_bits"].to(torch.int32)
    with pytest.raises(RecipeError, match="channel_bits"):
        save_recipe(bad, tmp_path / "bad.safetensors")
    bad = predictive_recipe()
    bad.scheme.layers[0].v.token_bits = [1, 2]
    with pytest.raises(RecipeError, match="token_bits"):
        save_recipe(bad, tmp_path / "bad.safetensors")


def test_a_sink_code_round_trips_and_its_bad_roles_are_named(tmp_path):
    """Format 1.3: the sink code's field and roles are written, read back and checked."""
    recipe = predictive_recipe(sink_bits=6.0)
    save_recipe(recipe, tmp_path / "r.safetensors")
    again = load_recipe(tmp_path / "r.safetensors")
    assert again.spec(1, "v").sink_token_bits == recipe.spec(1, "v").sink_token_bits
    assert json.loads(again.scheme.to_json())["layers"][0]["k"]["sink_token_bits"]  # written when set
    assert "sink_token_bits" not in json.loads(predictive_recipe().scheme.to_json())["layers"][0]["k"]
    cases = [("sink_bits", lambda r: r.tensors.__setitem__("layers.0.k.sink_bits", r.tensors["layers.0.k.sink_bits"] + 1),
              "sink_bits' sums to"),
             ("sink_unit", lambda r: r.tensors.__setitem__("layers.0.v.sink_unit", -r.tensors["layers.0.v.sink_unit"]),
              "sink_unit' must be finite float32 > 0"),
             ("no field", lambda r: setattr(r.scheme.layers[0].k, "sink_token_bits", None), "not used by its spec")]
    for _, spoil, says in cases:
        bad = predictive_recipe(sink_bits=6.0)
        spoil(bad)
        with pytest.raises(RecipeError, match=says):
            save_recipe(bad, tmp_path / "bad.safetensors")
        assert not (tmp_path / "bad.safetensors").exists()


def test_a_sink_hold_round_trips_and_needs_a_sink_code(tmp_path):
    """Format 1.4: `sink_hold` is written when set (left out when false), read back, and refused
    without a sink code; a layer with it on one tensor only has no fast path."""
    from calibrate.fastcache import fast_path_problem

    recipe = predictive_recipe(sink_bits=6.0, hold=True)
    save_recipe(recipe, tmp_path / "r.safetensors")
    again = load_recipe(tmp_path / "r.safetensors")
    assert again.spec(0, "k").sink_hold
    assert json.loads(again.scheme.to_json())["layers"][0]["v"]["sink_hold"] is True
    assert "sink_hold" not in json.loads(predictive_recipe(sink_bits=6.0).scheme.to_json())["layers"][0]["v"]
    bad = predictive_recipe(hold=True)  # no sink code
    with pytest.raises(RecipeError, match="sink_hold: holds the sink code's values, so it needs sink_token_bits"):
        save_recipe(bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    one = predictive_recipe(sink_bits=6.0, hold=True)
    one.scheme.layers[1].v.sink_hold = False
    assert fast_path_problem(one) == "layer 1: predictive K and V, one with a sink hold ('sink_hold') and one without"


def test_a_sink_refresh_round_trips_and_needs_a_sink_hold(tmp_path):
    """Format 1.5: `sink_refresh` and `refresh_token_bits` are written when set (left out at their
    defaults) and read back; refused without a sink hold, with one field but not the other, and with
    token bits that are not the sink widths of the uncoded components; one period per fast layer."""
    from calibrate.fastcache import fast_path_problem

    recipe = predictive_recipe(sink_bits=6.0, hold=True, refresh=8)
    save_recipe(recipe, tmp_path / "r.safetensors")
    again = load_recipe(tmp_path / "r.safetensors")
    assert again.spec(0, "k").sink_refresh == 8 and again.spec(0, "k").refresh_token_bits == recipe.spec(0, "k").refresh_token_bits
    layer = json.loads(again.scheme.to_json())["layers"][0]["v"]
    assert layer["sink_refresh"] == 8 and len(layer["refresh_token_bits"]) == H
    plain = json.loads(predictive_recipe(sink_bits=6.0, hold=True).scheme.to_json())["layers"][0]["v"]
    assert "sink_refresh" not in plain and "refresh_token_bits" not in plain
    cases = [(lambda s: setattr(s, "sink_hold", False), "sink_refresh: refreshes the sink hold's reference, so it needs sink_hold"),
             (lambda s: setattr(s, "refresh_token_bits", None), "sink_refresh: a refreshed reference"),
             (lambda s: setattr(s, "refresh_token_bits", [b + 1 for b in s.refresh_token_bits]), "the spec's refresh_token_bits says")]
    for change, message in cases:
        bad = predictive_recipe(sink_bits=6.0, hold=True, refresh=8)
        change(bad.scheme.layers[0].k)
        with pytest.raises(RecipeError, match=message):
            save_recipe(bad, tmp_path / "bad.safetensors")
        assert not (tmp_path / "bad.safetensors").exists()
    one = predictive_recipe(sink_bits=6.0, hold=True, refresh=8)
    one.scheme.layers[1].v.sink_refresh = 4
    assert fast_path_problem(one) == "layer 1: predictive K and V with different 'sink_refresh'"


def test_pre_rotary_recipe_needs_rotary_coordinates():
    recipe = predictive_recipe()
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=1)
    plain = Rope(torch.zeros(1, T, D // 2))
    with pytest.raises(ValueError, match="rotary coordinates"):
        cache.append(0, torch.randn(1, H, T, D), torch.randn(1, H, T, D), plain)
    runtime = FastKVCache.from_recipe(recipe, window=4, sink_frames=1)
    with pytest.raises(ValueError, match="rotary coordinates"):
        runtime.attend(0, *(torch.randn(1, H, T, D) for _ in range(3)), plain)


def test_attend_of_a_predictive_cache_is_attention_over_what_it_reads():
    recipe = predictive_recipe()
    ks, vs, ropes = sequence(12)
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=1)
    for f in range(12):
        q = torch.randn(2, H, T, D)
        out = cache.attend(0, q, ks[f], vs[f], ropes[f])
        k_all, v_all = cache.gather(0, ropes[f].apply(ks[f]), vs[f])
        ref = torch.softmax(q @ k_all.transpose(-1, -2) / D**0.5, -1) @ v_all
        assert torch.allclose(out, ref, atol=1e-5)


def test_a_predictive_recipe_refuses_another_window_than_it_was_fitted_for():
    recipe = predictive_recipe()
    recipe.metadata["memory"] = json.dumps({"window": 16, "sink_frames": 1})
    FastKVCache.from_recipe(recipe, window=16, sink_frames=1)
    with pytest.raises(ValueError, match="memory.window: its predictive codes were fitted for a window of 16"):
        FastKVCache.from_recipe(recipe, window=8, sink_frames=1)


@pytest.mark.parametrize("memory", [None, {}, {"window": 16}, {"sink_frames": 1}, {"bits_per_element": 2.5}])
def test_a_predictive_recipe_without_a_fitted_window_runs_under_any_window(memory):
    """FORMAT.md: without `memory` (or without its window or sink count) nothing is checked, and
    the codes stay valid under any window (states within the anchor range), in both runtimes."""

    recipe = predictive_recipe()
    recipe.metadata.pop("memory", None)
    if memory is not None:
        recipe.metadata["memory"] = json.dumps(memory)
    ks, vs, ropes = sequence(6)
    for window, sink in ((1, 0), (2, 1), (16, 1), (40, 3)):
        for make in (ReferenceCache.from_recipe, FastKVCache.from_recipe):
            cache = make(recipe, window=window, sink_frames=sink)
            for f in range(6):
                cache.append(0, ks[f], vs[f], ropes[f])
            assert cache.frame_indices(0) == kept_frames(6, window, sink)
            if isinstance(cache, ReferenceCache):
                for kind in "kv":
                    limits = [head_params(recipe.layer_tensors(0, kind), h).limit_D for h in range(H)]
                    for states in cache._chain_states(0, kind).values():
                        assert all((v.abs() <= lim).all() for v, lim in zip(states, limits))


def test_a_delta_frame_whose_reference_was_evicted_is_one_clear_error():
    recipe = predictive_recipe()
    ks, vs, ropes = sequence(8)
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=0)
    for f in range(8):
        cache.append(0, ks[f], vs[f], ropes[f])
        cache.read(0)
    oldest = cache.frame_indices(0)[0]
    second = cache.frame_indices(0)[1]
    del cache._frames[0][oldest]  # lose the anchor: frame `second` has no reference any more
    with pytest.raises(ValueError, match="previous frame's states"):
        cache.read(0)
    assert second in cache.frame_indices(0)


def test_the_mode_choice_never_codes_a_token_worse_than_intra_alone():
    """Coding against the previous frame is chosen per token only where it is no worse: the
    per-token error of the predictive code is bounded by the intra-only code's, exactly."""
    recipe = predictive_recipe()
    ks, _, _ = sequence(30, B=1)
    x = torch.stack(ks, dim=2)  # B H F T D
    for h in range(H):
        p = head_params(recipe.layer_tensors(0, "k"), h)
        v = None
        for f in range(30):
            tau = P.to_units(x[:, h, f], p)
            _, _, v = P.encode(x[:, h, f], p, v)
            _, v_intra = P.intra(tau, p)
            w = p.unit_D ** 2
            assert bool((((tau - v) ** 2 * w).sum(-1) <= ((tau - v_intra) ** 2 * w).sum(-1)).all())
