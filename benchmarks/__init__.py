"""Benchmark scripts: each prints a table, writes JSON + Markdown, and says how to rerun it.

They measure the project and write the reports under `artifacts/benchmarks/`; they are not part
of the installed tool. Run them from the repository root: `python -m benchmarks.<name>`.
"""

import os
import platform
import shlex
import sys
from pathlib import Path


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reruns `python -m benchmarks.<module>` with `argv` (default: this
    process's arguments), shell-quoted so that it can be pasted as it is."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def model_config(model: str):
    """The default `Config` with `model=<model>` (a conf/model preset); ValueError in one line if
    there is no such preset."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from calibrate.config import CONF_DIR, to_config

    try:
        with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
            return to_config(compose(config_name="config", overrides=[f"model={model}"]))
    except HydraException as err:
        raise ValueError(f"--model {model}: {str(err).splitlines()[0]}") from None


def shipped_setup(model: str, recipe_path: str | None = None, device=None):
    """(cfg, world, recipe path, recipe) for the studies that roll a model out with a recipe: the
    `model` preset's world and its shipped recipe (or `recipe_path`). ValueError in one line for an
    unknown preset or an unreadable recipe."""
    import torch

    from calibrate import pipeline
    from calibrate.adapters import as_world
    from calibrate.recipe import load_recipe

    cfg = model_config(model)
    world = as_world(pipeline.load_world(cfg, device or torch.device("cpu")))
    path = Path(recipe_path) if recipe_path else pipeline.ours_recipe(world.info)
    try:
        return cfg, world, path, load_recipe(path, world.info)
    except OSError as err:
        raise ValueError(str(err)) from None


def sink_code_setup(model: str, recipe_path: str | None, use: str):
    """`shipped_setup` for a study of the sink code's uses (`use`: what it does with it): ValueError in
    one line also when the recipe has no sink code (format 1.3)."""
    cfg, world, path, recipe = shipped_setup(model, recipe_path)
    if recipe.tensor(0, "k", "sink_unit") is None:
        raise ValueError(f"{path} has no sink code (format 1.3) {use}")
    return cfg, world, path, recipe


def window_note(label: str, frames: int) -> str:
    """" (the nominal label: frames a-b here)" when a window `label` "a-c" is cut short by a rollout
    of `frames` frames (metrics.window_means keeps the nominal label), else ""."""
    start, _, stop = label.partition("-")
    return f" (the nominal label: frames {start}-{frames - 1} here)" if stop.isdigit() and frames < int(stop) else ""


def report_name(stem: str, model: str) -> str:
    """A report's file stem: `stem` for TinyWorld, `<stem>_<model>` for another model."""
    return stem if model == "tinyworld" else f"{stem}_{model}"


def write_report(out_dir: str | Path, name: str, markdown: str, data) -> None:
    """`<name>.md` and `<name>.json` under `out_dir`, each written atomically; the Markdown printed."""
    import json

    from calibrate.io import write_text_atomic

    write_text_atomic(Path(out_dir) / f"{name}.md", markdown)
    write_text_atomic(Path(out_dir) / f"{name}.json", json.dumps(data, indent=1))
    print(markdown)


def cpu_model() -> str:
    """The CPU's model name, family and model number (x86 /proc/cpuinfo), and whether it has AVX-512."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    avx512 = "avx512f" in info.get("flags", "").split()
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, "
            f"{'AVX-512' if avx512 else 'no AVX-512'}), {os.cpu_count()} cores")
