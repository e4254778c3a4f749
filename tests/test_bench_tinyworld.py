"""The TinyWorld benchmark script end to end on a tiny random model (numbers are meaningless)."""

import json
import math

import pytest
import torch

from benchmarks.tinyworld import main
from calibrate.types import weights_fingerprint
from calibrate.world.model import TinyWorld, TinyWorldConfig
from calibrate.world.weights import save_weights

TINY = TinyWorldConfig(dim=64, num_layers=1, num_heads=1, rope_xy_pairs=4, rope_bearing_pairs=8)
BARS = ("one_step", "rollout_1_16", "rollout_17_64", "memory_teacher_forced", "memory_rollout", "speed", "determinism")
SMALL = ["--num-trajectories", "1", "--num-frames", "20", "--memory-trajectories", "1", "--speed-frames", "4"]


@pytest.fixture
def weights(tmp_path):
    torch.manual_seed(0)
    model = TinyWorld(TINY).eval()
    torch.nn.init.normal_(model.patch_out.weight, std=0.02)  # the output head starts at zero
    path = tmp_path / "tiny.safetensors"
    save_weights(model, path)
    return path, weights_fingerprint(model)


def test_writes_every_bar(tmp_path, weights, capsys):
    path, fingerprint = weights
    out = tmp_path / "bench"
    argv = ["--weights", str(path), "--out", str(out), *SMALL]
    assert main(argv) == 0

    report = json.loads((out / "tinyworld.json").read_text())
    assert set(report["bars"]) == set(BARS)
    for bar in report["bars"].values():
        assert isinstance(bar["value"], float) and math.isfinite(bar["value"])
        assert isinstance(bar["threshold"], float)
        assert isinstance(bar["pass"], bool)
    assert report["pass"] == all(b["pass"] for b in report["bars"].values())
    assert report["weights"]["fingerprint"] == fingerprint
    assert report["determinism"]["identical"] is True
    assert set(report["one_step"]) == set(report["rollout"]) == {
        "orbit", "dolly", "pan", "revisit", "random_walk", "stress", "static"
    }
    assert {"1-16", "17-64"} <= set(report["rollout"]["orbit"]["windows"])

    command = "python -m benchmarks.tinyworld " + " ".join(argv)
    assert report["command"] == command
    markdown = (out / "tinyworld.md").read_text()
    assert command in markdown and fingerprint in markdown
    assert "| one_step |" in capsys.readouterr().out


def test_missing_weights_is_one_line_exit_2(tmp_path, capsys):
    assert main(["--weights", str(tmp_path / "nope.safetensors"), "--out", str(tmp_path), *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.safetensors" in err
    assert not (tmp_path / "tinyworld.json").exists()


def test_too_few_frames_is_exit_2(tmp_path, weights, capsys):
    argv = ["--weights", str(weights[0]), "--out", str(tmp_path), *SMALL, "--num-frames", "10"]
    assert main(argv) == 2
    assert "--num-frames" in capsys.readouterr().err


def test_return_legs_split_into_dwell_retrace_and_return_frames(weights):
    """Every return-leg frame is exactly one kind; pooled and per-frame numbers are both there."""
    from benchmarks.tinyworld import Clips, memory_bars
    from calibrate.world.trajectories import make_trajectories
    from calibrate.world.weights import load_weights

    clips = Clips(make_trajectories("revisit", "evaluation", 2, 60))
    tf = memory_bars(load_weights(weights[0]), clips, window=16, sink_frames=1)["teacher_forced"]
    assert tf["num_dwell_frames"] > 0 and tf["num_retrace_frames"] > 0
    assert (tf["num_dwell_frames"] + tf["num_retrace_frames"] + tf["num_snap_returns"] + tf["num_gradual_returns"]
            == tf["num_return_frames"])
    for cache in ("full_cache", "last_frame_cache"):
        assert all(math.isfinite(tf[cache][k]) for k in ("dwell_db", "retrace_db", "return_pooled_db", "outbound_pooled_db"))
    gain = lambda k: tf["full_cache"][k] - tf["last_frame_cache"][k]
    assert tf["pooled_value_db"] == pytest.approx(gain("return_pooled_db") - gain("outbound_pooled_db"))
