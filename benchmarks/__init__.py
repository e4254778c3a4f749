"""Benchmark scripts: each prints a table, writes JSON + Markdown, and says how to rerun it.

They measure the project and write the reports under `artifacts/benchmarks/`; they are not part
of the installed tool. Run them from the repository root: `python -m benchmarks.<name>`.
"""

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


def write_report(out_dir: str | Path, name: str, markdown: str, data) -> None:
    """`<name>.md` and `<name>.json` under `out_dir`, each written atomically; the Markdown printed."""
    import json

    from calibrate.io import write_text_atomic

    write_text_atomic(Path(out_dir) / f"{name}.md", markdown)
    write_text_atomic(Path(out_dir) / f"{name}.json", json.dumps(data, indent=1))
    print(markdown)
