"""The CI gate on the shipped recipe, the recording cache's transparency, and the eval report schema."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from calibrate import load_model
from calibrate.adapters import as_world
from calibrate.cache import KVCache
from calibrate.recipe import load_recipe, save_recipe
from calibrate.replay import Recorder, RecordingCache, rollout_batch
from calibrate.trace import Trace, plan_trace
from calibrate.world.trajectories import make_trajectories

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "recipes").glob("*.safetensors"))


def _check(recipe: Path, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "calibrate", "task=check", f"recipe={recipe}", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.skipif(not SHIPPED, reason="no shipped recipe")
def test_check_passes_on_shipped_recipe_and_fails_on_a_degraded_copy(tmp_path):
    ok = _check(SHIPPED[0], tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr[-2000:]
    result = json.loads((tmp_path / "ok" / "check.json").read_text())
    assert result["passed"] and result["criteria"]
    suite = ET.parse(tmp_path / "ok" / "check.xml").getroot()
    assert suite.tag == "testsuite" and int(suite.get("failures")) == 0 and int(suite.get("tests")) == len(result["criteria"])

    # degrade: every step 3x coarser (static scales of scalar codes, integer units of predictive codes)
    recipe = load_recipe(SHIPPED[0])
    for name, t in recipe.tensors.items():
        if name.endswith((".scale", ".unit")):
            recipe.tensors[name] = t * 3.0
    degraded = tmp_path / "degraded.safetensors"
    save_recipe(recipe, degraded)
    bad = _check(degraded, tmp_path / "bad")
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert "check failed" in bad.stderr
    suite = ET.parse(tmp_path / "bad" / "check.xml").getroot()
    assert int(suite.get("failures")) >= 1


def test_recording_does_not_change_the_rollout():
    model = load_model("tinyworld")
    trajs = make_trajectories(["orbit", "revisit"], "evaluation", 2, 24)
    plain, _ = rollout_batch(as_world(model), trajs, KVCache(model.cfg.num_layers, 16, 1), torch.device("cpu"))
    info = as_world(model).info
    recorder = Recorder.create(info, sample_tokens=64)
    cache = RecordingCache(model.cfg.num_layers, 16, 1, recorder, Trace(plan_trace(info, 2, 8, 512, 1 << 30)))
    recorded, _ = rollout_batch(as_world(model), trajs, cache, torch.device("cpu"))
    assert torch.equal(plain, recorded)
    assert int(recorder.stats.tensors["k.count"][0]) == 2 * 24 * 16 - 2 * 16  # every appended frame's tokens
    assert cache.trace.num_frames == 8


def test_report_schema(tmp_path):
    from calibrate.config import Config, TrajectoriesConfig
    from calibrate.pipeline import evaluate_and_report, resolve_schemes

    cfg = Config(task="compare")
    cfg.trajectories = TrajectoriesConfig(families=["static", "revisit"], num_trajectories=2, num_frames=20)
    cfg.eval.strips = True
    cfg.eval.save_frames = True
    model = load_model("tinyworld")
    recipes = resolve_schemes(cfg, ["fp16", "naive2"], model, torch.device("cpu"))
    rep = evaluate_and_report(cfg, tmp_path, recipes, model, torch.device("cpu"), "test")
    data = json.loads((tmp_path / "report.json").read_text())  # strict JSON: no NaN/inf
    assert data == json.loads(json.dumps(rep)) and data["schema"] == "kv-eval-report/1"
    for name in ("fp16", "naive2"):
        s = data["schemes"][name]
        assert set(s) == {"recipe", "memory", "metrics", "per_frame"}
        m = s["metrics"]
        for key in ("psnr_ref", "ssim_ref", "psnr_gt"):
            assert set(m[key]) == {"windows", "first16", "all"}
            assert set(m[key]["all"]) == {"mean", "p95", "worst"}
        assert m["flicker_static"]["quant"] is not None and m["revisit"]["fp"] is not None
        assert len(m["attention"]["kl"]) == model.cfg.num_layers
        assert s["memory"]["bytes"] == s["memory"]["predicted_bytes"]
        assert len(s["per_frame"]["psnr_ref"]) == 20
    assert data["schemes"]["fp16"]["memory"]["ratio_to_fp16"] == 1.0
    for f in ("report.md", "psnr_ref.png", "flicker.png", "attention_kl.png", "strip_naive2.gif"):
        assert (tmp_path / f).stat().st_size > 0
    # anyone can recompute a metric from the saved frames
    from safetensors.torch import load_file

    from calibrate.evaluate.metrics import psnr

    frames = load_file(str(tmp_path / "frames.safetensors"))
    recomputed = psnr(frames["naive2.batch0.quantized"], frames["reference.batch0"]).mean(0)
    torch.testing.assert_close(recomputed, torch.tensor(data["schemes"]["naive2"]["per_frame"]["psnr_ref"], dtype=recomputed.dtype))


def test_the_criteria_table_shows_a_tiny_threshold_instead_of_zero():
    """A tiny random model's flicker (1e-6) printed with 4 decimals read `0.0000 <= 0.0000`."""
    from calibrate import gate

    table = gate.markdown_table([
        {"name": "psnr_ref_all", "measured": 46.75889, "threshold": 45.75889, "comparison": ">=", "passed": True},
        {"name": "flicker", "measured": 3.21e-06, "threshold": 4.0e-06, "comparison": "<=", "passed": True}])
    assert "| psnr_ref_all | 46.7589 | >= 45.7589 | pass |" in table
    assert "| flicker | 3.210e-06 | <= 4.000e-06 | pass |" in table


def test_a_check_replays_the_counts_the_recipe_recorded_and_refuses_others():
    """Thresholds measured on 2 x 24 frames are compared on 2 x 24 (the counts the recipe recorded),
    and refused on check.yaml's 4 x 128 or on 2 x 8. The first version read the counts from the
    metrics dict instead of its `trajectories` and refused every recipe not measured on 4 x 128."""
    from dataclasses import replace

    from calibrate import gate
    from calibrate.config import Config

    recorded = {"psnr_ref_all": 40.0, "flicker": 0.003, "trajectories": {"num_trajectories": 2, "num_frames": 24}}
    cfg = gate.check_trajectories(Config(), recorded["trajectories"])
    assert (cfg.trajectories.num_trajectories, cfg.trajectories.num_frames) == (2, 24)
    gate.check_comparable(cfg, recorded)
    for other in (gate.check_trajectories(Config()), replace(cfg, trajectories=replace(cfg.trajectories, num_frames=8))):
        with pytest.raises(ValueError, match=r"measured on check \(2 x 24 frames\)"):
            gate.check_comparable(other, recorded)
    given = replace(other.check, min_psnr_db=30.0, max_flicker=0.01)
    gate.check_comparable(replace(other, check=given), recorded)  # both thresholds given: any set
