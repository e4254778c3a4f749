"""Shipped recipes are found by name from any directory, in a checkout and after a regular install,
and are fits of today's defaults."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from calibrate import shipped
from calibrate.config import CONF_DIR, to_config
from calibrate.recipe import load_recipe
from calibrate.shipped import RECIPE_DIR, resolve_recipe, shipped_recipes

REPO = Path(__file__).resolve().parents[1]


def test_shipped_recipes_are_the_recipe_files_of_the_package():
    names = shipped_recipes()
    assert "tinyworld-ours-2bit" in names
    assert set(names) == {p.stem for p in (REPO / "recipes").glob("*.safetensors")}
    assert all(p.parent == RECIPE_DIR and p.is_file() for p in names.values())


def test_resolve_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # another directory than the checkout
    ours = RECIPE_DIR / "tinyworld-ours-2bit.safetensors"
    assert resolve_recipe("tinyworld-ours-2bit") == ours
    assert resolve_recipe("tinyworld-ours-2bit.safetensors") == ours
    assert resolve_recipe(str(ours)) == ours  # a path works as before
    missing = tmp_path / "sub" / "mine.safetensors"
    assert resolve_recipe(str(missing)) == missing  # a path is returned as given: loading it names what is missing
    with pytest.raises(ValueError, match=r"recipe 'nope': no such file here and no shipped recipe of that name; "
                                         r"shipped recipes: .*tinyworld-ours-2bit"):
        resolve_recipe("nope")
    (tmp_path / "tinyworld-ours-2bit").write_bytes(b"mine")  # a file here wins over a shipped name
    assert resolve_recipe("tinyworld-ours-2bit") == Path("tinyworld-ours-2bit")


def test_help_lists_every_shipped_recipe():
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "calibrate", "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    for name in shipped_recipes():
        assert name in run.stdout


def test_an_unknown_recipe_name_is_one_line(tmp_path, capsys, monkeypatch):
    from test_cli import nonempty_lines, run_in_process

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, _, err = run_in_process(["task=evaluate", "recipe=tinyworld-ours", f"hydra.run.dir={tmp_path}"], capsys)
    lines = nonempty_lines(err)
    assert code == 2 and "Traceback" not in err
    assert lines[-1].startswith("error: recipe 'tinyworld-ours': no such file here") and "tinyworld-ours-2bit" in lines[-1]


def test_pyproject_lists_every_package():
    """setuptools installs the packages pyproject.toml names, not the folders it finds: a new
    subpackage left out of the list is missing from a regular install (calibrate.codes was)."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "calibrate").rglob("__init__.py")}
    assert found - listed == set()


def test_a_regular_install_resolves_shipped_names_from_another_directory(tmp_path):
    """`pip install .` (not editable) into a folder, then run from elsewhere: the bare name is the
    packaged recipe, TinyWorld's weights come from the package too."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("calibrate", "conf", "recipes", "artifacts/models"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                          "--target", str(target), str(src)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    assert (target / "calibrate" / "recipes" / "tinyworld-ours-2bit.safetensors").is_file()
    # every package of the checkout is installed (an editable install of the checkout in this
    # environment would otherwise serve a missing subpackage to the imports below)
    assert {p.relative_to(src) for p in (src / "calibrate").rglob("__init__.py")} <= \
        {p.relative_to(target) for p in (target / "calibrate").rglob("__init__.py")}
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    where = subprocess.run([sys.executable, "-c", "import calibrate.shipped as s; print(s.RECIPE_DIR)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=300)
    assert Path(where.stdout.strip()) == target / "calibrate" / "recipes", where.stderr
    run = subprocess.run([sys.executable, "-m", "calibrate", "task=evaluate", "recipe=tinyworld-ours-2bit",
                          "trajectories=quick", "trajectories.num_trajectories=1", "trajectories.num_frames=8",
                          "eval.strips=false", "eval.attention=false", f"hydra.run.dir={work / 'run'}"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (work / "run" / "report.json").is_file()
    assert "tinyworld-ours-2bit" in (work / "run" / "report.json").read_text()


def test_shipped_module_finds_the_checkout_recipes():
    assert shipped.RECIPE_DIR == REPO / "recipes"


@pytest.mark.parametrize("name", ["tinyworld-ours-2bit", "wanworld-ours-2bit"])
def test_shipped_recipes_are_fits_of_todays_default(name):
    """A shipped `ours` recipe records the fit config it came from: today's defaults for its
    model, so a changed default means a refit (and the reports that quote the recipe)."""
    recorded = json.loads(load_recipe(resolve_recipe(name)).metadata["calibration"])["config"]
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        today = to_config(compose(config_name="config", overrides=[f"model={recorded['model']['name']}"]))
    assert recorded["fit"] == json.loads(json.dumps(asdict(today.fit)))
