"""The diffusers Wan adapter (tiny random config): cached chunk-by-chunk == uncached block-causal."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers.models.transformers.transformer_wan import WanAttnProcessor  # noqa: E402

from calibrate.adapters import wan_diffusers as wan  # noqa: E402
from calibrate.adapters.wan_diffusers import WanSettings  # noqa: E402
from calibrate.cache import KVCache, block_mask  # noqa: E402
from calibrate.memory import (bits_per_element, fp16_cache_bytes, predicted_cache_bytes,  # noqa: E402
                              steady_state_frames)
from calibrate.recipe import load_recipe  # noqa: E402
from calibrate.world.trajectories import make_trajectories  # noqa: E402

CPU = torch.device("cpu")


class MaskedSelfAttention:
    """diffusers' own Wan processor with a fixed attention mask (the uncached reference)."""

    def __init__(self, mask):
        self.inner, self.mask = WanAttnProcessor(), mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, None, self.mask, rotary_emb)


def uncached(adapter, latents, window, sink, chunk_frames):
    """One diffusers forward over every chunk with the cache's block-causal mask, at timestep 0."""
    model = adapter.transformer
    per_chunk = chunk_frames * adapter.grid[0] * adapter.grid[1]
    mask = block_mask(latents.shape[2] // chunk_frames, per_chunk, window, sink)
    saved = model.attn_processors
    model.set_attn_processor({n: MaskedSelfAttention(mask) if ".attn1." in n else WanAttnProcessor() for n in saved})
    try:
        with torch.no_grad():
            t = torch.zeros(latents.shape[0])
            return model(latents, t, adapter.text.expand(latents.shape[0], -1, -1), return_dict=False)[0]
    finally:
        model.set_attn_processor(saved)


def cached(adapter, latents, window, sink, chunk_frames):
    cache = KVCache(adapter.info.num_layers, window, sink)
    outs = []
    with torch.no_grad():
        for c in range(latents.shape[2] // chunk_frames):
            chunk = latents[:, :, c * chunk_frames : (c + 1) * chunk_frames]
            outs.append(adapter.forward_chunk(cache, chunk, c * chunk_frames, 0.0, commit=True))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("window,sink,chunk_frames", [(16, 1, 1), (2, 1, 1), (2, 0, 2), (3, 1, 2)])
def test_cached_chunks_equal_uncached_block_causal_forward(window, sink, chunk_frames):
    adapter = wan.load(None, WanSettings(chunk_frames=chunk_frames), CPU)
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, adapter.channels, 6, 16, 16, generator=g)
    ref = uncached(adapter, latents, window, sink, chunk_frames)
    out = cached(adapter, latents, window, sink, chunk_frames)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # the mask matters: with a short window, the full-attention forward differs
    if window < 6 // chunk_frames:
        full = uncached(adapter, latents, 1000, 0, chunk_frames)
        assert (full - ref).abs().max() > 1e-3


def test_rope_angles_match_diffusers_rope():
    adapter = wan.load(None, WanSettings(), CPU)
    cos, sin = adapter.transformer.rope(torch.zeros(1, 4, 5, 8, 8))  # [1, F*H*W, 1, head_dim], interleaved
    angles = wan.rope_angles(64, range(5), 4, 4)
    torch.testing.assert_close(angles.cos().float(), cos[0, :, 0, 0::2].float())
    torch.testing.assert_close(angles.sin().float(), sin[0, :, 0, 1::2].float())
    # an offset chunk gets the same code as those frames in the whole clip
    torch.testing.assert_close(wan.rope_angles(64, range(3, 5), 4, 4), angles[3 * 16 :])


def test_denoising_passes_leave_the_cache_unchanged():
    adapter = wan.load(None, WanSettings(), CPU)
    cache = KVCache(adapter.info.num_layers, 4, 1)
    x = torch.randn(1, adapter.channels, 1, 16, 16)
    with torch.no_grad():
        adapter.forward_chunk(cache, x, 0, 0.0, commit=True)
        before = [t.clone() for t in cache.read(0)]
        adapter.forward_chunk(cache, torch.randn_like(x), 1, 500.0, commit=False)
    assert cache.num_frames_seen == 1
    for a, b in zip(before, cache.read(0)):
        assert torch.equal(a, b)


def test_rollout_shapes_determinism_and_chunking():
    adapter = wan.load(None, WanSettings(chunk_frames=2), CPU)
    trajs = make_trajectories(["orbit"], "calibration", 2, 6)
    a = adapter.rollout(trajs, KVCache(2, 16, 1), CPU)
    b = adapter.rollout(trajs, KVCache(2, 16, 1), CPU)
    assert a.shape == (2, 6, adapter.channels, 16, 16)
    assert torch.equal(a, b)
    cache = KVCache(2, 16, 1)
    adapter.rollout(trajs, cache, CPU)
    assert cache.num_frames_seen == 3  # one cache frame per chunk
    assert adapter.info.tokens_per_frame == 2 * 64  # 2 latent frames of 8 x 8 tokens
    with pytest.raises(wan.AdapterError, match="does not divide"):
        adapter.rollout(make_trajectories(["orbit"], "calibration", 1, 5), KVCache(2, 16, 1), CPU)


def test_bad_weights_paths(tmp_path):
    with pytest.raises(wan.AdapterError, match="not a diffusers model directory"):
        wan.load(str(tmp_path / "missing"), WanSettings(), CPU)
    model = wan.tiny_transformer()
    model.save_pretrained(tmp_path / "tiny")
    assert wan.load(str(tmp_path / "tiny"), WanSettings(), CPU).info.fingerprint == wan.load(None, WanSettings(), CPU).info.fingerprint
    cfg = (tmp_path / "tiny" / "config.json").read_text().replace('"num_attention_heads": 2', '"num_attention_heads": 4')
    (tmp_path / "tiny" / "config.json").write_text(cfg)
    with pytest.raises(wan.AdapterError, match="does not load"):
        wan.load(str(tmp_path / "tiny"), WanSettings(), CPU)


def test_text_embedding_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"text_embedding": torch.randn(5, 32)}, tmp_path / "ok.safetensors")
    assert wan.load(None, WanSettings(text_embedding=str(tmp_path / "ok.safetensors")), CPU).text.shape == (5, 32)
    save_file({"text_embedding": torch.randn(5, 31)}, tmp_path / "dim.safetensors")
    save_file({"other": torch.randn(5, 32)}, tmp_path / "key.safetensors")
    for name, message in (("dim", r"expected \[L, 32\]"), ("key", "no tensor 'text_embedding'"), ("missing", "cannot read")):
        with pytest.raises(wan.AdapterError, match=message):
            wan.load(None, WanSettings(text_embedding=str(tmp_path / f"{name}.safetensors")), CPU)


def test_missing_diffusers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers -> ImportError
    with pytest.raises(wan.AdapterError, match=r'pip install -e "\.\[diffusers\]"'):
        wan.load(None, WanSettings(), CPU)


# ---- the command line, end to end on the tiny random Wan ---------------------------------------
REPO = Path(__file__).resolve().parents[1]
SMALL = ["model=wan_diffusers", "trajectories=quick", "trajectories.num_frames=24", "trajectories.num_trajectories=2",
         "fit.closed_loop_frames=24", "fit.closed_loop_trajectories=1", "fit.trace_frames=16",
         "model.wan.denoise_timesteps=[1000,500]", "model.wan.chunk_frames=2", "check.num_frames=24",
         "check.num_trajectories=2"]


def calibrate(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "calibrate", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cli_stats_fit_recipe_evaluate_check_on_wan(tmp_path):
    stats = calibrate("task=stats", *SMALL, f"hydra.run.dir={tmp_path / 'stats'}")
    assert stats.returncode == 0, stats.stderr[-2000:]
    assert (tmp_path / "stats" / "stats.safetensors").is_file() and (tmp_path / "stats" / "stats.json").is_file()

    cal = calibrate(*SMALL, f"hydra.run.dir={tmp_path / 'cal'}")
    assert cal.returncode == 0, cal.stderr[-2000:]
    recipe_path = tmp_path / "cal" / "recipe.safetensors"
    adapter = wan.load(None, WanSettings(chunk_frames=2), CPU)
    recipe = load_recipe(recipe_path, adapter.info)  # validates shapes against the Wan model
    assert recipe.model.name == "wan_diffusers" and recipe.model.tokens_per_frame == 2 * 64
    assert json.loads(recipe.metadata["metrics"])["check"]["trajectories"] == {"num_trajectories": 2, "num_frames": 24}
    report = json.loads((tmp_path / "cal" / "report.json").read_text())
    memory = report["schemes"]["ours"]["memory"]
    assert memory["bytes"] == memory["predicted_bytes"]  # packed bytes measured from the tensors
    # the budget holds at the steady state (memory.py); 24 frames in chunks of 2 never fill the window
    # of 16 + 1, so the rollout's per-element bits (the sink code and the sink refresh's reference
    # over fewer frames) are no budget: its bytes stay below the steady state's, which is within it
    assert bits_per_element(recipe.model, recipe.scheme, 16, 1) <= 2.5 + 1e-9
    batch = memory["fp16_bytes"] // fp16_cache_bytes(recipe.model, 12, 16, 1)
    steady = steady_state_frames(16, 1)
    assert memory["peak_bytes"] <= predicted_cache_bytes(recipe.model, recipe.scheme, steady, 16, 1, batch)

    # the check replays the set the recipe recorded its metrics on (2 x 24 frames), not check.yaml's 4 x 128
    check = calibrate("task=check", "model=wan_diffusers", "model.wan.denoise_timesteps=[1000,500]",
                      "model.wan.chunk_frames=2", f"recipe={recipe_path}", f"hydra.run.dir={tmp_path / 'check'}")
    assert check.returncode == 0, check.stderr[-2000:]
    result = json.loads((tmp_path / "check" / "check.json").read_text())
    recorded = json.loads(recipe.metadata["metrics"])["check"]
    assert result["measured"]["psnr_ref_all"] == pytest.approx(recorded["psnr_ref_all"], abs=1e-6)  # deterministic


@pytest.mark.parametrize("args,message", [
    (["model.weights=/no/such/dir"], "is not a diffusers model directory"),
    (["model.wan.chunk_frames=5"], "does not divide"),
    (["task=calibrate", "model.wan.chunk_frames=3", "trajectories.num_frames=24", "fit.closed_loop_frames=24",
      "check.num_frames=128"], "does not divide check.num_frames=128; set check.num_frames to a multiple of 3"),
    (["task=calibrate", "model.wan.chunk_frames=3", "trajectories.num_frames=24", "fit.closed_loop_frames=20",
      "fit.closed_loop_scales=[1.0,1.4]"], "fit.closed_loop_frames=18"),
    (["fit.trace_bytes=12 parsecs"], "fit.trace_bytes"),
    (["model.wan.dtype=float8"], "model.wan.dtype"),
    (["task=train_world"], "trains model=tinyworld or model=wanworld"),
])
def test_cli_bad_wan_input_is_one_line(tmp_path, args, message):
    """Refused from the config alone, before the model loads or anything runs: nothing is written."""
    run = calibrate("task=stats", *SMALL, *args, f"hydra.run.dir={tmp_path}")
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert not any(p.suffix == ".safetensors" for p in tmp_path.rglob("*"))


def test_closed_loop_frames_are_checked_only_where_the_closed_loop_runs():
    """With one closed-loop scale (the default) the predictive fit rolls nothing out, so its horizon
    need not be whole chunks; with another scale, or the scalar code, it must."""
    from calibrate.config import to_config

    base = {"task": "calibrate", "model": {"name": "wanworld", "wan": {"chunk_frames": 3}},
            "trajectories": {"num_frames": 24}, "check": {"num_frames": 24}}
    assert to_config({**base, "fit": {"closed_loop_frames": 20}}).fit.closed_loop_frames == 20
    for fit in ({"closed_loop_scales": [1.0, 1.4]}, {"code": "scalar"}):
        with pytest.raises(ValueError, match="does not divide fit.closed_loop_frames=20"):
            to_config({**base, "fit": {"closed_loop_frames": 20, **fit}})
