"""`python -m calibrate`: compose the Hydra config, validate it, dispatch on `task`.

User errors (bad config values, unknown keys or group options, unreadable files, a recipe for
another model) print one line on stderr and exit 2; `task=check` exits 1 on a quality
regression. Outputs go to Hydra's run dir (default artifacts/runs/<task>/<time>, override with
hydra.run.dir=...); the process never changes its working directory.

The run's records (`config.yaml`, and Hydra's `.hydra/config.yaml`, `hydra.yaml`,
`overrides.yaml`) are written once the task has succeeded: Hydra's own copy, written before
the task runs, is turned off (`hydra.output_subdir: null` in conf/config.yaml), so a failed,
interrupted or killed rerun into a finished run's directory never relabels its outputs.

Torch's CPU threads: `OMP_NUM_THREADS` when set, else the CPUs this process may use that other
work is not already keeping busy (`torch_threads`); the choice is logged.

Configs: the top-level `conf/` of a source checkout (editable install), else the copy that a
regular install places inside the package as `calibrate/conf` (pyproject maps it there).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from calibrate.config import CONF_DIR


log = logging.getLogger("calibrate")


class CheckFailed(Exception):
    """task=check found a regression (exit 1)."""


# ---- torch threads ------------------------------------------------------------------------------
def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup (v2) CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 limit to read
        pass
    return max(cpus, 1)


def torch_threads() -> tuple[int, str]:
    """(intra-op threads, why): `OMP_NUM_THREADS` when set; else the usable CPUs less the load
    other work puts on them (the 1-minute load average), at least 1.

    Torch defaults to one thread per physical core. On a CPU that other processes keep busy its
    threads wait on each other at every operation (TinyWorld's operations are small and many):
    measured on 2 cores with one other busy process, an evaluation took 16x longer with 2 threads
    than with 1. Results did not change with the thread count where checked (a slow test in
    tests/test_reliability.py; README: "Runs, resuming and threads").
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cpus = usable_cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = max(1, min(cpus, cpus - round(load)))
    return n, f"{cpus} usable CPUs, load average {load:.1f}; set OMP_NUM_THREADS to choose"


def set_torch_threads() -> None:
    import torch

    n, why = torch_threads()
    torch.set_num_threads(n)
    log.info("torch threads: %d (%s)", n, why)


# ---- overrides checked before Hydra composes --------------------------------------------------
def _schema_keys() -> list[str]:
    """Every dotted key of the typed config (calibrate/config.py), nested groups included."""
    from calibrate.config import Config

    out = []

    def walk(node, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            out.append(path)
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                walk(child, path + ".")

    walk(OmegaConf.structured(Config), "")
    return out


def _groups() -> dict[str, list[str]]:
    """Config groups (folders of conf/) and their options."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(CONF_DIR.iterdir())
            if d.is_dir() and any(d.glob("*.yaml"))}


def check_overrides(args: list[str]) -> None:
    """Unknown keys, unknown group options and unparseable overrides, as one `ValueError` line.

    Hydra rejects them too, but with several lines and exit 1; this checks the command line with
    Hydra's own parsers first, against the typed schema and the conf/ folders. Overrides of
    Hydra's own settings (`hydra.*`) and forms it handles specially (`group@package`, deletions,
    glob sweeps) are left to Hydra.
    """
    from hydra._internal.utils import get_args_parser  # Hydra's argv parser (hydra-core 1.3): the same split it makes
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    parsed_args = get_args_parser().parse_args(args)
    if parsed_args.shell_completion:  # its "overrides" are install=bash, query=...: not config keys
        return
    parser, parsed = OverridesParser.create(), []
    for override in parsed_args.overrides:
        try:
            parsed += parser.parse_overrides([override])
        except HydraException as e:
            raise ValueError(f"config: cannot parse the override '{override}': {str(e).splitlines()[0]}") from None
    groups = _groups()
    keys = None
    for o in parsed:
        key = o.key_or_group
        if key == "hydra.run.dir" and not o.is_sweep_override() and not str(o.value()).strip():
            raise ValueError("config: hydra.run.dir is empty (it would write into the current directory); give the run's "
                             "directory, or leave it out for artifacts/runs/<task>/<time>")
        if key == "hydra" or o.is_hydra_override() or o.package is not None or o.is_delete():
            continue
        if key in groups:
            if o.is_sweep_override() and not (o.is_choice_sweep() and o.value_type != ValueType.GLOB_CHOICE_SWEEP):
                continue  # ranges and globs of options: Hydra expands them
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
            for value in values:
                if value not in groups[key]:
                    raise ValueError(f"config: unknown option '{value}' for {key}; choose one of {', '.join(groups[key])}")
            continue
        keys = keys if keys is not None else _schema_keys()
        if key not in keys:
            close = difflib.get_close_matches(key, keys + list(groups), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"config: unknown key '{key}'{hint}; `python -m calibrate --cfg job` lists them all")
    _check_keys_in_composition(parsed, groups)


def _check_keys_in_composition(parsed: list, groups: dict[str, list[str]]) -> None:
    """A key the schema knows that the chosen options leave out (`model.wan.*` with
    model=tinyworld; `quant.budget_bits`, which the fitter sets), as one line instead of
    Hydra's several. Composes the config with the command line's group choices."""
    from hydra import compose, initialize_config_dir

    if any(o.is_sweep_override() for o in parsed):
        return  # a multirun: Hydra composes each job and reports its own errors
    choices = [o.input_line for o in parsed if o.key_or_group in groups and o.package is None]
    values = [o for o in parsed if o.key_or_group not in groups and not o.is_hydra_override() and o.key_or_group != "hydra"
              and o.package is None and not o.is_delete() and not o.is_add() and not o.is_force_add()]
    if not values:
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=choices)
    for o in values:
        if OmegaConf.select(composed, o.key_or_group, default=_ABSENT) is _ABSENT:
            key, model = o.key_or_group, composed.model.name
            if key.startswith("model.wan.") and "wan" not in composed.model:
                raise ValueError(f"config: model={model} has no setting '{key}': model.wan.* configures the Wan "
                                 f"models (model=wan_diffusers, wanworld)")
            if key == "quant.budget_bits":
                raise ValueError("config: quant.budget_bits is not set on the command line; give fit.budget_bits "
                                 "(a preset must then fit in it)")
            if key.startswith("model."):
                raise ValueError(f"config: model={model} has no setting '{key}' (conf/model/{model}.yaml lists its settings)")
            raise ValueError(f"config: '{key}' is not a setting with these options (model={model})")


_ABSENT = object()


# ---- the task ---------------------------------------------------------------------------------
def write_records(cfg: DictConfig, config, out_dir: Path) -> None:
    """The run's records, once the task succeeded: the typed config and what Hydra would have
    written to `.hydra/` before the task (composed config, Hydra's config, the overrides)."""
    from calibrate.io import write_text_atomic

    write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(config)))
    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    records = out_dir / ".hydra"
    write_text_atomic(records / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text_atomic(records / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))
    write_text_atomic(records / "overrides.yaml", OmegaConf.to_yaml(hc.overrides.task))


def task_function(task: str):
    """`run_<task>`, imported on demand: task=capacity answers in seconds, so it does not pay for
    importing the pipeline's evaluation and plotting stack."""
    if task == "calibrate":
        from calibrate.calibration import run_calibrate

        return run_calibrate
    if task == "capacity":
        from calibrate.capacity import run_capacity

        return run_capacity
    if task == "train_world":
        from calibrate.train_world import run_train_world

        return run_train_world
    from calibrate import pipeline

    return getattr(pipeline, f"run_{task}", None)


def run(cfg: DictConfig) -> dict:
    from calibrate.config import to_config

    config = to_config(cfg)
    if config.quant.preset != "ours" and "fit.budget_bits" in _command_line_keys():
        config.quant.budget_bits = config.fit.budget_bits  # a budget requested for a preset: it must meet it
    out_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    task = task_function(config.task)
    if task is None:
        raise ValueError(f"task '{config.task}' is not implemented yet")
    result = task(config, out_dir)
    # written once the task succeeded, so a failed rerun never relabels an earlier run's outputs;
    # of several processes (torchrun, accelerate launch) the main one writes the run directory
    if int(os.environ.get("RANK", "0")) == 0:
        write_records(cfg, config, out_dir)
    if config.task == "check" and not result.get("passed", False):
        raise CheckFailed(result.get("summary", "check failed"))
    return result


def _command_line_keys() -> set[str]:
    """Keys set by command-line overrides (`key=value`, `+key=value`), as Hydra recorded them."""
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def _exit(line: str, code: int) -> None:
    """One line on stderr, then exit. On a terminal it starts on a line of its own: a progress bar
    the failure interrupted leaves the cursor at the end of its own line."""
    print(("\n" if sys.stderr.isatty() else "") + line, file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        set_torch_threads()
        result = run(cfg)
    except CheckFailed as e:
        _exit(f"check failed: {e}", 1)
    except (ValueError, OSError) as e:
        _exit(f"error: {e}", 2)
    except KeyboardInterrupt:
        _exit("interrupted: finished work is kept in the run directory; rerun the same command with the same "
              "hydra.run.dir to resume", 130)
    log.info("done: %s", ", ".join(f"{k}={v}" for k, v in result.items() if isinstance(v, (str, int, float, bool))))


def main() -> None:
    if sys.argv[1:] == ["--version"]:  # Hydra's own flag names only Hydra
        from importlib.metadata import version

        print(f"calibrate {version('calibrate')} (Hydra {version('hydra-core')}, torch {version('torch')})")
        return
    try:
        check_overrides(sys.argv[1:])
    except ValueError as e:
        _exit(f"error: {e}", 2)
    _hydra_main()


if __name__ == "__main__":
    main()
