"""The Jensen-bias correction (quant/jensen.py, codec.key_steps, the runtime's logit bias): the
research spec's vectors J1-J4, its equality with the key-noise correction at sigma^2 = Delta^2/12,
and that the runtime reads each key's own stored steps."""

import pytest
import torch

from calibrate.codec import HeadParams, encode, key_steps
from calibrate.quant.jensen import jensen_bias, jensen_bias_exact
from calibrate.quant.logit_noise import logit_inflation
from calibrate.recipe import RecipeError, TensorSpec, TokenPolicy
from reference_runtime import ReferenceCache

from toys import B, D, H, T, kv_frames, toy_recipe


def _one(q_D, step):
    """c for one query over one key whose every channel has step `step` (D = q's length)."""
    q = torch.as_tensor(q_D, dtype=torch.float32).reshape(1, 1, 1, -1)
    s = torch.full_like(q, step)
    return float(jensen_bias(q, s)), float(jensen_bias_exact(q, s))


def test_j1_query_norm_form():
    # D = 64, q = [4, -2, 1, 0, ...] (|q|^2 = 21), Delta = 0.5: Taylor 21 * 0.25 / (24 * 64).
    # Exact, by the series log(sinh a / a) = a^2/6 - a^4/180 + 2 a^6/2835 with a = q Delta / 16:
    # a = 0.125 -> 0.0026028131, 0.0625 -> 0.0006509569, 0.03125 -> 0.0001627551; sum 0.0034165251
    q = torch.zeros(64)
    q[:3] = torch.tensor([4.0, -2.0, 1.0])
    taylor, exact = _one(q, 0.5)
    assert abs(taylor - 0.00341796875) < 1e-9 and abs(exact - 0.0034165251) < 1e-8


# q = ones(64): a = Delta / 16 in every channel; exact = 64 (a^2/6 - a^4/180 + 2 a^6/2835). (The
# research spec's 0.0416582 / 0.1665769 were computed in float32 and are ~3e-6 low.)
@pytest.mark.parametrize("step,taylor,exact", [(1.0, 1 / 24, 0.04166124), (2.0, 1 / 6, 0.16658004)])
def test_j2_taylor_against_exact(step, taylor, exact):
    t, e = _one(torch.ones(64), step)
    assert abs(t - taylor) < 1e-7 and abs(e - exact) < 2e-7


def test_monte_carlo_expectation():
    # log E[exp(q.e / sqrt(D))] over uniform rounding noise e in [-Delta/2, Delta/2]^D is the exact form
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, generator=g) * 2
    eps = (torch.rand(200_000, 64, generator=g, dtype=torch.float64) - 0.5) * 1.0
    mc = float(torch.log(torch.exp(eps @ q.double() / 8).mean()))
    _, exact = _one(q, 1.0)
    assert abs(mc - exact) < 0.02 * exact


def test_j3_equals_the_key_noise_correction_at_uniform_variance():
    # the project's correction sum (q R)^2 sigma^2 / (2 D) with sigma^2 = Delta^2 / 12 and alpha = 1
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 16, generator=g)
    step_HD = torch.rand(3, 16, generator=g) + 0.1
    R = torch.linalg.qr(torch.randn(3, 16, 16, generator=g))[0]
    steps = step_HD[None, :, None, :].expand(2, 3, 7, 16)
    got = jensen_bias(q, steps, R)
    want = logit_inflation(q, step_HD.pow(2) / 12, R)
    torch.testing.assert_close(got, want.unsqueeze(-1).expand_as(got), rtol=1e-5, atol=1e-7)


def test_key_steps_of_each_uniform_layout():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, generator=g)
    token = TensorSpec(bits=2, group_size=4)
    stored = encode(x, token, HeadParams(bits=2))
    got = key_steps(stored, token, HeadParams(bits=2), 4, 8)
    torch.testing.assert_close(got[..., :4], stored["p_scale"][:, :, 0].float().expand(2, 4, 4))
    torch.testing.assert_close(got[..., 4:], stored["p_scale"][:, :, 1].float().expand(2, 4, 4))
    channel = TensorSpec(bits=2, axis="channel")
    stored = encode(x, channel, HeadParams(bits=2))
    torch.testing.assert_close(key_steps(stored, channel, HeadParams(bits=2), 4, 8), stored["p_scale"].float().expand(2, 4, 8))
    static = TensorSpec(bits=2, axis="channel", static=True, outliers=1)
    p = HeadParams(bits=2, scale_D=torch.full((8,), 0.5), zero_D=torch.zeros(8), outlier_channels_n=torch.tensor([3]))
    got = key_steps(encode(x, static, p), static, p, 4, 8)
    assert got[..., 3].abs().max() == 0 and torch.all(got[..., [0, 1, 2, 4, 5, 6, 7]] == 0.5)  # outliers are exact
    sparse = TensorSpec(bits=2, sparse_fraction=0.1)
    stored = encode(x, sparse, HeadParams(bits=2))
    got = key_steps(stored, sparse, HeadParams(bits=2), 4, 8).reshape(2, -1)
    assert torch.all(got.gather(-1, stored["sparse_idx"].long()) == 0)
    assert torch.equal(key_steps({"fp16": x.half()}, token, HeadParams(bits=16), 4, 8), torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="uniform"):
        key_steps(encode(x, TensorSpec(bits=2, kind="codebook"), HeadParams(bits=2, levels_L=torch.linspace(-1, 1, 4))),
                  TensorSpec(bits=2, kind="codebook"), HeadParams(bits=2), 4, 8)


def test_j4_runtime_reads_each_keys_steps_and_spares_exact_keys():
    # per-channel dynamic keys (one step per channel and frame): frames differ in their steps, the
    # float16 sink (policy) and the fresh frame get 0
    recipe = toy_recipe(TensorSpec(bits=2, axis="channel", jensen=True), TensorSpec(bits=2),
                        TokenPolicy(sink_frames=1, sink_bits=16))
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=1)
    frames = kv_frames(4)
    for q, k, v, rope in frames[:3]:
        cache.attend(0, q, k, v, rope)
    q = frames[3][0]
    cache.append(0, frames[3][1], frames[3][2], frames[3][3])
    hist = cache.history(0)
    assert hist == [0, 1, 2]
    bias = cache.logit_bias(0, q)
    assert bias.shape == (B, H, T, (len(hist) + 1) * T)
    assert torch.all(bias[..., :T] == 0) and torch.all(bias[..., -T:] == 0)  # sink in float16, fresh frame exact
    for j, f in enumerate(hist[1:], start=1):
        for h in range(H):
            step_D = cache._frames[0][f]["k"][h]["p_scale"].float()[:, 0]  # [B, D]
            want = torch.einsum("btd,bd->bt", q[:, h].pow(2), step_D.pow(2)) / (24 * D)
            got = -bias[:, h, :, j * T:(j + 1) * T]
            torch.testing.assert_close(got, want.unsqueeze(-1).expand_as(got), rtol=1e-5, atol=1e-8)
    assert not torch.allclose(bias[..., T:2 * T], bias[..., 2 * T:3 * T])  # per frame: its own steps
    assert torch.all(bias <= 0)


def test_jensen_lowers_the_quantized_historys_attention_mass():
    recipe = toy_recipe(TensorSpec(bits=2, axis="channel", jensen=True), TensorSpec(bits=2))
    plain = toy_recipe(TensorSpec(bits=2, axis="channel"), TensorSpec(bits=2))
    caches = [ReferenceCache.from_recipe(r, window=4, sink_frames=0) for r in (recipe, plain)]
    for q, k, v, rope in kv_frames(5):
        for c in caches:
            c.attend(0, q, k, v, rope)
    q = kv_frames(6)[5][0]
    k_all, _ = caches[0].read(0)
    mass = [c.logits(0, q, k_all, c.frame_indices(0)[:-1]).softmax(-1)[..., :-T].sum(-1).mean() for c in caches]
    assert mass[0] < mass[1]


def test_jensen_is_validated():
    with pytest.raises(RecipeError, match="keys only"):
        toy_recipe(TensorSpec(bits=2), TensorSpec(bits=2, jensen=True))
    with pytest.raises(RecipeError, match="uniform grid step"):
        toy_recipe(TensorSpec(bits=2, kind="codebook", jensen=True))
    recipe = toy_recipe(TensorSpec(bits=2, jensen=True), TensorSpec(bits=2))
    recipe.tensors["layers.0.k.logit_bias"] = torch.zeros(H, D)
    from calibrate.recipe import validate
    with pytest.raises(RecipeError, match="both correct key noise"):
        validate(recipe, "r")
