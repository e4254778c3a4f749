"""The WanWorld and K/V-statistics benchmark scripts: end to end on a tiny random WanWorld (numbers
are meaningless), and the streaming moments of benchmarks/kv_stats.py against a direct computation."""

import json
import math

import pytest
import torch

pytest.importorskip("diffusers")

from benchmarks import kv_stats, wanworld  # noqa: E402
from calibrate.wanworld.camera import CameraConfig  # noqa: E402
from calibrate.wanworld.model import ARCHITECTURE, WanWorld, WanWorldConfig  # noqa: E402
from calibrate.wanworld.weights import save_weights  # noqa: E402

TINY = dict(num_attention_heads=1, attention_head_dim=24, ffn_dim=32, num_layers=2, text_dim=16, freq_dim=16)


@pytest.fixture
def weights(tmp_path):
    torch.manual_seed(0)
    model = WanWorld(WanWorldConfig(transformer={**ARCHITECTURE, **TINY}, camera=CameraConfig(tokens=2, hidden=16)))
    path = tmp_path / "tiny.safetensors"
    save_weights(model, path, {"denoise_timesteps": [1000, 750, 500, 250], "shift": 5.0, "chunk_frames": 1})
    return path


def test_wanworld_benchmark_writes_every_bar(tmp_path, weights):
    out = tmp_path / "bench"
    argv = ["--weights", str(weights), "--out", str(out), "--num-trajectories", "1", "--num-frames", "20",
            "--memory-trajectories", "1", "--speed-frames", "3", "--families", "pan,static"]
    assert wanworld.main(argv) == 0
    report = json.loads((out / "wanworld.json").read_text())
    assert set(report["bars"]) == {"one_step", "rollout_1_64", "memory_teacher_forced", "memory_rollout", "determinism"}
    for bar in report["bars"].values():
        assert math.isfinite(bar["value"]) and isinstance(bar["pass"], bool)
    assert report["bars"]["determinism"]["pass"]
    assert "# WanWorld benchmark" in (out / "wanworld.md").read_text()


def test_moments_equal_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    B, H, F, T, D = 2, 2, 5, 3, 6
    x = torch.randn(B, H, F, T, D, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, D, dtype=torch.float64)
    x = x + torch.randn(B, H, 1, T, D, generator=g, dtype=torch.float64)  # a per-slot constant
    m = kv_stats.Moments()
    for f in range(F):
        m.update(x[:, :, f])
    s = m.summary()
    for h in range(H):
        xh = x[:, h]  # [B, F, T, D]
        total = (xh - xh.mean(dim=(0, 1, 2))).pow(2).sum()
        changing = (xh - xh.mean(dim=1, keepdim=True)).pow(2).sum()
        assert s["changing"][h] == pytest.approx((changing / total).item(), rel=1e-9)
        flat = xh.reshape(-1, D)
        ev = torch.linalg.eigvalsh(torch.cov(flat.T, correction=0)).flip(0)
        frac = ev.cumsum(0) / ev.sum()
        assert s["c80"][h] == int((frac < 0.8).sum()) + 1 and s["c95"][h] == int((frac < 0.95).sum()) + 1
        channel_max = flat.abs().amax(0)
        assert s["max_over_median"][h] == pytest.approx((channel_max.max() / channel_max.median()).item())
        rel = [((xh[b, f] - xh[b, f - 1]).norm() / xh[b, f - 1].norm()).item() for b in range(B) for f in range(1, F)]
        assert s["delta"][h] == pytest.approx(sum(rel) / len(rel))


def test_kv_stats_script_on_a_tiny_wanworld(tmp_path, weights):
    argv = ["--models", "wanworld", "--wanworld-weights", str(weights), "--families", "pan,orbit", "--modes",
            "free,teacher_forced", "--num-trajectories", "1", "--num-frames", "6", "--start-frame", "2",
            "--out", str(tmp_path)]
    assert kv_stats.main(argv) == 0
    report = json.loads((tmp_path / "kv_stats.json").read_text())
    for mode in ("free", "teacher_forced"):
        layers = report["models"]["wanworld"][mode]["pan"]
        assert len(layers) == 2 and layers[0]["k"]["frames"] == 4 and layers[0]["k"]["tokens_per_frame"] == 64
        assert len(report["targets"][mode]["rows"]) == 4  # pan and orbit x 2 layers
