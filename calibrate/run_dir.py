"""A Hydra callback that checks the run directory before Hydra creates it.

Hydra creates the run dir before calling the task, so an unwritable `hydra.run.dir` would
otherwise surface as Hydra's own traceback (exit 1). This turns it into the CLI's contract: one
line on stderr and exit 2.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback


class RunDirCheck(Callback):
    def on_run_start(self, config, **kwargs) -> None:
        out = Path(str(config.hydra.run.dir))
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):  # writable, also where root ignores permissions
                pass
        except OSError as e:
            print(f"error: cannot write the run directory {out}: {e.strerror or e}", file=sys.stderr)
            sys.exit(2)
