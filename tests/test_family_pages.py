"""Every `python -m calibrate` command of the model-family pages (docs/*.md) runs.

The commands are read from the pages themselves, so a page cannot drift from what works. They run
(in this process, through the CLI's entry point) from a scratch directory where the files they
name exist: each checkpoint is the tiny random Wan
saved in that family's published layout and wrapping (original Wan keys under `model.`, wrapped
in `{"generator": ...}`), the prompt embedding a tiny one. Capacity commands run as written (real
shapes, no weights). The others get overrides appended that shrink them to the tiny model on CPU
(its config, a 12x12 latent grid (SSIM needs 11x11), float32, one denoising step, short trajectories), which win over
the page's own values; everything else (presets, chunking, windows, sinks, the check set) is the
page's.
"""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("diffusers")

from calibrate.adapters import wan_diffusers as wan  # noqa: E402
from test_wan_checkpoint import original_layout  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGES = ("self-forcing.md", "causvid-longlive.md", "matrix-game-2.md")
SHRINK = ["model.wan.latent_height=12", "model.wan.latent_width=12", "model.wan.dtype=float32",
          "model.wan.denoise_timesteps=[1000]"]
SHRINK_FIT = ["trajectories=quick", "trajectories.num_frames=24", "trajectories.num_trajectories=2",
              "fit.closed_loop_frames=24", "fit.closed_loop_trajectories=1", "fit.trace_frames=8",
              "fit.closed_loop_scales=[1.0]", "fit.intra_mults=[1.0]", "fit.inter_mults=[1.0]"]
SHRINK_EVAL = ["eval.strips=false", "eval.attention=false"]


def page_commands(page: str) -> list[list[str]]:
    """The arguments of every `python -m calibrate` command in the page's bash blocks."""
    text = (REPO / "docs" / page).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("python -m calibrate"):
                commands.append(shlex.split(line)[3:])
    return commands


def test_every_page_has_commands_and_the_readme_links_them():
    readme = (REPO / "README.md").read_text()
    for page in PAGES:
        commands = page_commands(page)
        assert any("task=capacity" in c for c in commands), page
        assert f"docs/{page}" in readme, page
    assert all(any("task=check" in c for c in page_commands(p)) for p in PAGES[:2])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory holding every file the pages name, as the tiny random Wan."""
    d = tmp_path_factory.mktemp("pages")
    model = wan.tiny_transformer()
    model.save_pretrained(d / "tiny")
    wrapped = {"generator": {f"model.{k}": v for k, v in original_layout(model.state_dict()).items()}}
    names = set()
    for page in PAGES:
        for args in page_commands(page):
            names |= {a.split("=", 1)[1] for a in args if a.startswith("model.weights=")}
    for name in names:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        if "Matrix-Game" in name:  # its action modules are not diffusers' Wan: the page says it is refused
            state = {**original_layout(model.state_dict()), "blocks.0.action_model.mouse_mlp.0.weight": torch.zeros(4, 4)}
            save_file(state, d / name)
        else:
            torch.save(wrapped, d / name)
    save_file({"text_embedding": torch.randn(8, wan.TINY["text_dim"])}, d / "prompt_umt5.safetensors")
    return d


def calibrate(args: list[str], cwd: Path, capsys, monkeypatch) -> tuple[int, str]:
    """`python -m calibrate ARGS` run from `cwd`, in this process (test_cli.run_in_process: the same
    entry point, exit code and stderr, without a new interpreter per command): (exit code, stderr)."""
    from test_cli import run_in_process

    monkeypatch.chdir(cwd)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_in_process(args, capsys)
    return code, err


@pytest.mark.parametrize("page", PAGES)
def test_page_commands_make_valid_configs(page):
    """Every command's overrides compose and validate as written (the fast half of the next test:
    a renamed key, or a value config.validate refuses, fails here)."""
    from hydra import compose, initialize_config_dir

    from calibrate.config import CONF_DIR, to_config, validate

    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        for args in page_commands(page):
            cfg = to_config(compose(config_name="config", overrides=[a for a in args if not a.startswith("hydra.")]))
            validate(cfg)


# the two pages that fit and check take 27 and 44 s on 1 thread: slow (python -m pytest -m slow)
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p != "matrix-game-2.md" else p for p in PAGES])
def test_page_commands_run_on_the_tiny_wan(page, scratch, capsys, monkeypatch):
    for i, args in enumerate(page_commands(page)):
        task = next((a.split("=", 1)[1] for a in args if a.startswith("task=")), "calibrate")
        fitted = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), None)
        extra = [f"model.wan.config={scratch / 'tiny'}", *SHRINK]  # the tiny model a recipe was fitted for
        if task == "capacity" and fitted is None:
            extra = []  # real shapes, no weights: as written
        elif task != "capacity":
            extra += SHRINK_EVAL
        if task == "calibrate":
            extra += SHRINK_FIT
        if not any(a.startswith("hydra.run.dir=") for a in args):
            extra.append(f"hydra.run.dir=runs/{page}.{i}")
        code, err = calibrate([*args, *extra], scratch, capsys, monkeypatch)
        where = f"{page}: python -m calibrate {' '.join(args)}"
        if any("Matrix-Game" in a for a in args):  # the page says this one is refused in one line
            lines = [line for line in err.splitlines() if line.strip()]
            assert code == 2 and lines[-1].startswith("error: "), (where, err)
            assert "tensors diffusers' WanTransformer3DModel does not" in lines[-1], (where, lines)
            continue
        assert code == 0, (where, err[-3000:])
        if task == "capacity":
            run_dir = scratch / next(a.split("=", 1)[1] for a in extra if a.startswith("hydra.run.dir="))
            rep = json.loads((run_dir / "capacity.json").read_text())
            assert rep["model"]["chunk_frames"] == 3
            if fitted is None:
                assert rep["model"]["num_layers"] == 30
            else:  # the page's own fitted recipe, of this (tiny) shape: counted exactly
                row = next(r for r in rep["rows"] if r["scheme"] == Path(fitted).stem)
                assert row["counted"] == "exact" and row["origin"] == "recipe"
        if task == "calibrate":
            run_dir = scratch / next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))
            assert (run_dir / "recipe.safetensors").is_file()


def test_the_check_set_is_cut_to_whole_chunks():
    """task=calibrate records, and task=check replays, the check set; a model generating 3 latent
    frames per step gets its 128 frames cut to 126 (it used to fail at the very end of a calibration)."""
    from calibrate import gate
    from calibrate.config import Config, ModelConfig, validate
    from calibrate.adapters.wan_diffusers import WanSettings

    chunked = Config(task="check", recipe="r", model=ModelConfig(name="wan_diffusers", wan=WanSettings(chunk_frames=3)))
    validate(chunked)  # the default trajectory set (256 frames) is not what a check replays
    assert gate.check_trajectories(chunked).trajectories.num_frames == 126
    assert gate.check_trajectories(Config()).trajectories.num_frames == 128
    with pytest.raises(ValueError, match="chunk_frames=3 does not divide trajectories.num_frames=256"):
        validate(Config(task="stats", model=chunked.model))
