"""The recipes that ship with calibrate, found by name from any directory.

A source checkout keeps them in `recipes/` at the repository root; a regular (non-editable)
install places the same files inside the package as `calibrate/recipes` (pyproject's
package-dir), where no relative path reaches them. So `recipe=` (and a scheme in `schemes=[...]`)
takes a bare name: `recipe=tinyworld-ours-2bit` is the shipped `tinyworld-ours-2bit.safetensors`
wherever the command runs. A path still works; a file of that name in the working directory
wins over a shipped recipe.
"""

from __future__ import annotations

import os
from pathlib import Path

# the top-level recipes/ of a source checkout (it holds the format spec), else the installed copy
_SOURCE = Path(__file__).resolve().parent.parent / "recipes"
RECIPE_DIR = _SOURCE if (_SOURCE / "FORMAT.md").is_file() else Path(__file__).resolve().parent / "recipes"
SUFFIX = ".safetensors"


def shipped_recipes() -> dict[str, Path]:
    """Shipped recipe names (file stems) and their files."""
    return {p.stem: p for p in sorted(RECIPE_DIR.glob(f"*{SUFFIX}"))}


def is_shipped_name(text: str) -> bool:
    return Path(text).name == str(text) and Path(text).name.removesuffix(SUFFIX) in shipped_recipes()


def resolve_recipe(text: str | os.PathLike) -> Path:
    """The recipe file `text` names: an existing file as given; a bare name (no directory part) that
    is no file here: the shipped recipe of that name, with or without `.safetensors`. A bare name
    that is neither raises one line listing the shipped recipes; a path with a directory part is
    returned as given (loading it names a missing file)."""
    path = Path(text)
    if path.is_file() or path.name != str(text):
        return path
    shipped = shipped_recipes()
    name = path.name.removesuffix(SUFFIX)
    if name in shipped:
        return shipped[name]
    raise ValueError(f"recipe '{text}': no such file here and no shipped recipe of that name; shipped recipes: "
                     f"{', '.join(shipped) or 'none'} (or give a path)")


__all__ = ["RECIPE_DIR", "is_shipped_name", "resolve_recipe", "shipped_recipes"]
