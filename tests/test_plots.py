"""Plots and strips: each writes a real image file atomically, with the promised geometry."""

import sys

import pytest
import torch
from PIL import Image

from calibrate.evaluate.plots import plot_layer_heatmap, plot_psnr_curves, plot_window_bars
from calibrate.evaluate.strips import LABEL_BAND, write_strip, write_triptych_png


def _rollouts(n: int = 5, h: int = 8, w: int = 8):
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(n, 3, h, w, generator=g)
    quant = (ref + 0.1 * torch.randn(n, 3, h, w, generator=g)).clamp(0, 1)
    return ref, quant


def _assert_only(tmp_path, *names):
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names), "temporary files left behind"


def test_plots_write_pngs_without_pyplot(tmp_path):
    pyplot_before = "matplotlib.pyplot" in sys.modules
    curves = {"naive2": torch.linspace(40, 20, 50), "ours": [40.0 - 0.05 * t for t in range(50)]}
    paths = [
        plot_psnr_curves(curves, tmp_path / "psnr.png", "drift"),
        plot_window_bars(
            {"naive2": {"0-16": 0.02, "16-64": 0.05}, "ours": {"0-16": 0.01, "16-64": 0.02, "64-128": 0.02}},
            tmp_path / "flicker.png",
            ylabel="flicker",
        ),
        plot_layer_heatmap({"naive2": [0.3, 0.5, 0.2], "ours": [0.01, 0.02, float("nan")]}, tmp_path / "kl.png", "KL"),
    ]
    for p in paths:
        assert p.stat().st_size > 0
        with Image.open(p) as im:
            assert im.format == "PNG"
    _assert_only(tmp_path, "psnr.png", "flicker.png", "kl.png")
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_before


def test_heatmap_rejects_ragged_layers(tmp_path):
    with pytest.raises(ValueError, match="layers"):
        plot_layer_heatmap({"a": [1.0, 2.0], "b": [1.0]}, tmp_path / "x.png")
    _assert_only(tmp_path)


@pytest.mark.parametrize("labels", [True, False])
def test_strip_gif_frames_and_geometry(tmp_path, labels):
    ref, quant = _rollouts(n=5, h=8, w=6)
    path = write_strip(ref, quant, tmp_path / "strip.gif", scale=3, labels=labels)
    assert path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "GIF"
        assert im.n_frames == 5
        assert im.width == 3 * 6 * 3
        assert im.height == 8 * 3 + (LABEL_BAND if labels else 0)
    _assert_only(tmp_path, "strip.gif")


def test_strip_error_panel_shows_amplified_error(tmp_path):
    ref = torch.full((2, 3, 4, 4), 0.5)
    quant = ref.clone()
    quant[1] += 0.1
    path = write_strip(ref, quant, tmp_path / "s.gif", gain=4.0, scale=1, labels=False)
    with Image.open(path) as im:
        im.seek(0)
        assert im.convert("RGB").getpixel((9, 1)) == (0, 0, 0)
        im.seek(1)
        r, g, b = im.convert("RGB").getpixel((9, 1))
        assert abs(r - 102) <= 3 and abs(g - 102) <= 3 and abs(b - 102) <= 3


def test_strip_max_frames_spreads_over_the_rollout(tmp_path):
    ref, quant = _rollouts(n=20)
    path = write_strip(ref, quant, tmp_path / "s.gif", max_frames=4, scale=2)
    with Image.open(path) as im:
        assert im.n_frames == 4
    with pytest.raises(ValueError):
        write_strip(ref, quant[:3], tmp_path / "bad.gif")


def test_triptych_png(tmp_path):
    ref, quant = _rollouts(n=10, h=8, w=8)
    path = write_triptych_png(ref, quant, tmp_path / "t.png", num_frames=3, scale=2)
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.width == 3 * 8 * 2
        assert im.height == LABEL_BAND + 3 * 16 + 2 * 2
    with pytest.raises(ValueError):
        write_triptych_png(ref, quant, tmp_path / "u.png", frames=[10])
    _assert_only(tmp_path, "t.png")
