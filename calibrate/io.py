"""Files in and out: atomic writes, deterministic safetensors, and the versioned-file reader.

Everything the project writes goes through here: a temporary file next to the target,
flushed and fsynced, then renamed onto the target (a rename within one directory is atomic on
POSIX and Windows). On any error the temporary file is removed and the target is untouched.
A process killed mid-write (SIGKILL, power loss) cannot remove its temporary file; the name
carries the writer's process id (`.<target>.pid<N>.<random>.tmp`), and the next write into the
same directory removes those whose writer is no longer running.

Every file the project reads back (recipes, statistics, trajectories, weights) is a
safetensors file whose metadata names its `format` and `format_version` (major.minor: a
reader reads every minor version of its major). `read_versioned` opens one and checks both,
raising one line that names the file and what is wrong.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_TEMP = re.compile(r"^\..+\.pid(\d+)\.[^.]+\.tmp$")  # write_atomic's temporary names


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of `write_atomic` calls in `directory` whose process is gone
    (killed mid-write); returns what was removed. Another running writer's files are kept."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid() or _running(int(m.group(1))):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except FileNotFoundError:  # another writer cleaned it first
            pass
    return removed


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(f)`` on a temporary file next to ``path``, then rename it onto ``path``.

    The parent directory is created if needed; on any error the temporary file is removed and
    ``path`` is left as it was (an `OSError` that names no file, such as a full disk, is raised
    again naming ``path``). Temporary files of killed writers in that directory are removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.pid{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # a full disk names no file
            raise OSError(e.errno, e.strerror, str(path)) from e
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


def read_safetensors(path: str | os.PathLike, what: str,
                     error: type[ValueError] = ValueError) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file; `error` naming the file if it is missing or
    unreadable (`what` names the kind of file in the message: "recipe", "stats", ...)."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such {what} file")
    try:
        with safe_open(str(p), framework="pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a bad header
        raise error(f"{p}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


def check_format(path: str | os.PathLike, metadata: dict[str, str], fmt: str, version: str,
                 error: type[ValueError] = ValueError) -> None:
    """The file's `format` is `fmt` and its `format_version` has the major version of `version`."""
    if metadata.get("format") != fmt:
        raise error(f"{path}: format is {metadata.get('format')!r}, expected {fmt!r} (metadata field 'format')")
    found = metadata.get("format_version", "")
    if found.split(".")[0] != version.split(".")[0]:
        raise error(f"{path}: metadata field 'format_version' is {found!r}, this reader reads {version}")


def read_versioned(path: str | os.PathLike, fmt: str, version: str, what: str,
                   error: type[ValueError] = ValueError) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """`read_safetensors`, then `check_format`: the one way every versioned file is opened."""
    metadata, tensors = read_safetensors(path, what, error)
    check_format(path, metadata, fmt, version, error)
    return metadata, tensors
