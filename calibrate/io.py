"""Atomic file writes: a reader (or a crash) never sees a half-written recipe, stats file or plot.

Everything the project writes goes through here: a temporary file next to the target,
flushed and fsynced, then renamed onto the target (a rename within one directory is atomic on
POSIX and Windows). On any error the temporary file is removed and the target is untouched.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(f)`` on a temporary file next to ``path``, then rename it onto ``path``.

    The parent directory is created if needed; on any error the temporary file is removed and
    ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    return write_atomic(path, lambda f: f.write(data))


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file as bytes, deterministic: same tensors and metadata -> same bytes.

    safetensors writes the `__metadata__` map in hash order, so two saves of equal inputs can
    differ; the header JSON is re-serialized here with sorted keys (the tensors' offsets do not
    change) and padded with spaces to a multiple of 8 bytes, as the format allows.
    """
    import json
    import struct

    from safetensors.torch import save

    blob = save({k: tensors[k] for k in sorted(tensors)}, metadata=metadata)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.dumps(json.loads(blob[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + blob[8 + n :]
