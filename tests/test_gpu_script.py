"""benchmarks/gpu.py, the device script no CPU session can run for real: its steps on the CPU with
the tiny random Wan (--cpu-smoke), and its one line without a GPU."""

import json

import pytest
import torch

pytest.importorskip("diffusers")

from benchmarks import gpu  # noqa: E402


def test_cpu_smoke_runs_every_step_of_the_device_script(tmp_path):
    gpu.main(["--cpu-smoke", "--chunks", "2", "--window", "2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert [r["cache"] for r in res["rows"]] == ["KVCache (float32, the model's own)", "fast, fp16", "fast, naive2",
                                                 "fast, kivi2", "fast, predictive 2.5 bits", "fast, calibrated here"]
    cal = res["calibrate"]  # the compiler itself ran on the device: its phases, a bounded trace, a recipe in budget
    assert {"replay", "fit"} <= set(cal["phases"]) and cal["trace_slots"] > 0
    assert cal["bits_per_element"] <= 2.5 + 1e-9
    assert all(r["kv_bytes_equal_predicted"] for r in res["rows"][1:])
    assert all(v < 1e-2 for v in res["equivalence_rel_max"].values())  # bf16 cached == uncached
    assert res["rows"][0]["rollout_rel_rmse_vs_float"] == 0 and all(r["rollout_rel_rmse_vs_float"] < 0.05 for r in res["rows"])
    assert "| fast, predictive 2.5 bits |" in (tmp_path / "gpu_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_the_script_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--out", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0 and not list(tmp_path.iterdir())
