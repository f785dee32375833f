"""Output files that appear whole or not at all.

Every file OptiML writes (converted and rewritten GGUF files, activation statistics, figures, pulled
models) is written under a temporary name in the destination's folder and renamed over the destination
only once complete: a process killed midway, a full disk or any error leaves the old file (or none) in
place. A process killed by a signal cannot remove its temporary file; the next write to the same path
removes the ones whose writer is no longer running (their names carry the writer's process id).
"""

from __future__ import annotations

import glob
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator


def process_alive(pid: int) -> bool:
    """Whether process `pid` is still running (its temporary files are then its own)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def check_new_output(out: str | os.PathLike, source: str | os.PathLike) -> str:
    """`out` as a path, after checking that it is not `source` itself and that its folder exists
    (ArgumentError otherwise): what a command that writes a new file from a model checks first."""
    # Imported here: the model registry (optiml.hub.registry) uses this module in a checkout whose native
    # module is not built (tools/fetch_models.py).
    from .._core import ArgumentError

    out = os.fspath(out)
    if os.path.abspath(out) == os.path.abspath(os.fspath(source)):
        raise ArgumentError(f"{out}: the output must be a new file, not the model itself")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ArgumentError(f"{out}: the output folder {folder} does not exist")
    return out


def remove_stale_temporaries(path: str | os.PathLike, suffix: str = ".tmp") -> list[str]:
    """Removes temporary files left next to `path` by writers that were killed (their process is gone).
    Returns the paths removed."""
    path = os.path.abspath(os.fspath(path))
    removed = []
    pattern = glob.escape(path) + ".pid*.*" + glob.escape(suffix)
    for tmp in glob.glob(pattern):
        middle = tmp[len(path) + len(".pid"):]
        pid = middle.split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            try:
                os.unlink(tmp)
                removed.append(tmp)
            except OSError:
                pass
    return removed


def check_output_path(path: str | os.PathLike) -> None:
    """Refuses a path that cannot be written as a file: a folder, or one in a folder that does not exist (an
    error that names the user's path; callers with long work ahead check before it)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder: give a file name to write")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{path}: the folder {folder} does not exist")


@contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yields a temporary path in path's folder; when the block succeeds the file is renamed over
    `path` (with the permissions a plain open() would give), when it fails it is removed. `suffix`
    keeps writers that choose a format by extension (numpy, matplotlib) happy."""
    path = os.fspath(path)
    check_output_path(path)
    remove_stale_temporaries(path, suffix)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{os.path.basename(path)}.pid{os.getpid()}.", suffix=suffix)
    except OSError as e:  # (its message would name the temporary file, not the user's)
        raise OSError(e.errno, f"{path}: cannot create a file in {folder}: {e.strerror}") from None
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
