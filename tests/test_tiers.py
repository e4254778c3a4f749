"""The memory plan: its format, the tiered runtime (host tier, recall by pose) and its byte model."""

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from calibrate.cache import Rope, kept_frames
from calibrate.plan import MemoryPlan, pose_distance
from calibrate.quant.predictive import is_refresh_frame
from calibrate.recipe import (LayerSpec, Recipe, RecipeError, Scheme, TensorSpec, TokenPolicy, load_recipe,
                              save_recipe, uniform_scheme)
from calibrate.fastcache import FastKVCache
from calibrate.tiers import host_count, nearest, predicted_host_bytes, slot_nbytes, steady_device_bytes, tree_leaves
from calibrate.types import ModelInfo
from toys import predictive_roles, refresh_fields

L, H, T, D = 2, 2, 4, 16
INFO = ModelInfo("toy", L, H, D, T, "f" * 16)
REPO = Path(__file__).resolve().parents[1]


def pose_rope(poses_B3):
    """A rotary from a camera pose (x, y, yaw), the same function every time (as a model's)."""
    freqs = torch.linspace(0.2, 2.0, D // 2)
    angles = (poses_B3[:, None, 0:1] + 0.5 * poses_B3[:, None, 1:2]) * freqs \
        + poses_B3[:, None, 2:3] * torch.arange(1, T + 1)[None, :, None] * 0.3
    return Rope(angles, coords_BP=poses_B3, at=pose_rope)


def frames(poses_NB3, seed=0):
    """K/V of a slowly changing scene seen from `poses` [N, B, 3], with their ropes."""
    g = torch.Generator().manual_seed(seed)
    N, B = poses_NB3.shape[:2]
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    out = []
    for f in range(N):
        k = k + 0.05 * torch.randn(B, H, T, D, generator=g)
        v = v + 0.05 * torch.randn(B, H, T, D, generator=g)
        out.append((k.clone(), v.clone(), pose_rope(poses_NB3[f])))
    return out


def predictive_recipe(pre_rotary=True, temporal=True, hold=False, refresh=0):
    """A predictive recipe fitted to `frames`-like data (2 layers, 2 heads); `hold`: with a sink code
    and the sink hold (format 1.4), `refresh` > 0 its reference refreshed (format 1.5)."""
    data = frames(torch.zeros(60, 2, 3), seed=7)
    tensors, layers = {}, []
    for i in range(L):
        specs = {}
        for j, kind in enumerate(("k", "v")):
            x = torch.stack([f[j] for f in data], dim=2)  # B H F T D
            roles = predictive_roles(x, sink_bits=6.0 if hold else 0.0)
            tensors.update({f"layers.{i}.{kind}.{r}": t for r, t in roles.items()})
            specs[kind] = TensorSpec(bits=2, kind="predictive", rotation="learned", temporal=temporal,
                                     rotary_coords=3 if (kind == "k" and pre_rotary) else 0,
                                     token_bits=roles["channel_bits"].sum(-1).tolist(),
                                     anchor_token_bits=roles["anchor_bits"].sum(-1).tolist(),
                                     sink_token_bits=roles["sink_bits"].sum(-1).tolist() if hold else None, sink_hold=hold,
                                     **refresh_fields(roles, refresh))
        layers.append(LayerSpec(**specs))
    return Recipe(INFO, Scheme("toy-pred", layers, TokenPolicy(sink_frames=0)), tensors)


def per_frame_recipe(bits=2):
    spec = TensorSpec(bits=bits, axis="token") if bits < 16 else TensorSpec()
    return Recipe(INFO, uniform_scheme(f"toy-{bits}", L, spec, spec, TokenPolicy(sink_frames=1)), {})


def with_plan(recipe, **fields):
    plan = MemoryPlan(**{"device_budget_bytes": 10**9, **fields})
    return Recipe(recipe.model, replace(recipe.scheme, policy=replace(recipe.scheme.policy, plan=plan)),
                  recipe.tensors, recipe.metadata, recipe.path)


def run(cache, data, queries=None):
    """Append every frame to every layer (telling the cache the next pose first)."""
    for f, (k, v, rope) in enumerate(data):
        if queries is not None:
            cache.expect(queries[f])
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)


# ---- the recall rule ------------------------------------------------------------------------------
def test_nearest_picks_exactly_the_nearest_poses_newest_first_on_ties():
    # candidates newest first, two trajectories (rows) with different poses
    poses = torch.tensor([
        [[0.0, 0.0, 0.0], [5.0, 5.0, 0.0]],
        [[1.0, 0.0, 0.0], [5.0, 5.0, 2 * math.pi + 0.5]],  # yaw compares modulo 2 pi
        [[0.0, 0.0, 0.0], [4.0, 5.0, 0.0]],  # ties row 0's first candidate: the newer (index 0) goes first
        [[0.0, 3.0, 0.0], [5.0, 5.0, 0.4]],
        [[0.3, 0.0, 0.1], [9.0, 9.0, 0.0]],
    ])
    query = torch.tensor([[0.0, 0.0, 0.0], [5.0, 5.0, 0.5]])
    got = nearest(poses, query, yaw_radius=1.0, count=3)
    assert got[:, 0].tolist() == [0, 2, 4]  # distances 0, 0, sqrt(0.09 + 0.01)
    assert got[:, 1].tolist() == [1, 3, 0]  # distances 0, 0.1, 0.5
    d = pose_distance(poses, query, 2.0)
    assert d[4, 0].item() == pytest.approx(math.sqrt(0.3**2 + (2 * 0.1) ** 2))
    assert d[1, 1].item() == pytest.approx(0.0, abs=1e-6)


def test_pose_distance_is_the_correctly_rounded_root():
    """FORMAT.md: float64 with IEEE's sqrt (torch's CPU float64 sqrt is 1 ulp off on ~1% of inputs)."""
    g = torch.Generator().manual_seed(0)
    poses, query = torch.randn(2000, 2, 3, generator=g) * 10, torch.randn(2, 3, generator=g)
    d = pose_distance(poses, query, 0.7)
    p, q = poses.double(), query.double()
    dyaw = p[..., 2] - q[..., 2]
    dyaw = dyaw - 2 * math.pi * ((dyaw + math.pi) / (2 * math.pi)).floor()
    sq = (p[..., 0] - q[..., 0]).square() + (p[..., 1] - q[..., 1]).square() + (0.7 * dyaw).square()
    assert d.dtype == torch.float64 and d.flatten().tolist() == [math.sqrt(v) for v in sq.flatten().tolist()]


# ---- recall through the host tier -----------------------------------------------------------------
def reference_of(cache) -> int:
    """The frame whose uncoded components held tokens take now: the latest sink-refresh frame (0:
    the sink's, also without a refresh). A held frame decodes the same only under the same one."""
    period = cache.recipe.spec(0, "k").sink_refresh
    return max((i for i in range(cache.num_frames_seen) if is_refresh_frame(i, period, cache.sink_frames)), default=0)


def seen_values(cache, seen):
    """Record the post-rotary K/V of every frame each layer holds now, under the current reference."""
    reference = reference_of(cache)
    for layer in range(L):
        for f in cache.frame_indices(layer):
            seen[(layer, f, reference)] = cache.read(layer, [f])


def recalled(cache, layer):
    """Post-rotary K and V [B, H, slots * T, D] of the layer's filled recall slots, as attention reads them."""
    blocks = list(cache.stores[layer].recalled(cache._rope_fn(layer)))
    return torch.cat([k for k, _, _ in blocks], 2), torch.cat([v for _, v, _ in blocks], 2)


def assert_slots_hold(cache, seen, layer) -> int:
    """Each filled slot holds its host frame's very bytes and decodes to what that frame decoded to
    on the device under the same reference (the same states, another path: anchors or standalone
    codes instead of the chain); returns how many slots' values it compared."""
    store, assign, compared, reference = cache.stores[layer], cache.tiers._assign, 0, reference_of(cache)
    if not assign:
        return 0
    k, v = recalled(cache, layer)
    for s, rows in enumerate(assign):
        views = store.slot_views(s)
        for b, f in enumerate(rows):
            host = cache.tiers.host.frames[layer][f]
            for name in views:
                for mine, held in zip(tree_leaves(views[name]), tree_leaves(host[name]), strict=True):
                    assert torch.equal(mine[b], held[b]), (layer, s, b, name)
            if (layer, f, reference) in seen:
                k_f, v_f = seen[(layer, f, reference)]
                torch.testing.assert_close(k[b, :, s * T:(s + 1) * T], k_f[b])
                torch.testing.assert_close(v[b, :, s * T:(s + 1) * T], v_f[b])
                compared += 1
    return compared


@pytest.mark.parametrize("make", [lambda: predictive_recipe(), lambda: predictive_recipe(pre_rotary=False),
                                  lambda: predictive_recipe(temporal=False), lambda: predictive_recipe(hold=True),
                                  lambda: per_frame_recipe(2)])
def test_recall_places_the_nearest_host_frames_in_the_slots_exactly(make):
    """Hand-made poses: frame f of row 0 stands at x = f, of row 1 at x = -f; the query asks for
    x = 2.2 (row 0) and x = -5.9 (row 1): the slots must hold frames {2, 3} and {6, 5}, byte for
    byte as the host holds them, decoding to what each decoded to in the window (frames 2, 3, 5
    and 6 left it as delta frames of a chain: they travel as the anchors of their states)."""
    N = 10
    xs = torch.arange(N, dtype=torch.float32)
    poses = torch.stack([torch.stack([xs, torch.zeros(N), torch.zeros(N)], -1),
                         torch.stack([-xs, torch.zeros(N), torch.zeros(N)], -1)], dim=1)  # [N, 2, 3]
    cache = FastKVCache.from_recipe(with_plan(make(), window=2, sink_frames=1, recall_slots=2, host_frames=16))
    seen = {}
    for f, (k, v, rope) in enumerate(frames(poses)):
        if f == N - 1:
            cache.expect(torch.tensor([[2.2, 0.0, 0.0], [-5.9, 0.0, 0.0]]))
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)
        seen_values(cache, seen)
    assert cache.tiers.host.indices() == list(range(1, N - 2))  # frame 0 is the sink, frames 8, 9 the window
    assert [set(rows) for rows in zip(*cache.tiers._assign)] == [{2, 3}, {6, 5}]
    assert all(assert_slots_hold(cache, seen, layer) == 4 for layer in range(L))  # 2 slots x 2 rows


def test_without_expect_recall_uses_the_newest_key_pose():
    N = 8
    poses = torch.stack([torch.tensor([[float(f), 0.0, 0.0]]) for f in range(N)])  # [N, 1, 3]
    poses[N - 1] = torch.tensor([[1.0, 0.0, 0.0]])  # the frame being continued stands where frame 1 stood
    recipe = with_plan(predictive_recipe(), window=2, sink_frames=0, recall_slots=1, host_frames=16)
    cache = FastKVCache.from_recipe(recipe)
    run(cache, frames(poses))
    assert cache.tiers._assign == [[1]]


# ---- bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,reuse", [(lambda: predictive_recipe(), "resident"),
                                        (lambda: predictive_recipe(pre_rotary=False), "none"),
                                        (lambda: predictive_recipe(hold=True), "resident"),
                                        (lambda: predictive_recipe(hold=True, refresh=4), "resident"),
                                        (lambda: per_frame_recipe(2), "resident"),
                                        (lambda: per_frame_recipe(16), "none")])
def test_measured_device_and_host_bytes_equal_predicted(make, reuse):
    N, B = 40, 2
    g = torch.Generator().manual_seed(3)
    poses = torch.cumsum(0.3 * torch.randn(N, B, 3, generator=g), dim=0)
    recipe = make()
    plan_recipe = with_plan(recipe, window=4, sink_frames=1, recall_slots=3, host_frames=9, reuse=reuse)
    plan = plan_recipe.scheme.policy.plan
    cache = FastKVCache.from_recipe(plan_recipe)
    for f, (k, v, rope) in enumerate(frames(poses)):
        cache.expect(poses[min(f + 1, N - 1)])
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)
        n = cache.num_frames_seen
        assert cache.nbytes() == cache.predicted_nbytes(n, B), f
        assert cache.tiers.host.nbytes() == predicted_host_bytes(recipe.model, plan_recipe.scheme, plan, n, B), f
    steady = steady_device_bytes(recipe.model, plan_recipe.scheme, plan)
    assert cache.predicted_nbytes(N, 1) <= steady and cache.nbytes() == cache.predicted_nbytes(N, B)
    traffic, frame = cache.tiers.traffic(), slot_nbytes(recipe.model, plan_recipe.scheme, B)
    assert traffic["device_to_host_bytes"] == (N - len(kept_frames(N, 4, 1))) * frame  # every eviction
    assert cache.tiers.host.indices() == list(range(N - 4 - 9, N - 4))
    if reuse == "none":  # every filled slot is copied at every step
        copied = sum(min(3, host_count(plan, n)) for n in range(1, N + 1))
        assert traffic["host_to_device_bytes"] == copied * frame


def test_resident_slots_move_only_new_frames():
    """A camera standing still keeps wanting the same frames: after the slots fill, nothing moves."""
    N = 20
    poses = torch.full((N, 1, 3), 10.0)
    poses[:8, 0, 0] = torch.arange(8, dtype=torch.float32)
    poses[:, 0, 1:] = 0.0
    recipe = with_plan(predictive_recipe(), window=3, sink_frames=0, recall_slots=2, host_frames=64)
    cache = FastKVCache.from_recipe(recipe)
    moved = []
    for f, (k, v, rope) in enumerate(frames(poses)):
        cache.expect(torch.tensor([[1.0, 0.0, 0.0]]))
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)
        moved.append(cache.tiers.bytes_to_device)
    # nearest x = 1: frame 1, then frames 0 and 2 (a tie: the newer, 2); frame 2 reaches the host
    # at the 6th append, and from then on the slots keep frames 1 and 2: nothing moves
    slot = slot_nbytes(recipe.model, recipe.scheme)
    assert moved[3] == slot and moved[4] == 2 * slot and moved[5] == moved[-1] == 3 * slot


def test_host_tier_changes_nothing_without_recall():
    """A plan with a host tier and no recall slots attends exactly as the plain cache of its window."""
    N = 16
    poses = torch.cumsum(0.2 * torch.ones(N, 2, 3), dim=0)
    recipe = predictive_recipe()
    plain = FastKVCache.from_recipe(recipe, window=4, sink_frames=0)
    tiered = FastKVCache.from_recipe(with_plan(recipe, window=4, sink_frames=0, host_frames=8))
    for k, v, rope in frames(poses):
        for layer in range(L):
            q = torch.randn_like(k)
            assert torch.equal(plain.attend(layer, q, k, v, rope), tiered.attend(layer, q, k, v, rope))


# ---- attention over the window and the slots --------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: predictive_recipe(), lambda: predictive_recipe(pre_rotary=False),
                                  lambda: predictive_recipe(temporal=False), lambda: predictive_recipe(hold=True),
                                  lambda: predictive_recipe(temporal=False, hold=True),
                                  lambda: predictive_recipe(hold=True, refresh=4), lambda: per_frame_recipe(2),
                                  lambda: per_frame_recipe(16)])
@pytest.mark.parametrize("reuse", ["resident", "none"])
def test_a_plan_attends_to_its_window_its_slots_and_the_fresh_frame(make, reuse):
    """Every step's output is softmax attention over the window's frames as the cache reads them,
    the recalled slots and the fresh frame (each decoded on its own path); the slots hold their
    host frames' very bytes and decode to what their frames decoded to in the window under the same
    sink-refresh reference."""
    N, B = 30, 2
    g = torch.Generator().manual_seed(5)
    poses = torch.cumsum(0.3 * torch.randn(N, B, 3, generator=g), dim=0)
    recipe = with_plan(make(), window=4, sink_frames=1, recall_slots=3, host_frames=9, reuse=reuse)
    cache, seen, compared = FastKVCache.from_recipe(recipe), {}, 0
    for f, (k, v, rope) in enumerate(frames(poses)):
        cache.expect(poses[min(f + 1, N - 1)])
        for layer in range(L):
            q = torch.randn(k.shape, generator=g)
            out = cache.attend(layer, q, k, v, rope)
            k_all, v_all = cache.gather(layer, rope.apply(k), v)
            if cache.tiers.filled:
                k_slots, v_slots = recalled(cache, layer)
                k_all, v_all = torch.cat([k_all, k_slots], 2), torch.cat([v_all, v_slots], 2)
            want = torch.softmax(q @ k_all.transpose(-1, -2) / D**0.5, -1) @ v_all
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        compared += sum(assert_slots_hold(cache, seen, layer) for layer in range(L))
        seen_values(cache, seen)
    assert cache.tiers.traffic()["host_to_device_bytes"] > 0 and compared > 0


# ---- the plan in the recipe -----------------------------------------------------------------------
def test_plan_round_trips_and_is_left_out_when_absent(tmp_path):
    recipe = predictive_recipe()
    assert "plan" not in json.loads(recipe.scheme.to_json())["policy"]
    planned = with_plan(recipe, window=8, sink_frames=1, recall_slots=8, host_frames=512, yaw_radius=0.5)
    save_recipe(planned, tmp_path / "p.safetensors")
    back = load_recipe(tmp_path / "p.safetensors")
    assert back.scheme.policy.plan == planned.scheme.policy.plan
    assert (tmp_path / "p.safetensors").read_bytes() == _resaved(back, tmp_path)


def _resaved(recipe, tmp_path):
    save_recipe(recipe, tmp_path / "again.safetensors")
    return (tmp_path / "again.safetensors").read_bytes()


@pytest.mark.parametrize("fields,message", [
    ({"window": 0}, "plan.window"),
    ({"recall_slots": 2, "host_frames": 0}, "host_frames=0"),
    ({"recall_slots": 2, "host_frames": 4, "recall": "none"}, "recall 'pose'"),
    ({"recall": "mean_key"}, "plan.recall"),
    ({"reuse": "sometimes"}, "plan.reuse"),
    ({"yaw_radius": -1.0}, "plan.yaw_radius"),
    ({"device_budget_bytes": 0}, "device_budget_bytes"),
    ({"host_frames": 2.5}, "host_frames"),
])
def test_bad_plans_are_refused_naming_the_field(fields, message, tmp_path):
    with pytest.raises(RecipeError, match=message):
        save_recipe(with_plan(predictive_recipe(), **fields), tmp_path / "bad.safetensors")


def test_an_older_reader_rejects_a_plan_clearly():
    """A reader of a minor version without plans knows no policy field `plan`: it must refuse the
    recipe (unknown policy fields are errors), never run it with its own window."""
    from calibrate.recipe_schema import FieldError, POLICY_FIELDS, parse_object

    d = json.loads(with_plan(predictive_recipe(), window=8).scheme.to_json())
    # a reader from before plans holds `policy` to its table, which has no `plan`
    with pytest.raises(FieldError, match=r"unknown field\(s\) \['plan'\]"):
        parse_object(d["policy"], POLICY_FIELDS, "scheme.policy")
    with pytest.raises(RecipeError, match="unknown field"):
        Scheme.from_dict({**d, "policy": {**d["policy"], "plan": {**d["policy"]["plan"], "prefetch": 2}}})


def test_a_plan_over_its_budget_is_refused_at_load(tmp_path):
    recipe = predictive_recipe()
    plan_recipe = with_plan(recipe, window=8, sink_frames=1, recall_slots=4, host_frames=64)
    need = steady_device_bytes(recipe.model, plan_recipe.scheme, plan_recipe.scheme.policy.plan)
    ok = with_plan(recipe, window=8, sink_frames=1, recall_slots=4, host_frames=64, device_budget_bytes=need)
    FastKVCache.from_recipe(ok)
    tight = with_plan(recipe, window=8, sink_frames=1, recall_slots=4, host_frames=64, device_budget_bytes=need - 1)
    save_recipe(tight, tmp_path / "tight.safetensors")  # the format is fine; the budget is the runtime's check
    with pytest.raises(ValueError, match=f"needs {need} bytes .* above its device_budget_bytes={need - 1}"):
        FastKVCache.from_recipe(load_recipe(tmp_path / "tight.safetensors"))


@pytest.mark.parametrize("policy,spec,message", [
    ({"keyframe_interval": 4}, None, "key frames"),
    ({"recent_frames": 4}, None, "recent_frames=4 must be below plan.window=4"),
    ({}, TensorSpec(bits=2, kind="prq", prq_stages=1, prq_centroids=2), "kind 'prq' with span state"),
])
def test_host_tier_limits_are_checked_when_the_cache_is_built_not_at_load(policy, spec, message, tmp_path):
    """FORMAT.md "Memory plan": the file is valid (the writer, the loader and the numpy reader take
    it); the runtime refuses its plan with one line naming the field when it builds the cache."""
    import importlib.util

    recipe = per_frame_recipe()
    if spec is not None:
        recipe = Recipe(INFO, uniform_scheme("toy-prq", L, spec, spec, TokenPolicy(sink_frames=1)), {})
    recipe = Recipe(INFO, replace(recipe.scheme, policy=replace(recipe.scheme.policy, **policy)), {})
    save_recipe(with_plan(recipe, window=4, sink_frames=1, host_frames=8), tmp_path / "p.safetensors")
    loaded = load_recipe(tmp_path / "p.safetensors", model=INFO)
    module = importlib.util.spec_from_file_location("kv_recipe_reader_tiers", REPO / "recipes" / "reader.py")
    reader = importlib.util.module_from_spec(module)
    module.loader.exec_module(reader)
    assert reader.plan_of(reader.read_recipe(tmp_path / "p.safetensors")[0])["host_frames"] == 8
    with pytest.raises(ValueError, match=re.escape(message)):
        FastKVCache.from_recipe(loaded)


def test_recall_by_pose_needs_a_pose():
    cache = FastKVCache.from_recipe(with_plan(predictive_recipe(pre_rotary=False), window=2, recall_slots=1,
                                                   host_frames=4))
    k = torch.randn(1, H, T, D)
    chunk_index = Rope(torch.zeros(1, T, D // 2), coords_BP=torch.zeros(1, 1), at=None)
    with pytest.raises(ValueError, match=r"recall='pose'.*gives 1 \(not a camera pose\)"):
        cache.attend(0, k, k, k, chunk_index)


def _is_progress(part: str) -> bool:
    """A progress bar's update (tqdm: '<desc>: n/N [...]' or its cursor-up code)."""
    return part.strip("\x1b[A ") == "" or bool(re.search(r"\d+/\d+ \[[^\]]*\]", part))


def test_cli_a_pose_plan_on_a_model_without_pose_is_one_line_exit_2(tmp_path):
    pytest.importorskip("diffusers")
    from calibrate.adapters import wan_diffusers as wan
    from calibrate.adapters.wan_diffusers import WanSettings

    info = wan.load(None, WanSettings(), torch.device("cpu")).info
    spec = TensorSpec(bits=4, axis="token")
    recipe = Recipe(info, uniform_scheme("wan-plan", info.num_layers, spec, spec, TokenPolicy(sink_frames=1)), {})
    recipe = with_plan(recipe, window=2, sink_frames=1, recall_slots=1, host_frames=8)
    save_recipe(recipe, tmp_path / "plan.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    run_ = subprocess.run([sys.executable, "-m", "calibrate", "task=evaluate", "model=wan_diffusers",
                           f"recipe={tmp_path / 'plan.safetensors'}", "trajectories.num_trajectories=1",
                           "trajectories.num_frames=8", "model.wan.denoise_timesteps=[1000]", "eval.strips=false",
                           "eval.attention=false", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    # the error comes at the model's first step, after the progress bar started (as for keys stored
    # before the rotation): the bar's own \r-separated updates aside, stderr says one thing
    lines = [part.strip() for line in run_.stderr.splitlines() for part in line.split("\r")]
    lines = [part[part.index("error:"):] if "error:" in part else part for part in lines
             if part and ("error:" in part or not _is_progress(part))]
    assert run_.returncode == 2, run_.stderr[-2000:]
    assert len(lines) == 1 and "recall='pose'" in lines[0] and "camera pose" in lines[0], run_.stderr


def test_evaluating_a_plan_with_attention_metrics_leaves_them_out_and_counts_its_own_frames(tiny_world):
    """A plan's cache holds other frames than the float reference (its window, recalled slots):
    evaluation must not compare their attention (it used to crash), and its fp16 bytes are those
    of the device tier's frames, so bits per element stay bits per stored element."""
    from calibrate.adapters import TinyWorldAdapter
    from calibrate.evaluate.run import evaluate
    from calibrate.schemes import build_baseline
    from calibrate.world.trajectories import make_trajectories

    world = TinyWorldAdapter(tiny_world)
    recipe = build_baseline("fp16", world.info)
    plan = with_plan(recipe, window=2, sink_frames=1, recall_slots=2, host_frames=8)
    trajs = make_trajectories(["orbit"], "evaluation", 1, 12)
    runs = evaluate(world, {"plain": recipe, "plan": plan}, trajs, 4, 1, torch.device("cpu"), attention=True)
    assert runs["plain"].attention and not runs["plan"].attention
    mem = runs["plan"].memory
    assert mem["bytes"] == mem["predicted_bytes"]
    assert mem["fp16_bytes"] == mem["bytes"]  # fp16 recipe: stored == float16 bytes of the same frames


@pytest.mark.parametrize("fields, message", [
    ({"device_budget": "lots"}, "not a byte count"),
    ({"schemes": ["fitted", "nonsense"]}, r"memory.schemes \['nonsense'\] unknown"),
    ({"search_frames": 10}, "leaves no return"),
])
def test_plan_search_settings_are_refused_before_any_replay(fields, message):
    from calibrate.config import MemoryConfig

    with pytest.raises(ValueError, match=message):
        MemoryConfig(**fields).check()
    MemoryConfig(device_budget="816KiB").check()
