"""WanWorld (calibrate/wanworld/): the teacher-forced training forward computes exactly the cached
rollout's passes, the model loads through the `wan_diffusers` adapter and rolls out
deterministically, the camera changes what it generates, and training resumes exactly."""

import json

import pytest
import torch

pytest.importorskip("diffusers")

from calibrate.adapters.wan_diffusers import AdapterError, WanAdapter, WanSettings  # noqa: E402
from calibrate.cache import KVCache  # noqa: E402
from calibrate.config import ModelConfig  # noqa: E402
from calibrate.evaluate.metrics import psnr  # noqa: E402
from calibrate.pipeline import load_adapter  # noqa: E402
from calibrate.types import Trajectory  # noqa: E402
from calibrate.wanworld import latents  # noqa: E402
from calibrate.wanworld.camera import CameraConfig  # noqa: E402
from calibrate.wanworld.model import ARCHITECTURE, WanWorld, WanWorldConfig, WanWorldInputs  # noqa: E402
from calibrate.wanworld.teacher import clip_forward  # noqa: E402
from calibrate.wanworld.train import batch, train  # noqa: E402
from calibrate.wanworld.train_config import WanTrainConfig  # noqa: E402
from calibrate.wanworld.weights import default_weights_path, load_weights, save_weights  # noqa: E402
from calibrate.world.render import make_scene, render  # noqa: E402
from calibrate.world.trajectories import make_trajectories, make_trajectory  # noqa: E402

CPU = torch.device("cpu")
# a tiny WanWorld: 2 layers x 1 head x head_dim 24 (RoPE: 8 time + 8 height + 8 width channels)
TINY = dict(num_attention_heads=1, attention_head_dim=24, ffn_dim=32, num_layers=2, text_dim=16, freq_dim=16)
TINY_CAMERA = dict(tokens=2, hidden=16)
SETTINGS = WanSettings(chunk_frames=1, latent_height=16, latent_width=16, denoise_timesteps=[1000, 500])


def tiny_model(seed: int = 0) -> WanWorld:
    torch.manual_seed(seed)
    return WanWorld(WanWorldConfig(transformer={**ARCHITECTURE, **TINY}, camera=CameraConfig(**TINY_CAMERA))).eval()


def adapter_of(model: WanWorld) -> WanAdapter:
    return WanAdapter(model.transformer, SETTINGS, None, name="wanworld", world=WanWorldInputs(model))


@pytest.mark.parametrize("window,sink,positions", [(16, 1, [0, 1, 2, 3, 4, 5]), (3, 1, [0, 1, 2, 3, 4, 5]),
                                                   (2, 0, [0, 1, 2, 3, 4, 5]), (16, 1, [0, 300, 301, 302, 303, 304])])
def test_teacher_forward_equals_the_cached_passes(window, sink, positions):
    """One masked diffusers forward over a clip == the adapter's denoising and clean passes, chunk by chunk."""
    model = tiny_model()
    adapter = adapter_of(model)
    g = torch.Generator().manual_seed(1)
    B, N = 2, len(positions)
    clean = torch.rand(B, N, 12, 16, 16, generator=g)
    noisy = torch.randn(B, N - 1, 12, 16, 16, generator=g)
    timesteps = torch.tensor([[937.5, 625.0, 1000.0, 833.3, 500.0]]).expand(B, -1)  # the adapter runs one per batch
    context = torch.randn(B, N, 2, 16, generator=g)
    pos = torch.tensor(positions).expand(B, N)
    with torch.no_grad():
        clean_out, noisy_out = clip_forward(model.transformer, clean, noisy, list(range(1, N)), timesteps, pos, context,
                                            window, sink)
        cache = KVCache(adapter.info.num_layers, window, sink)
        for c in range(N):
            if c:
                x = noisy[:, c - 1 : c].transpose(1, 2)
                out = adapter.forward_chunk(cache, x, positions[c], float(timesteps[0, c - 1]), commit=False,
                                            context_BLD=context[:, c])
                torch.testing.assert_close(out.transpose(1, 2), noisy_out[:, c - 1 : c], rtol=1e-4, atol=1e-5)
            out = adapter.forward_chunk(cache, clean[:, c : c + 1].transpose(1, 2), positions[c], 0.0, commit=True,
                                        context_BLD=context[:, c])
            torch.testing.assert_close(out.transpose(1, 2), clean_out[:, c : c + 1], rtol=1e-4, atol=1e-5)
    # the masks matter: a noisy frame that saw the whole clip would differ
    with torch.no_grad():
        _, leaky = clip_forward(model.transformer, clean.flip(1), noisy, list(range(1, N)), timesteps, pos, context,
                                window, sink)
    assert (leaky[:, 0] - noisy_out[:, 0]).abs().max() > 1e-4  # frame 1 saw frame 0 (now another frame)


def test_latents_are_a_permutation_of_the_pixels():
    frames = render(make_scene(5), make_trajectory("orbit", 5, 3).poses)
    z = latents.encode(frames)
    assert z.shape == (3, 12, 16, 16)
    assert torch.equal(latents.decode(z), frames)
    other = frames.flip(-1)
    torch.testing.assert_close(psnr(latents.encode(other), z), psnr(other, frames))  # same PSNR in both spaces


def test_rollout_starts_from_the_true_frame_and_is_deterministic():
    adapter = adapter_of(tiny_model())
    trajs = make_trajectories(["orbit"], "evaluation", 2, 4)
    a = adapter.rollout(trajs, KVCache(2, 16, 1), CPU)
    b = adapter.rollout(trajs, KVCache(2, 16, 1), CPU)
    assert a.shape == (2, 4, 12, 16, 16)
    assert torch.equal(a, b)
    truth = adapter.ground_truth(trajs, CPU)
    assert torch.equal(a[:, 0], truth[:, 0])  # frame 0 is given
    assert a.min() >= 0 and a.max() <= 1  # generated latents are clamped to the pixels' range
    tf = adapter.rollout(trajs, KVCache(2, 16, 1), CPU, teacher_forced=True)
    assert not torch.equal(tf[:, 2:], a[:, 2:])  # from true history, frames 2+ differ


def test_the_camera_changes_what_is_generated():
    adapter = adapter_of(tiny_model())
    t = make_trajectory("pan", 2_000_001, 3)
    turned = Trajectory("pan", t.seed, t.poses + torch.tensor([0.0, 0.0, 0.5]), t.actions + torch.tensor([0.0, 0.0, 0.1]))
    context = adapter.world.context([t, turned], CPU)
    assert not torch.allclose(context[0], context[1])
    truth = adapter.ground_truth([t], CPU)
    a = adapter.rollout([t], KVCache(2, 16, 1), CPU, truth=truth)
    b = adapter.rollout([turned], KVCache(2, 16, 1), CPU, truth=truth)  # same first frame, same noise
    assert torch.equal(a[:, 0], b[:, 0])
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-4


def test_weights_round_trip_and_the_adapter_checks_settings(tmp_path):
    model = tiny_model(3)
    path = tmp_path / "w.safetensors"
    save_weights(model, path, {"denoise_timesteps": [1000, 500], "shift": 5.0, "chunk_frames": 1})
    loaded, meta = load_weights(path)
    assert json.loads(meta["sampler"])["chunk_frames"] == 1
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    adapter = load_adapter(ModelConfig(name="wanworld", weights=str(path), wan=SETTINGS), CPU)
    assert adapter.info.name == "wanworld" and adapter.info.tokens_per_frame == 64 and adapter.info.head_dim == 24
    assert adapter.info.fingerprint == adapter_of(model).info.fingerprint
    for bad, message in ((dict(latent_height=32), "latent_height/latent_width must be 16"),
                         (dict(chunk_frames=2), "chunk_frames must be 1"),
                         (dict(text_embedding="x.safetensors"), "text_embedding is not used"),
                         (dict(config="wan2.1-t2v-1.3b"), "carries its own config")):
        with pytest.raises(AdapterError, match=message):
            load_adapter(ModelConfig(name="wanworld", weights=str(path), wan=WanSettings(**{**vars(SETTINGS), **bad})), CPU)
    with pytest.raises(AdapterError, match="WanWorld weights file not found"):
        load_adapter(ModelConfig(name="wanworld", weights=str(tmp_path / "none.safetensors"), wan=SETTINGS), CPU)
    # the transformer alone is an ordinary diffusers model directory (the real-checkpoint path)
    model.transformer.save_pretrained(tmp_path / "dir")
    text = load_adapter(ModelConfig(name="wan_diffusers", weights=str(tmp_path / "dir"), wan=SETTINGS), CPU)
    assert text.world is None and text.ground_truth(make_trajectories(["orbit"], "evaluation", 1, 2), CPU) is None


def test_shipped_weights_load_through_the_adapter():
    """The shipped file loads as `model=wanworld` with the preset's settings (conf/model/wanworld.yaml)."""
    from calibrate.config import to_config

    cfg = to_config({"model": {"name": "wanworld", "wan": {"chunk_frames": 1, "latent_height": 16, "latent_width": 16}}})
    adapter = load_adapter(cfg.model, CPU)
    assert adapter.info.name == "wanworld" and adapter.info.tokens_per_frame >= 64
    _, meta = load_weights(default_weights_path())
    assert json.loads(meta["sampler"])["denoise_timesteps"] == cfg.model.wan.denoise_timesteps


def tiny_train(**overrides) -> WanTrainConfig:
    base = dict(steps=4, batch_size=2, clip_frames=4, warmup_steps=2, lr=1e-3, checkpoint_every=2, num_threads=1,
                offset_share=0.5, max_offset=50, model=TINY, camera=TINY_CAMERA, denoise_timesteps=[1000, 500])
    return WanTrainConfig(**{**base, **overrides})


def test_resumed_training_equals_uninterrupted(tmp_path):
    cfg = tiny_train(self_forcing_start=2, self_forcing_max=1.0)  # the last steps train on the model's own frames
    whole = train(cfg, tmp_path / "whole")
    train(tiny_train(steps=2, self_forcing_start=2, self_forcing_max=1.0), tmp_path / "split")  # "interrupted" at 2
    resumed = train(cfg, tmp_path / "split")
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    lines = lambda d: [json.loads(x)["loss"] for x in (d / "loss.jsonl").read_text().splitlines()]
    assert lines(tmp_path / "whole") == lines(tmp_path / "split")


def test_clips_keep_the_sink_frame_and_skip_the_frame_without_a_predecessor():
    cfg = tiny_train(batch_size=8, offset_share=0.5)
    b = batch(cfg, 0)
    offsets = b["offset"]
    assert any(offsets) and not all(offsets)
    for i, o in enumerate(offsets):
        assert b["positions"][i, 0] == 0
        if o:
            assert b["positions"][i, 1] == o + 1 and b["weight"][i, 1] == 0 and b["weight"][i, 2:].eq(1).all()
        else:
            assert torch.equal(b["positions"][i], torch.arange(4)) and b["weight"][i].eq(1).all()


def test_cli_trains_and_the_weights_load_as_model_wanworld(tmp_path):
    """`task=train_world model=wanworld` (a tiny config, 2 steps) writes weights `model=wanworld` loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    tiny = ",".join(f"{k}:{v}" for k, v in TINY.items())
    run = subprocess.run([sys.executable, "-m", "calibrate", "task=train_world", "model=wanworld", "train_wan.steps=2",
                          "train_wan.batch_size=1", "train_wan.clip_frames=3", "train_wan.denoise_timesteps=[1000,500]",
                          f"++train_wan.model={{{tiny}}}", "++train_wan.camera={tokens:2,hidden:16}",
                          f"hydra.run.dir={tmp_path}"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    adapter = load_adapter(ModelConfig(name="wanworld", weights=str(tmp_path / "wanworld.safetensors"), wan=SETTINGS), CPU)
    assert adapter.info.head_dim == 24
    _, meta = load_weights(tmp_path / "wanworld.safetensors")
    assert json.loads(meta["sampler"])["denoise_timesteps"] == [1000, 500]
    assert json.loads(meta["train_config"])["steps"] == 2
