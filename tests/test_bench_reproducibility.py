"""benchmarks.reproducibility's diff: what it calls equal, within the bounds, and outside them."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.reproducibility import diff, main

SHIPPED = Path(__file__).resolve().parents[1] / "recipes" / "tinyworld-ours-2bit.safetensors"


def variant(tmp_path: Path, change: dict, metadata: dict | None = None) -> Path:
    """The shipped recipe with tensors replaced by `change` (name -> function of the tensor)."""
    f = safe_open(str(SHIPPED), "pt")
    tensors = {k: change.get(k, lambda t: t)(f.get_tensor(k)) for k in f.keys()}
    path = tmp_path / "variant.safetensors"
    save_file(tensors, str(path), metadata={**f.metadata(), **(metadata or {})})
    return path


def test_a_recipe_equals_itself():
    d = diff(SHIPPED, SHIPPED)
    assert all(d["metadata"].values()) and d["same_names"]
    assert all(r["differ"] == 0 and r["within"] for r in d["roles"].values())
    assert sum(r["tensors"] for r in d["roles"].values()) == 72  # 4 layers x K, V x 9 predictive roles (with the sink code)


def test_floats_within_the_bound_pass_and_outside_fail(tmp_path):
    near = variant(tmp_path, {"layers.0.k.rotation": lambda t: t + 5e-5, "layers.1.v.mean": lambda t: t + 2e-6})
    d = diff(near, SHIPPED)
    assert d["roles"]["rotation"]["differ"] == 1 and d["roles"]["rotation"]["within"]
    assert d["roles"]["rotation"]["max_abs"] == pytest.approx(5e-5, rel=1e-2)
    assert d["roles"]["mean"]["differ"] == 1 and not d["roles"]["mean"]["within"]  # 2e-6 > 1e-6


def test_an_integer_or_a_choice_that_differs_fails(tmp_path, capsys):
    path = variant(tmp_path, {"layers.2.v.channel_bits": lambda t: t.flip(-1)}, {"scheme": "{}"})
    d = diff(path, SHIPPED)
    assert d["roles"]["channel_bits"]["differ"] == 1 and not d["roles"]["channel_bits"]["within"]
    assert d["metadata"]["scheme"] is False and d["metadata"]["model"] is True
    assert main(["--recipe", str(path), "--out", str(tmp_path / "r.md")]) == 0
    assert "outside what the README states" in (tmp_path / "r.md").read_text()
    assert main(["--recipe", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such recipe file" in capsys.readouterr().err
