"""ShadowCache's running attention errors (the fast path) against the reference metrics."""

import math

import torch

from calibrate.cache import KVCache, Rope
from calibrate.evaluate.metrics import attention_kl, rel_err, top_agreement
from calibrate.recipe import ModelInfo
from reference_runtime import ReferenceCache
from calibrate.schemes import build_baseline
from calibrate.shadow import ShadowCache

INFO = ModelInfo("toy", num_layers=1, num_kv_heads=2, head_dim=64, tokens_per_frame=4, fingerprint="x")


def test_shadow_sums_match_reference_metrics():
    recipe = build_baseline("naive2", INFO)
    shadow = ShadowCache(1, window=3, sink_frames=1, shadows={"naive2": ReferenceCache.from_recipe(recipe, 3, 1)})
    twin_fp = KVCache(1, 3, 1)
    twin_q = ReferenceCache.from_recipe(recipe, 3, 1)
    g = torch.Generator().manual_seed(0)
    kl, top, err2, ref2, rows = 0.0, 0.0, 0.0, 0.0, 0
    for _ in range(6):
        q, k, v = (torch.randn(1, 2, 4, 64, generator=g) for _ in range(3))
        rope = Rope(torch.randn(1, 4, 32, generator=g))
        out = shadow.attend(0, q, k, v, rope)
        ref_out = twin_fp.attend(0, q, k, v, rope)
        twin_q.append(0, k, v, rope)
        k_fp, _ = twin_fp.read(0)
        k_q, v_q = twin_q.gather(0, rope.apply(k), v)
        p_ref = (q @ k_fp.transpose(-1, -2) / math.sqrt(64)).softmax(-1)
        p_q = (q @ k_q.transpose(-1, -2) / math.sqrt(64)).softmax(-1)
        ids = torch.arange(k_fp.shape[2]) // 4
        n = p_ref[..., 0].numel()
        kl += attention_kl(p_ref, p_q) * n
        top += top_agreement(p_ref, p_q, ids) * n
        o_q = p_q @ v_q
        err2 += rel_err(ref_out, o_q) ** 2 * ref_out.double().pow(2).sum().item()
        ref2 += ref_out.double().pow(2).sum().item()
        rows += n
        assert torch.equal(out, ref_out)  # the shadow never changes the fp rollout
    errors = shadow.errors["naive2"]
    assert math.isclose(errors.kl()[0], kl / rows, rel_tol=1e-4)
    assert math.isclose(errors.top_agreement()[0], top / rows, rel_tol=1e-9)
    assert math.isclose(errors.rel_err()[0], math.sqrt(err2 / ref2), rel_tol=1e-5)
