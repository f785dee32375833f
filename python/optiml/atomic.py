"""Output files that appear whole or not at all."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yields a temporary path in path's folder; when the block succeeds the file is renamed over
    `path` (with the permissions a plain open() would give), when it fails it is removed. `suffix`
    keeps writers that choose a format by extension (numpy, matplotlib) happy."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".",
                               suffix=suffix)
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
