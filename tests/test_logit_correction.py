"""Key-noise logit correction: the formula by hand, the runtime applying it to exactly the frames
held at the spec's own bits, the objective modelling the runtime, and its effect on a recorded
rollout of the shipped TinyWorld (attention KL down at 2 bits, no effect at 8 bits)."""

from dataclasses import replace

import pytest
import torch

import calibrate
from calibrate.adapters import as_world
from calibrate.cache import Rope, softmax_attention
from calibrate.codec import fake_quant_heads
from calibrate.fit.logit_correction import key_error_variance, logit_shift
from calibrate.fit.objective import LayerTrace, attention_outputs
from calibrate.trace import plan_trace
from calibrate.quant.logit_noise import key_noise_variance, logit_inflation
from calibrate.recipe import ModelInfo, Recipe, TensorSpec, TokenPolicy, uniform_scheme, validate
from calibrate.replay import Recorder, record, rollout_batch
from reference_runtime import ReferenceCache
from calibrate.schemes import build_baseline
from calibrate.shadow import ShadowCache
from calibrate.world.trajectories import make_trajectories

from toys import TINY_WORLD, tiny_fit_config


# ---- the formula ---------------------------------------------------------------------------------
def test_inflation_by_hand():
    q = torch.tensor([1.0, 2.0, 0.0, -1.0]).reshape(1, 1, 1, 4)
    var = torch.tensor([[0.5, 0.25, 1.0, 2.0]])
    # sum_c q_c^2 var_c / (2 D) = (1*0.5 + 4*0.25 + 0 + 1*2) / 8
    assert logit_inflation(q, var).item() == pytest.approx(3.5 / 8)
    # with a rotation the query is taken to the code basis first: q @ R swaps channels 0 and 1
    R = torch.eye(4)[[1, 0, 2, 3]].unsqueeze(0)
    assert logit_inflation(q, var, R).item() == pytest.approx((4 * 0.5 + 1 * 0.25 + 0 + 1 * 2.0) / 8)


def test_noise_variance_by_hand_is_centered_and_in_the_code_basis():
    k = torch.zeros(2, 2)
    k_hat = torch.tensor([[1.0, 0.0], [-1.0, 2.0]])  # channel errors (1, -1) and (0, 2)
    assert key_noise_variance(k, k_hat).tolist() == [1.0, 1.0]  # the mean error 1 of channel 1 is not noise
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert key_noise_variance(k, k_hat + torch.tensor([0.0, 3.0]), swap).tolist() == [1.0, 1.0]


# ---- the runtime ------------------------------------------------------------------------------
H, D, T, B = 2, 16, 4, 2
INFO = ModelInfo("toy", num_layers=1, num_kv_heads=H, head_dim=D, tokens_per_frame=T, fingerprint="toy")
K_SPEC = TensorSpec(bits=2, head_bits=[2, 4], group_size=8)


def corrected_recipe(policy: TokenPolicy, var_HD: torch.Tensor | None, k_spec: TensorSpec = K_SPEC,
                     rotation: torch.Tensor | None = None) -> Recipe:
    tensors = {} if var_HD is None else {"layers.0.k.logit_bias": var_HD}
    if rotation is not None:
        tensors["layers.0.k.rotation"] = rotation
    recipe = Recipe(INFO, uniform_scheme("toy", 1, k_spec, TensorSpec(bits=4, group_size=8), policy), tensors)
    validate(recipe, "toy")
    return recipe


def toy_frames(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, T, D, generator=g) * 2, torch.randn(B, H, T, D, generator=g),
             torch.randn(B, H, T, D, generator=g), Rope(torch.randn(B, T, D // 2, generator=g))) for _ in range(n)]


POLICY = TokenPolicy(sink_frames=1, sink_bits=8, recent_frames=2, recent_bits=16, keyframe_interval=3, keyframe_bits=4)


def test_runtime_subtracts_the_inflation_from_frames_at_the_heads_own_bits_only():
    var = torch.rand(H, D, generator=torch.Generator().manual_seed(1))
    cache = ReferenceCache.from_recipe(corrected_recipe(POLICY, var), window=100, sink_frames=1)
    plain = ReferenceCache.from_recipe(corrected_recipe(POLICY, None), window=100, sink_frames=1)
    for n, (q, k, v, rope) in enumerate(toy_frames(8), start=1):
        out = cache.attend(0, q, k, v, rope)
        plain.attend(0, q, k, v, rope)
        history = cache.history(0)
        bias = cache.logit_bias(0, q)
        c = logit_inflation(q, var)  # [B, H, T]
        for h in range(H):
            for pos, f in enumerate(history + [n - 1]):
                # frame 0: sink (8 bits); every 3rd: key frame (4 bits); the newest two: recent (fp16);
                # the newest frame: its own fresh K. Head 0 holds the rest at 2 bits, head 1 at 4 bits.
                own_bits = (2, 4)[h]
                if f == n - 1 or f == n - 2:
                    held = None
                else:
                    held = 8 if f == 0 else 4 if f % 3 == 0 else own_bits
                want = -c[:, h] if held == own_bits else torch.zeros_like(c[:, h])
                got = bias[:, h, :, pos * T : (pos + 1) * T]
                torch.testing.assert_close(got, want.unsqueeze(-1).expand_as(got), atol=1e-6, rtol=0)
        k_all, v_all = plain.gather(0, rope.apply(k), v)
        torch.testing.assert_close(out, softmax_attention(q, k_all, v_all, bias), atol=1e-6, rtol=0)
        assert cache.nbytes() == plain.nbytes()  # no per-frame bytes


def test_objective_models_the_runtime_correction_and_key_frames():
    """objective.attention_outputs (the fitter's teacher-forced replay) == the runtime's outputs."""
    policy = TokenPolicy(sink_frames=1, sink_bits=8, keyframe_interval=3, keyframe_bits=4)
    R = torch.linalg.qr(torch.randn(H, D, D, generator=torch.Generator().manual_seed(3)))[0]
    k_spec = TensorSpec(bits=2, head_bits=[2, 4], group_size=8, rotation="learned")
    var = torch.rand(H, D, generator=torch.Generator().manual_seed(2))
    recipe = corrected_recipe(policy, var, k_spec, rotation=R)
    window, sink, F = 4, 1, 9
    cache = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    frames = toy_frames(F, seed=5)
    outs = [cache.attend(0, q, k, v, rope) for q, k, v, rope in frames]
    q = torch.stack([f[0] for f in frames], dim=2)
    k = torch.stack([f[3].apply(f[1]) for f in frames], dim=2)
    v = torch.stack([f[2] for f in frames], dim=2)
    trace = LayerTrace(q, k, v, window=window, sink_frames=sink)
    kt = {"rotation": R}

    def hats(k_bits, v_bits):
        return (fake_quant_heads(k, k_spec, kt, k_bits), fake_quant_heads(v, recipe.scheme.layers[0].v, {}, v_bits))

    classes = dict(sink=(1, *hats([8, 8], [8, 8])), keyframe=(3, *hats([4, 4], [4, 4])))
    shift = logit_shift(q, var, R, [2, 4], {"sink": 8, "keyframe": 4})
    # head 1 holds its own frames at 4 bits, like the key frames: those are corrected too
    assert shift["keyframe"][:, 0].abs().sum() == 0 and torch.equal(shift["keyframe"][:, 1], shift["other"][:, 1])
    got = attention_outputs(trace, *hats([2, 4], [4, 4]), **classes, shift=shift)
    torch.testing.assert_close(got, torch.stack(outs, dim=2), atol=1e-5, rtol=1e-5)
    # and the correction matters at this noise level: without it the two disagree
    assert not torch.allclose(attention_outputs(trace, *hats([2, 4], [4, 4]), **classes), got, atol=1e-3)


# ---- on a recorded rollout of the shipped TinyWorld ---------------------------------------------
@pytest.fixture(scope="module")
def world():
    model = calibrate.load_model("tinyworld")
    info = as_world(model).info
    rec = Recorder.create(info, 256, plan_trace(info, 2, 24, 512, 1 << 30), 0)
    record(as_world(model), make_trajectories(["orbit", "stress"], "calibration", 2, 24), rec, 16, 1, torch.device("cpu"))
    return model, info, rec.traces[0]


def with_correction(recipe: Recipe, trace, bits: int) -> tuple[Recipe, Recipe]:
    """(the recipe with every tensor at `bits`, the same + logit_bias measured on `trace` at full strength)."""
    layers = [replace(l, k=replace(l.k, bits=bits), v=replace(l.v, bits=bits)) for l in recipe.scheme.layers]
    plain = Recipe(recipe.model, replace(recipe.scheme, layers=layers), dict(recipe.tensors))
    tensors = dict(plain.tensors)
    for layer, pair in enumerate(layers):
        k = trace.layer(layer, 16, 1).k
        roles = {r.split(".")[-1]: t for r, t in plain.tensors.items() if r.startswith(f"layers.{layer}.k.")}
        k_hat = fake_quant_heads(k, pair.k, roles, [bits] * recipe.model.num_kv_heads)
        tensors[f"layers.{layer}.k.logit_bias"] = key_error_variance(k, k_hat, roles.get("rotation"))
    corrected = Recipe(plain.model, plain.scheme, tensors)
    validate(corrected, "corrected")
    return plain, corrected


def shadow_rollout(model, recipes: dict[str, Recipe], free_rollouts: bool = False):
    """Teacher-forced attention errors of each recipe on an fp rollout, and (if asked) each
    recipe's own free rollout."""
    trajs = make_trajectories(["orbit", "stress"], "evaluation", 2, 32)
    shadows = {n: ReferenceCache.from_recipe(r, 16, 1) for n, r in recipes.items()}
    shadow = ShadowCache(as_world(model).info.num_layers, 16, 1, shadows)
    rollout_batch(as_world(model), trajs, shadow, torch.device("cpu"))
    frames = {n: rollout_batch(as_world(model), trajs, ReferenceCache.from_recipe(r, 16, 1), torch.device("cpu"))[0]
              for n, r in recipes.items()} if free_rollouts else {}
    return shadow.errors, frames


def test_correction_reduces_attention_kl_at_two_bits(world):
    """quarot2 (Hadamard + per-token 2-bit): unbiased key noise, so quantized history steals attention
    from the fresh frame as the argument predicts, and removing the expected inflation lowers the
    KL of the attention rows to the fp ones."""
    model, info, trace = world
    plain, corrected = with_correction(build_baseline("quarot2", info), trace, 2)
    errors, _ = shadow_rollout(model, {"plain": plain, "corrected": corrected})
    kl_plain, kl_corr = errors["plain"].kl(), errors["corrected"].kl()
    assert sum(kl_corr) < 0.95 * sum(kl_plain), (kl_plain, kl_corr)


def test_correction_has_no_effect_at_eight_bits(world):
    model, info, trace = world
    plain, corrected = with_correction(build_baseline("quarot2", info), trace, 8)
    assert max(t.max().item() for n, t in corrected.tensors.items() if n.endswith("logit_bias")) < 1e-3
    errors, frames = shadow_rollout(model, {"plain": plain, "corrected": corrected}, free_rollouts=True)
    assert (frames["plain"] - frames["corrected"]).abs().max().item() < 1e-3
    for a, b in zip(errors["plain"].kl(), errors["corrected"].kl()):
        assert abs(a - b) < 1e-4


# ---- the fitter ---------------------------------------------------------------------------------
def test_fitter_keeps_the_correction_only_where_it_lowers_the_objective(tmp_path, tiny_world):
    from calibrate import calibration
    from calibrate.fit.logit_correction import ALPHAS
    from calibrate.recipe import load_recipe, save_recipe

    model = tiny_world
    off, off_record = calibration.fit(tiny_fit_config(code="scalar", logit_correction=False), model, torch.device("cpu"))
    recipe, record = calibration.fit(tiny_fit_config(code="scalar", logit_correction=True), model, torch.device("cpu"))
    assert off_record["logit_correction"] == [] and not [n for n in off.tensors if n.endswith("logit_bias")]
    assert len(record["logit_correction"]) == TINY_WORLD.num_layers
    for entry in record["logit_correction"]:
        assert set(entry["objective"]) == {str(a) for a in ALPHAS} and all(a in ALPHAS for a in entry["alpha"])
        assert len(set(entry["objective"].values())) > 1  # the objective models the correction
        assert entry["chosen_objective"] <= entry["objective"]["0.0"] + 1e-9
        bias = recipe.tensor(entry["layer"], "k", "logit_bias")
        assert (bias is not None) == any(a > 0 for a in entry["alpha"])
        if bias is not None:  # alpha_h * sigma_h^2: a head with alpha 0 holds zeros
            assert all((bias[h] == 0).all() == (a == 0) for h, a in enumerate(entry["alpha"]))
    save_recipe(recipe, tmp_path / "r.safetensors")
    loaded = load_recipe(tmp_path / "r.safetensors", as_world(model).info)
    assert {n for n in loaded.tensors if n.endswith("logit_bias")} == {n for n in recipe.tensors if n.endswith("logit_bias")}


def test_byte_accounting_counts_the_correction_as_static_bytes():
    from calibrate.memory import memory_section

    info = ModelInfo("toy", num_layers=2, num_kv_heads=H, head_dim=D, tokens_per_frame=T, fingerprint="toy")
    plain = build_baseline("quarot2", info)
    corrected = Recipe(info, plain.scheme, {**plain.tensors, **{f"layers.{i}.k.logit_bias": torch.ones(H, D) for i in range(2)}})
    validate(corrected, "corrected")
    before, after = memory_section(plain, 16, 1), memory_section(corrected, 16, 1)
    assert after["static_bytes"] - before["static_bytes"] == 2 * H * D * 4  # float32 [H, D] per layer
    assert after["bytes_per_frame_steady"] == before["bytes_per_frame_steady"]
    assert after["bits_per_element"] == before["bits_per_element"]
