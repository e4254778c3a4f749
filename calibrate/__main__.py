"""`python -m calibrate`: compose the Hydra config, validate it, dispatch on `task`.

User errors (bad config values, unreadable files, a recipe for another model) print one line
on stderr and exit 2; `task=check` exits 1 on a quality regression. Outputs go to Hydra's run
dir (default artifacts/runs/<task>/<time>, override with hydra.run.dir=...); the process never
changes its working directory.

Configs: the top-level `conf/` of a source checkout (editable install), else the copy that a
regular install places inside the package as `calibrate/conf` (pyproject maps it there).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from calibrate.config import CONF_DIR


log = logging.getLogger("calibrate")


class CheckFailed(Exception):
    """task=check found a regression (exit 1)."""


def run(cfg: DictConfig) -> dict:
    from calibrate import pipeline
    from calibrate.config import to_config
    from calibrate.io import write_text_atomic

    config = to_config(cfg)
    if config.quant.preset != "ours" and "fit.budget_bits" in _command_line_keys():
        config.quant.budget_bits = config.fit.budget_bits  # a budget requested for a preset: it must meet it
    out_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    task = getattr(pipeline, f"run_{config.task}", None)
    if task is None:
        raise ValueError(f"task '{config.task}' is not implemented yet")
    result = task(config, out_dir)
    # written once the task succeeded, so a failed rerun never relabels an earlier run's outputs
    write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(config)))
    if config.task == "check" and not result.get("passed", False):
        raise CheckFailed(result.get("summary", "check failed"))
    return result


def _command_line_keys() -> set[str]:
    """Keys set by command-line overrides (`key=value`, `+key=value`), as Hydra recorded them."""
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        result = run(cfg)
    except CheckFailed as e:
        print(f"check failed: {e}", file=sys.stderr)
        sys.exit(1)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: finished work is kept in the run directory", file=sys.stderr)
        sys.exit(130)
    log.info("done: %s", ", ".join(f"{k}={v}" for k, v in result.items() if isinstance(v, (str, int, float, bool))))


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
