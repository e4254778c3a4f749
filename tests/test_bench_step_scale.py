"""benchmarks.step_scale: the scaled recipe changes only the units, exactly; bad scales exit 2."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.step_scale import main, scaled

SHIPPED = Path(__file__).resolve().parents[1] / "recipes" / "tinyworld-ours-2bit.safetensors"


def test_only_the_units_are_scaled(tmp_path):
    out = scaled(SHIPPED, 1.5, tmp_path / "x.safetensors")
    a, b = safe_open(str(SHIPPED), "pt"), safe_open(str(out), "pt")
    assert a.metadata() == b.metadata() and set(a.keys()) == set(b.keys())
    units = [k for k in a.keys() if k.endswith(".unit")]
    assert len(units) == 8
    for k in a.keys():
        want = a.get_tensor(k) * 1.5 if k in units else a.get_tensor(k)
        assert torch.equal(b.get_tensor(k), want)


@pytest.mark.parametrize("scales", ["1,abc", "0,1", "-1"])
def test_bad_scales_exit_2_in_one_line(scales, capsys):
    assert main(["--scales", scales]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --scales") and "\n" not in err


def test_a_missing_recipe_exits_2(tmp_path, capsys):
    assert main(["--recipe", str(tmp_path / "none.safetensors")]) == 2
    assert "no such recipe file" in capsys.readouterr().err
