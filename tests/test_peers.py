"""The peer baselines of issue 17 as presets: each calibrates (`task=calibrate quant=<preset>`
writes it as a recipe with recorded metrics), loads, runs and passes `task=check` on its own
metrics; bits/element measured from the runtime's tensors equal the prediction and stay within
the equal-memory budget; a preset over a requested budget is refused."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from calibrate import calibration, gate, pipeline
from calibrate.config import Config, TrajectoriesConfig
from calibrate.memory import bits_per_element
from calibrate.recipe import load_recipe
from calibrate.schemes import BASELINES, preset_scheme

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("qvg2", "qvg2_lowmem", "qvg2_static", "kivi2_lowmem", "turbo2.5", "jensen2", "nvfp4")
# steady-state bits/element on TinyWorld (window 16 + 1 sink), the most over the phases: every peer
# at <= 2.5 but jensen2, whose per-channel key parameters on 16-token frames cost 2 bits, and qvg2
# as published, whose pending spans wait in 16 bits: per head at the worst phase 7 pending frames
# x 2048 bytes + 10 coded x 274 (FORMAT.md) + 3 span states x 256 over 17 x 2048 in float16 = 8.2004; nvfp4
# 512 code bytes + 64 E4M3 scales + one float32 per head and frame = 580 / 2048 x 16 = 4.53125
BITS = {"qvg2": 8.2004, "qvg2_lowmem": 2.494, "qvg2_static": 2.25, "kivi2_lowmem": 2.5, "turbo2.5": 2.375, "jensen2": 3.25,
        "nvfp4": 4.53125}
SMALL_CHECK = TrajectoriesConfig(name="check-small", split="evaluation", families=["orbit", "static"],
                                 num_trajectories=2, num_frames=32, seed=100)


def _config(task: str, **fields) -> Config:
    cfg = Config(task=task, device="cpu", **fields)
    cfg.trajectories = TrajectoriesConfig(name="small", families=["orbit", "revisit"], num_trajectories=2, num_frames=24)
    cfg.fit = replace(cfg.fit, sample_tokens=256)
    cfg.eval = replace(cfg.eval, strips=False, attention=False)
    return cfg


def test_every_peer_has_a_config_file():
    for name in BASELINES:
        assert (ROOT / "conf" / "quant" / f"{name}.yaml").read_text().strip() == f"preset: {name}"


@pytest.mark.parametrize("name", PEERS)
def test_preset_bits_at_steady_state(name):
    from calibrate.adapters import as_world
    from calibrate.world.weights import load_weights

    info = as_world(load_weights()).info
    assert bits_per_element(info, preset_scheme(name, info), 16, 1) == pytest.approx(BITS[name], abs=1e-3)


@pytest.mark.parametrize("name", PEERS)
def test_preset_calibrates_loads_runs_and_passes_its_check(name, tmp_path, monkeypatch):
    # the gate's set, small: run_calibrate records metrics on it, run_check replays it
    monkeypatch.setattr(gate, "check_trajectories", lambda cfg, recorded=None: replace(cfg, trajectories=SMALL_CHECK))
    cfg = _config("calibrate")
    cfg.quant = replace(cfg.quant, preset=name)
    out = calibration.run_calibrate(cfg, tmp_path / "cal")
    recipe = load_recipe(out["recipe"])
    assert recipe.scheme.name == name and recipe.section("metrics")["check"]
    report = json.loads((tmp_path / "cal" / "report.json").read_text())
    memory = report["schemes"][name]["memory"]
    assert memory["bytes"] == memory["predicted_bytes"]  # counted from the runtime's tensors
    assert memory["bits_per_element"] <= BITS[name] + 1e-9
    check = _config("check", recipe=out["recipe"])
    check.trajectories = SMALL_CHECK
    result = pipeline.run_check(check, tmp_path / "check")
    assert result["passed"], result["summary"]


def test_budget_check_of_presets():
    from calibrate.adapters import as_world
    from calibrate.world.weights import load_weights

    info = as_world(load_weights()).info
    cfg = Config(task="calibrate")
    for name in PEERS:
        cfg.quant = replace(cfg.quant, preset=name, budget_bits=BITS[name])
        calibration.check_preset_budget(cfg, info)  # exactly at its own bits: fine
    cfg.quant = replace(cfg.quant, preset="jensen2", budget_bits=2.5)
    with pytest.raises(ValueError, match=r"preset 'jensen2' needs 3.250 bits.*qvg2_lowmem \(2.49\)"):
        calibration.check_preset_budget(cfg, info)
    cfg.quant = replace(cfg.quant, preset="kivi2", budget_bits=None)  # no budget requested: no check
    calibration.check_preset_budget(cfg, info)


@pytest.mark.slow
def test_cli_calibrate_then_check(tmp_path):
    """The command line itself, with the real gate set (about a minute on a CPU)."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    cal = subprocess.run([sys.executable, "-m", "calibrate", "task=calibrate", "quant=turbo2.5", "trajectories=quick",
                          "trajectories.num_frames=24", "eval.strips=false", f"hydra.run.dir={tmp_path / 'cal'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert cal.returncode == 0, cal.stderr[-2000:]
    chk = subprocess.run([sys.executable, "-m", "calibrate", "task=check", f"recipe={tmp_path / 'cal' / 'recipe.safetensors'}",
                          f"hydra.run.dir={tmp_path / 'check'}"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert chk.returncode == 0, chk.stderr[-2000:]
    assert json.loads((tmp_path / "check" / "check.json").read_text())["passed"]


def _toy_peer_recipes():
    """Toy recipes (tests/toys.py sizes) of the new kinds under several token policies."""
    from toys import D, H, INFO

    from calibrate.quant import rotation, turbo
    from calibrate.recipe import Recipe, TensorSpec, TokenPolicy, uniform_scheme, validate

    def rec(k, v, pol, tensors=None):
        r = Recipe(INFO, uniform_scheme("toy", INFO.num_layers, k, v, pol), tensors or {})
        validate(r, "toy")
        return r

    prq = TensorSpec(bits=2, kind="prq", group_size=8, prq_stages=2, prq_centroids=3, prq_span_frames=3)
    tq = {}
    for i in range(INFO.num_layers):
        for kind in "kv":
            tq[f"layers.{i}.{kind}.rotation"] = torch.stack([rotation.random_orthogonal(D, 10 * i + h) for h in range(H)])
        tq[f"layers.{i}.k.lloyd_max"] = turbo.beta_lloyd_max(D, 1).expand(H, -1).clone()
        tq[f"layers.{i}.k.qjl"] = torch.stack([turbo.qjl_matrix(D, D, h) for h in range(H)])
        tq[f"layers.{i}.v.lloyd_max"] = turbo.beta_lloyd_max(D, 2).expand(H, -1).clone()
    return {
        "prq_recent_sink16": rec(prq, prq, TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=1)),
        "prq_keyframes": rec(prq, replace(prq, prq_centroids=1, prq_span_frames=2),
                             TokenPolicy(sink_frames=0, keyframe_interval=4, keyframe_bits=4)),
        "prq_head_bits": rec(replace(prq, head_bits=[2, 16]), TensorSpec(bits=3, kind="prq"), TokenPolicy(sink_frames=0)),
        "turbo": rec(TensorSpec(bits=2, kind="turbo_prod", rotation="random"), TensorSpec(bits=2, kind="turbo", rotation="random"),
                     TokenPolicy(sink_frames=1, sink_bits=16), tq),
        "jensen": rec(TensorSpec(bits=2, axis="channel", jensen=True), TensorSpec(bits=2), TokenPolicy(sink_frames=0, recent_frames=2)),
    }


@pytest.mark.parametrize("window,sink", [(3, 1), (4, 0), (2, 2)])
def test_new_kinds_measured_bytes_equal_predicted(window, sink):
    from toys import B, INFO, kv_frames

    from calibrate.cache import kept_frames
    from reference_runtime import ReferenceCache

    for name, recipe in _toy_peer_recipes().items():
        cache = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
        for n, (q, k, v, rope) in enumerate(kv_frames(10), start=1):
            for layer in range(INFO.num_layers):
                assert torch.isfinite(cache.attend(layer, q, k, v, rope)).all()
                assert cache.frame_indices(layer) == kept_frames(n, window, sink)
            assert cache.nbytes() == cache.predicted_nbytes(n, batch=B), (name, n)
